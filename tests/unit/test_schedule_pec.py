"""TrainPipelinePEC's exact order of work (fill, steady state, drain), from the schedule recorder.

The fake model's sharded module is not a PEC module, so the PEC verbs run
empty; they are recorded all the same, which is what keeps the schedule's
shape independent of the model.  Training must match the plain loop.
"""

from __future__ import annotations

import inspect
from typing import Any, List, Optional, Tuple

import pytest
import torch

from tests.fault_injection import Fault
from tests.unit.fakes import (
    TinyModel,
    assert_same_training,
    drain,
    make_batches,
    optimizer_for,
    plain_loop,
)
from tests.unit.test_step_guard import FaultyModel, FaultyOptimizer, plain_loop_with_retry
from trec_pipelines import TrainPipelinePEC
from trec_pipelines.sparse import pec_ops

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
    assert [
        (p.name, p.default) for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY
    ] == [
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
        "agree_ahead",
        "validate_batches",
        "input_dist_group",
        "autocast_dtype",
        "grad_scaler",
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


# ------------------------------------------------- a failed step, retried


class _GradUpdate:
    """Stands in for a PEC gradient awaitable: waiting it fires the applier, once."""

    def __init__(
        self, log: List[Tuple[str, Optional[int]]], kind: str, batch: Optional[int]
    ) -> None:
        self._log, self._kind, self._batch = log, kind, batch
        self._fired = False

    def wait(self) -> None:
        assert not self._fired, f"{self._kind} gradient of batch {self._batch} applied twice"
        self._fired = True
        self._log.append((f"{self._kind} apply", self._batch))


class FakePECGradients:
    """The gradient half of a PEC module, logging each all-to-all start and apply;
    its module context is the batch index."""

    def __init__(self) -> None:
        self.log: List[Tuple[str, Optional[int]]] = []

    def grad_dist(
        self, module_ctx: Optional[int], features: Any, is_overlapped: bool
    ) -> List[_GradUpdate]:
        kind = "OL" if is_overlapped else "NOL"
        self.log.append((f"{kind} start", module_ctx))
        return [_GradUpdate(self.log, kind, module_ctx)]


def _with_fake_pec_gradients(
    pipeline: TrainPipelinePEC, monkeypatch: pytest.MonkeyPatch
) -> FakePECGradients:
    """Give ``pipeline`` one PEC module whose partitions are empty and whose
    gradients are logged; the deferral and the NOL start/apply are the real verbs."""
    fake = FakePECGradients()
    monkeypatch.setattr(pipeline, "_pec_modules", lambda: [("pec", fake)])
    monkeypatch.setattr(pec_ops, "check_pec_supported", lambda modules, name: None)
    monkeypatch.setattr(pec_ops, "partition_lookup", lambda modules, context, overlapped: None)

    def overlap_dist(modules: Any, current: Any, previous: Any, **streams: Any) -> None:
        if previous is not None:  # previous's backward partition: what defer_nol_grad reads
            previous.pec_backward_ctxs["pec"] = []
            previous.module_contexts["pec"] = previous.index

    def start_ol_grad(modules: Any, context: Any, consumer: Any) -> pec_ops.GradAwaitables:
        return {"pec": fake.grad_dist(context.index, None, is_overlapped=True)}

    monkeypatch.setattr(pec_ops, "overlap_dist", overlap_dist)
    monkeypatch.setattr(pec_ops, "start_ol_grad", start_ol_grad)
    return fake


# The retry of batch 3 (progress call 4) refills the pipeline as FILL does, from batch 3;
# batch 2's NOL gradient, if still owed, is applied before it.
RETRY_FILL = [
    "P4 H2D[i3]@memcpy",
    "P4 InputDistStart[i3]@data_dist",
    "P4 InputDistWait[i3]@data_dist",
    "P4 OverlapDist[i3]@data_dist",
    "P4 NOLLookup[i3]@default",
    "P4 H2D[i4]@memcpy",
    "P4 InputDistStart[i4]@data_dist",
    "P4 InputDistWait[i4]@data_dist",
]


@pytest.mark.parametrize(
    "where, owed",
    [("before_lookup", True), ("after_lookup", True), ("backward", False), ("optimizer", False)],
)
def test_pec_retry_applies_the_previous_batchs_nol_gradient_once(
    where: str, owed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch 3's step fails.  A fault in the forward leaves batch 2's NOL gradient
    started and not applied: the rollback keeps it on the pipeline, and the retry
    applies it before refilling.  Later faults find it applied.  Either way every
    batch's NOL and OL gradients are applied once, in order; the failed attempt's
    own OL gradient (started before the optimizer raised) is dropped."""
    batches = make_batches(6)
    at = 3
    model, ref = FaultyModel(where, at if where != "optimizer" else -1), TinyModel()
    pipeline = TrainPipelinePEC(
        model, FaultyOptimizer(model.parameters(), at if where == "optimizer" else -1), CPU
    )
    fake = _with_fake_pec_gradients(pipeline, monkeypatch)
    pipeline.enable_schedule_recording()
    it = iter(batches)
    outputs = [pipeline.progress(it) for _ in range(at)]
    with pytest.raises(Fault):
        pipeline.progress(it)
    deferred = pipeline._deferred_nol_grad
    assert (deferred.pending, deferred.batch) == ((True, 2) if owed else (False, None))
    if owed:
        assert not deferred.inputs and list(deferred.started) == ["pec"]  # started, not applied
    assert not pipeline.batches and not pipeline.contexts

    outputs += drain(pipeline, it)
    retry = [str(a) for a in pipeline.schedule_actions if str(a).startswith("P4 ")]
    owed_actions = ["P4 NOLGradStart[i2]@default", "P4 NOLGradApply[i2]@default"] if owed else []
    assert retry[: len(owed_actions) + len(RETRY_FILL)] == owed_actions + RETRY_FILL
    applied = [(kind, batch) for kind, batch in fake.log if kind.endswith("apply")]
    assert [b for k, b in applied if k == "NOL apply"] == list(range(6))
    assert [b for k, b in applied if k == "OL apply"] == list(range(6))
    ol_starts = [b for k, b in fake.log if k == "OL start"]
    assert ol_starts == [0, 1, 2, 3, 3, 4, 5] if where == "optimizer" else list(range(6))
    ref_outputs = plain_loop_with_retry(ref, optimizer_for(ref), batches)
    assert_same_training(outputs, ref_outputs, model, ref)


def test_pec_reset_applies_the_deferred_nol_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """reset() drops the batches in flight, not the NOL gradient of one already trained."""
    model = TinyModel()
    pipeline = TrainPipelinePEC(model, optimizer_for(model), CPU)
    fake = _with_fake_pec_gradients(pipeline, monkeypatch)
    it = iter(make_batches(6))
    pipeline.progress(it), pipeline.progress(it)
    assert pipeline._deferred_nol_grad.pending
    pipeline.reset()
    assert not pipeline._deferred_nol_grad.pending
    assert [b for k, b in fake.log if k == "NOL apply"] == [0, 1]


def test_pec_epoch_cut_short_applies_the_last_trained_batchs_nol_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """execute_all_batches=False: the end of data drops the batches in flight, and the
    model must still hold every update of the batches that were trained."""
    model = TinyModel()
    pipeline = TrainPipelinePEC(model, optimizer_for(model), CPU, execute_all_batches=False)
    fake = _with_fake_pec_gradients(pipeline, monkeypatch)
    it = iter(make_batches(4))
    trained = 0
    with pytest.raises(StopIteration):
        while True:
            pipeline.progress(it)
            trained += 1
    assert trained == 2  # batches 2 and 3 were in flight when the data ended
    assert not pipeline._deferred_nol_grad.pending
    assert [b for k, b in fake.log if k == "NOL apply"] == [0, 1]
