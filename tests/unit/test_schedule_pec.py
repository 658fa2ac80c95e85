"""TrainPipelinePEC's exact order of work (fill, steady state, drain), from the schedule recorder.

The fake model's sharded module is not a PEC module, so the PEC verbs run
empty; they are recorded all the same, which is what keeps the schedule's
shape independent of the model.  Training must match the plain loop.
"""

from __future__ import annotations

import inspect
from typing import List

import pytest
import torch

from tests.unit.fakes import TinyModel, assert_same_training, drain, make_batches, optimizer_for, plain_loop
from trec_pipelines import TrainPipelinePEC

CPU = torch.device("cpu")

FILL = [
    "P0 H2D[i0]@memcpy",
    "P0 InputDistStart[i0]@data_dist",
    "P0 InputDistWait[i0]@data_dist",
    "P0 OverlapDist[i0]@data_dist",
    "P0 NOLLookup[i0]@default",
    "P0 H2D[i1]@memcpy",
    "P0 InputDistStart[i1]@data_dist",
    "P0 InputDistWait[i1]@data_dist",
]

# {p}: the batch whose NOL gradient was deferred to this step (none in the first).
STEP = (
    "P{P} WaitBatch[i{i}]@default",
    "P{P} H2D[i{m}]@memcpy",
    "P{P} OLLookup[i{i}]@default",
    "P{P} EmbLookup[i{i}]@default",
    "P{P} OverlapDist[i{n}]@data_dist",
    "P{P} InputDistStart[i{m}]@data_dist",
    "P{P} NOLGradStart[{p}]@default",
    "P{P} ZeroGrad[i{i}]@default",
    "P{P} Forward[i{i}]@default",
    "P{P} InputDistWait[i{m}]@data_dist",
    "P{P} NOLGradApply[{p}]@default",
    "P{P} NOLLookup[i{n}]@default",
    "P{P} Backward[i{i}]@default",
    "P{P} OLGradStart[i{i}]@default",
    "P{P} OptimizerStep[i{i}]@default",
    "P{P} OLGradApply[i{i}]@default",
)

# The last batch: its overlap dist has no successor, and it applies its own NOL gradient.
LAST_STEP_END = (
    "P{P} NOLGradStart[i{i}]@default",
    "P{P} NOLGradApply[i{i}]@default",
)


def _beyond(action: str, n: int) -> bool:
    """True for an action on a batch the loader never yielded."""
    batch = action.split("[")[1].split("]")[0]
    return batch != "--" and int(batch[1:]) >= n


def pec_schedule(n: int) -> List[str]:
    """The exact recorded sequence of ``n`` batches."""
    actions = list(FILL[:5] if n == 1 else FILL)
    for i in range(n):
        fields = dict(P=i, i=i, n=i + 1, m=i + 2, p="--" if i == 0 else f"i{i - 1}")
        step = [s.format(**fields) for s in STEP]
        if i == n - 1:
            step = [a.replace(f"OverlapDist[i{i + 1}]", f"OverlapDist[i{i}]") for a in step]
            step += [s.format(**fields) for s in LAST_STEP_END]
        actions += [a for a in step if not _beyond(a, n)]
    return actions


@pytest.mark.parametrize("n_batches", [1, 2, 3, 5])
def test_pec_fill_steady_drain(n_batches: int) -> None:
    batches = make_batches(n_batches)
    model, ref = TinyModel(), TinyModel()
    pipeline = TrainPipelinePEC(model, optimizer_for(model), CPU)
    pipeline.enable_schedule_recording()
    outputs = drain(pipeline, iter(batches))
    assert [str(a) for a in pipeline.schedule_actions] == pec_schedule(n_batches)
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)


def test_pec_print_schedule() -> None:
    model = TinyModel()
    pipeline = TrainPipelinePEC(model, optimizer_for(model), CPU)
    pipeline.enable_schedule_recording()
    drain(pipeline, iter(make_batches(5)))
    rows = {task: (stream, cells) for task, stream, cells in pipeline.schedule()}
    assert rows["OverlapDist"] == ("data_dist", [(0, 1), 2, 3, 4, 4])
    assert rows["NOLLookup"] == ("default", [(0, 1), 2, 3, 4, None])
    assert rows["NOLGradApply"] == ("default", [None, 0, 1, 2, (3, 4)])
    assert rows["Forward"] == ("default", [0, 1, 2, 3, 4])
    assert rows["H2D"] == ("memcpy", [(0, 1, 2), 3, 4, None, None])


def test_pec_eval_mode_only_looks_up() -> None:
    """In eval mode no gradient verb runs and the model is unchanged."""
    model = TinyModel().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pipeline = TrainPipelinePEC(model, optimizer_for(model), CPU)
    pipeline.enable_schedule_recording()
    with torch.no_grad():
        outputs = drain(pipeline, iter(make_batches(3)))
    assert len(outputs) == 3
    tasks = {a.task for a in pipeline.schedule_actions}
    assert not tasks & {"Backward", "OLGradStart", "OptimizerStep", "ZeroGrad"}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_constructor_is_torchrecs() -> None:
    """torchrec 1.9.2's parameters, in its order, then our keyword-only ones."""
    params = list(inspect.signature(TrainPipelinePEC.__init__).parameters.values())[1:]
    assert [(p.name, p.default) for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY] == [
        ("model", inspect.Parameter.empty),
        ("optimizer", inspect.Parameter.empty),
        ("device", inspect.Parameter.empty),
        ("execute_all_batches", True),
        ("apply_jit", False),
        ("custom_model_fwd", None),
    ]
    assert [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY] == [
        "rewrite_strategy",
        "on_unpipelined",
        "sync_exhaustion",
    ]


def test_pec_keeps_host_copies_of_its_in_flight_batches_only() -> None:
    """A failed PEC step is retried from host copies: the source keeps one per
    batch in flight, and releases each once its step returned."""
    batches = make_batches(6)
    model = TinyModel()
    pipeline = TrainPipelinePEC(model, optimizer_for(model), CPU)
    it = iter(batches)
    for _ in range(len(batches)):
        pipeline.progress(it)
        assert len(pipeline._source._in_flight) == len(pipeline.batches)
