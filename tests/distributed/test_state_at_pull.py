"""torchrec's attributes read inside a ``_next_batch`` override as on torchrec's, on 2 gloo ranks.

torchrec calls ``_next_batch`` from its copy stage, with its queues as they
stand then: ``batches`` and ``contexts`` empty in the fill's first pull, one
batch in its second, the two in flight in a step's.  An override may read
them (a prediction pipeline pads a rank whose data ended with a copy of
``self.batches[0]``), so a class of ours with a user's ``_next_batch`` pulls
at that moment too (see ``[Note: a user's _next_batch pulls at torchrec's
moment]`` in :mod:`trec_pipelines.core.subclass_hooks`).  For each class whose
torchrec twin runs here, the same recording subclass of torchrec's class and
of ours reads, at the entry of every pull, every attribute torchrec's
``vars()`` holds then (less those :mod:`tests.state_parity` lists as not
applicable), and the readings must be equal pull for pull, up to the pull
that finds the end of the data (torchrec's polls an ended iterator again; ours
stops pulling).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import pytest

from tests.hook_parity import ours, torchrec_class
from tests.state_parity import UNTIL_THE_END, describe, known_objects, not_applicable, snapshot
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import DLRM, make_batches, make_sharded, run_pipeline
from trec_pipelines.testing.torchrec_cpu import torchrec_on_cpu

DEVICE = devices.device()
SEED, DATA_SEED, BATCHES = 1234, 5, 5

# torchrec makes a batch's context before pulling it (so its counter is one ahead
# inside the pull); ours makes it once a batch came.  Read between steps, both agree
# (tests/distributed/test_state.py).
AT_THE_PULL: Set[str] = {"_next_index"}

# name -> (torchrec's class runs only under the shim, kwargs).  The classes that pull
# through _next_batch (torchrec's Eval loads on a thread of its own and never calls it).
RUNNABLE: Dict[str, Tuple[bool, Dict[str, Any]]] = {
    "TrainPipelineBase": (False, {}),
    "TrainPipelineSparseDist": (False, {}),
    "TrainPipelineSparseDistLite": (False, {}),
    "TrainPipelineFusedSparseDist": (True, {}),
    "TrainPipelineSemiSync": (True, {"start_batch": 2}),
    "EvalPipelineFusedSparseDist": (True, {}),
}

Reading = Tuple[Dict[str, Any], Any]


def reading_at_each_pull(base: type, readings: List[Reading], context: Dict[str, Any]) -> type:
    """``base`` whose ``_next_batch`` reads the pipeline's attributes on entry (those of
    ``context["names"]``, or, when None, every one in ``vars()``), then pulls."""

    def _next_batch(self: Any, dataloader_iter: Iterator[Any]) -> Optional[Any]:
        names = context["names"]
        if names is None:
            names = sorted(n for n in vars(self) if n not in context["leave_out"])
        else:
            names = names[len(readings)] if len(readings) < len(names) else []
        here = snapshot(self, names, context["batches"], context["known"])
        batch = base._next_batch(self, dataloader_iter)
        readings.append((here, describe(batch, context["batches"], context["known"])))
        return batch

    namespace = {"__module__": "user_subclass", "_next_batch": _next_batch}
    return type(f"ReadingAtPull{base.__name__}", (base,), namespace)


def _pulls(name: str, theirs: bool, names: Optional[List[List[str]]]) -> List[Reading]:
    """The reading at each pull of one epoch, up to the one that found the end."""
    shim, kwargs = RUNNABLE[name]
    parent = torchrec_class(name) if theirs else ours(name)
    assert parent is not None
    batches = make_batches(BATCHES, seed=DATA_SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    evaluating = name.startswith("Eval")
    if evaluating:
        dmp.eval()
    it = iter(batches)
    context: Dict[str, Any] = {
        "names": names,
        "batches": batches,
        "leave_out": set(not_applicable(name)) | set(UNTIL_THE_END) | AT_THE_PULL,
        "known": known_objects(
            iterator=it, model=dmp, optimizer=None if evaluating else optimizer, device=DEVICE
        ),
    }
    readings: List[Reading] = []
    cls = reading_at_each_pull(parent, readings, context)
    with torchrec_on_cpu() if shim and theirs else contextlib.nullcontext():
        pipeline = cls(dmp, None if evaluating else optimizer, DEVICE, **kwargs)
        run = run_pipeline(pipeline, it, model=dmp)
    assert len(run) == BATCHES
    ended = [k for k, (_, batch) in enumerate(readings) if batch is None]
    assert ended, f"{name}: no pull found the end of the data"
    return readings[: ended[0] + 1]


@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_a_next_batch_override_reads_torchrecs_state_at_torchrecs_moment(name: str) -> None:
    theirs = _pulls(name, True, None)
    names = [sorted(reading) for reading, _ in theirs]
    got = _pulls(name, False, names)
    assert [batch for _, batch in got] == [batch for _, batch in theirs]
    differ = [
        (pull, attribute, expected[attribute], reading.get(attribute))
        for pull, ((expected, _), (reading, _)) in enumerate(zip(theirs, got, strict=True))
        for attribute in expected
        if reading.get(attribute) != expected[attribute]
    ]
    for pull, attribute, expected_value, value in differ:
        print(f"{name} pull {pull} {attribute}: torchrec {expected_value!r} ours {value!r}")
    assert not differ
    # Each pull read torchrec's queues (Base: its copied batch), not an empty set.
    queues = {"batches", "contexts"} if name != "TrainPipelineBase" else {"_cur_batch"}
    assert all(queues <= set(reading) for reading, _ in theirs), names
