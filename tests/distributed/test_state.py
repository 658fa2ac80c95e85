"""torchrec's instance attributes read on ours as on torchrec's (generated).

For each class whose torchrec twin runs here (some only under the test shim,
:mod:`trec_pipelines.testing.torchrec_cpu`), the same model trains the same
batches under torchrec's class and ours, and at four points of the epoch
(after construction, after the first ``progress()``, mid-epoch and after
``StopIteration``) every attribute in torchrec's ``vars()`` is read on both:
a batch by content, an iterator, model or optimizer by identity, booleans,
numbers and streams (None on CPU) by value.  Attributes listed in
:data:`tests.state_parity.NOT_APPLICABLE` are left out; any other attribute
must read the same.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Tuple

import pytest

from tests.hook_parity import ours, torchrec_class
from tests.state_parity import (
    UNTIL_THE_END,
    every_attribute,
    known_objects,
    not_applicable,
    run_to,
    snapshot,
)
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import DLRM, make_batches, make_sharded
from trec_pipelines.testing.torchrec_cpu import torchrec_on_cpu

DEVICE = devices.device()
SEED, DATA_SEED, BATCHES = 1234, 5, 6
# The points of the epoch the attributes are read at: name -> progress() calls before it.
POINTS: Tuple[Tuple[str, Any], ...] = (("construction", 0), ("fill", 1), ("mid", 2), ("end", None))

# name -> (torchrec's class runs only under the shim, kwargs)
RUNNABLE: Dict[str, Tuple[bool, Dict[str, Any]]] = {
    "TrainPipelineBase": (False, {}),
    "TrainPipelineSparseDist": (False, {}),
    "TrainPipelineSparseDistLite": (False, {}),
    "TrainPipelineFusedSparseDist": (True, {}),
    "TrainPipelineSemiSync": (True, {"start_batch": 2}),
    "EvalPipelineSparseDist": (True, {}),
    "EvalPipelineFusedSparseDist": (True, {}),
}


Reading = Dict[str, Any]


def _readings(name: str, theirs: bool, names: List[List[str]]) -> List[Reading]:
    """Each point's reading of the attributes: on torchrec's class (``theirs``) every
    attribute in its ``vars()``, on ours those of ``names`` at the same point."""
    shim, kwargs = RUNNABLE[name]
    cls = torchrec_class(name) if theirs else ours(name)
    assert cls is not None
    batches = make_batches(BATCHES, seed=DATA_SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    evaluating = name.startswith("Eval")
    if evaluating:
        dmp.eval()
    it = iter(batches)
    known = known_objects(
        iterator=it, model=dmp, optimizer=None if evaluating else optimizer, device=DEVICE
    )
    readings: List[Reading] = []
    with torchrec_on_cpu() if shim and theirs else contextlib.nullcontext():
        pipeline = cls(dmp, None if evaluating else optimizer, DEVICE, **kwargs)
        for k, (_, steps) in enumerate(POINTS):
            run_to(pipeline, it, steps)
            here = every_attribute(pipeline) if theirs else names[k]
            readings.append(snapshot(pipeline, here, batches, known))
    return readings


@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_torchrecs_attributes_read_the_same_on_ours(name: str) -> None:
    theirs = _readings(name, True, [])
    leave_out = not_applicable(name)
    names = [[a for a in sorted(reading) if a not in leave_out] for reading in theirs]
    got = _readings(name, False, names)
    differ = []
    for (point, _), here, expected, reading in zip(POINTS, names, theirs, got, strict=True):
        for attribute in here:
            if point == "end" and attribute in UNTIL_THE_END:
                continue
            if reading[attribute] != expected[attribute]:
                differ.append((point, attribute, expected[attribute], reading[attribute]))
    for point, attribute, expected_value, value in differ:
        print(f"{name} {point} {attribute}: torchrec {expected_value!r} ours {value!r}")
    assert not differ
    # Every point read something: the comparison is not empty.
    assert all(len(here) >= 8 for here in names), names
