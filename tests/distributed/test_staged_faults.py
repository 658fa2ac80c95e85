"""Issue #16 for StagedTrainPipeline on 2 gloo ranks: a failure never wedges it.

The pipeline only prepares batches; the caller's loop trains them.  When the
caller's forward, backward or optimizer step raises, the caller either trains
the same batch again or moves on to the next ``progress()``; when a stage or
the data iterator raises inside ``progress()``, the caller calls it again.
Each run is compared with the plain loop that does the same over the same
batches: outputs at every step and the final weights, ``torch.equal``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Tuple

import pytest
import torch

from tests.distributed.test_faults import (
    _build,
    _malformed,
    plain_loop_with_retry_of,
)
from tests.fault_injection import Fault, FlakyIterator
from tests.unit.test_forward_watch import FakeNews
from trec_pipelines.core import peer_failure
from trec_pipelines.core.errors import MalformedBatchError
from trec_pipelines.pipelines.sparse_data_dist_util import SparseDataDistUtil
from trec_pipelines.pipelines.staged import PipelineStage, StagedTrainPipeline
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    Run,
    _snapshot,
    assert_runs_equal,
    make_batches,
    make_sharded,
    weights,
)
from trec_pipelines.testing.references import kept, plain_loop_of

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 11
FAULT_POINTS = ["before_lookup", "after_lookup", "backward", "optimizer"]


def _faulty(where: str, at: int) -> Tuple[Any, Any]:
    """A sharded FaultyDLRM and a FaultyOptimizer: one of them raises at call ``at``
    (test_faults' builder, so the retry reference it keeps is this model's)."""
    return _build(where, at)


def _staged(
    dmp: Any,
    third_stage: Optional[str] = None,
    wrap: Optional[Callable[[str, Callable[[Any], Any]], Callable[[Any], Any]]] = None,
) -> StagedTrainPipeline:
    """h2d, input_dist and an optional prefetch stage, every stream None (CPU);
    ``wrap(name, runnable)`` may replace a stage's runnable."""
    wrap = wrap or (lambda name, runnable: runnable)
    sdd = SparseDataDistUtil(dmp, data_dist_stream=None)
    stages = [
        PipelineStage("h2d", wrap("h2d", lambda batch: batch.to(DEVICE, non_blocking=True)), None),
        sdd.start_sparse_data_dist_stage(runnable=wrap("input_dist", sdd.start_sparse_data_dist)),
    ]
    if third_stage == "prefetch":
        sdd.stage_declared("prefetch")  # a wrapped runnable hides whose prefetch it is
        stages.append(PipelineStage("prefetch", wrap("prefetch", sdd.prefetch), None))
    return StagedTrainPipeline(stages)


def _train_step(model: Any, optimizer: Any, batch: Any) -> torch.Tensor:
    optimizer.zero_grad()
    loss, out = model(batch)
    torch.sum(loss, dim=0).backward()
    optimizer.step()
    return _snapshot(out)


def train_staged(
    pipeline: StagedTrainPipeline, model: Any, optimizer: Any, batches: List[Any], retry: bool
) -> Run:
    """The caller's loop; a failed step is trained again (``retry``) or left behind."""
    it = iter(batches)
    outputs, failures = [], 0
    while (batch := pipeline.progress(it)) is not None:
        while True:
            try:
                outputs.append(_train_step(model, optimizer, batch))
            except Fault:
                failures += 1
                if retry:
                    continue
            break
    assert failures == 1
    return Run(outputs, weights(model))


def plain_loop_with_skip(model: Any, optimizer: Any, batches: List[Any]) -> Run:
    """The plain loop that moves on to the next batch when a step raises."""
    model.train()
    outputs = []
    for batch in batches:
        try:
            outputs.append(_train_step(model, optimizer, batch))
        except Fault:
            continue
    return Run(outputs, weights(model))


def plain_loop_with_skip_of(where: str, at: int, batches: List[Any]) -> Run:
    """``plain_loop_with_skip(*_faulty(where, at), batches)``, trained once per run for
    the same inputs: the two ``third_stage`` parametrizations meet the same fault
    (see [Note: one reference per input] in trec_pipelines/testing/references.py)."""
    return kept(
        f"{__name__}.plain_loop_with_skip:FaultyDLRM;table_wise;{SEED}",
        (where, at, batches),
        lambda: plain_loop_with_skip(*_faulty(where, at), batches),
    )


# --------------------------------------------------- faults in the caller's loop


@pytest.mark.parametrize("third_stage", [None, "prefetch"])
@pytest.mark.parametrize("at", [0, 3])
@pytest.mark.parametrize("where", FAULT_POINTS)
def test_retrying_the_failed_batch_equals_the_plain_loop_with_retry(
    where: str, at: int, third_stage: Optional[str]
) -> None:
    batches = make_batches(6, seed=DATA_SEED)
    ref = plain_loop_with_retry_of(where, at, batches)
    dmp, optimizer = _faulty(where, at)
    ours = train_staged(_staged(dmp, third_stage), dmp, optimizer, batches, retry=True)
    assert_runs_equal(
        ref, ours, ("plain loop with retry", f"staged, {where} at {at}, {third_stage}")
    )


@pytest.mark.parametrize("third_stage", [None, "prefetch"])
@pytest.mark.parametrize("at", [3, 5])
@pytest.mark.parametrize("where", FAULT_POINTS)
def test_skipping_the_failed_batch_equals_the_plain_loop_that_skips_it(
    where: str, at: int, third_stage: Optional[str]
) -> None:
    """Batch 5 is the last: its skip is caught up while the pipeline drains."""
    batches = make_batches(6, seed=DATA_SEED)
    ref = plain_loop_with_skip_of(where, at, batches)
    dmp, optimizer = _faulty(where, at)
    ours = train_staged(_staged(dmp, third_stage), dmp, optimizer, batches, retry=False)
    assert_runs_equal(
        ref, ours, ("plain loop with skip", f"staged, {where} at {at}, {third_stage}")
    )


# ------------------------------------------------- faults inside progress()


class RaisesOnce:
    """Wraps a stage runnable; its call number ``at`` raises before running it."""

    def __init__(self, runnable: Callable[[Any], Any], at: int) -> None:
        self._runnable, self._at, self.calls = runnable, at, 0

    def __call__(self, batch: Any) -> Any:
        call, self.calls = self.calls, self.calls + 1
        if call == self._at:
            raise Fault(f"injected in a stage, call {call}")
        return self._runnable(batch)


def train_calling_progress_again(
    pipeline: StagedTrainPipeline, model: Any, optimizer: Any, it: Iterator[Any]
) -> Run:
    outputs, failures = [], 0
    while True:
        try:
            batch = pipeline.progress(it)
        except Fault:
            failures += 1
            continue
        if batch is None:
            break
        outputs.append(_train_step(model, optimizer, batch))
    assert failures == 1
    return Run(outputs, weights(model))


# (the stage that raises, the third stage): prefetch raises only where there is one.
STAGE_FAULTS = [
    ("h2d", None),
    ("input_dist", None),
    ("h2d", "prefetch"),
    ("input_dist", "prefetch"),
    ("prefetch", "prefetch"),
]


@pytest.mark.parametrize("at", [0, 1, 4])
@pytest.mark.parametrize("stage,third_stage", STAGE_FAULTS)
def test_a_stage_that_raises_is_run_again_and_training_equals_the_plain_loop(
    stage: str, third_stage: Optional[str], at: int
) -> None:
    """Calls 0 and 1 are in the fill, 4 in the steady state."""
    batches = make_batches(6, seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)

    def wrap(name: str, runnable: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return RaisesOnce(runnable, at) if name == stage else runnable

    ours = train_calling_progress_again(
        _staged(dmp, third_stage, wrap), dmp, optimizer, iter(batches)
    )
    assert_runs_equal(ref, ours, ("plain loop", f"staged, {stage} raised at call {at}"))


@pytest.mark.parametrize("third_stage", [None, "prefetch"])
@pytest.mark.parametrize("at", [0, 2, 4])
def test_an_iterator_that_raises_loses_and_repeats_nothing(
    at: int, third_stage: Optional[str]
) -> None:
    """The plain loop over such an iterator just skips the exception: same batches."""
    batches = make_batches(6, seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    it = FlakyIterator(batches, at)
    ours = train_calling_progress_again(_staged(dmp, third_stage), dmp, optimizer, it)
    assert_runs_equal(ref, ours, ("plain loop", f"staged, iterator raised at call {at}"))


# --------------------------------------- poison and malformed batches


class Poisoned:
    """Wraps a stage runnable; raises every time it is given the batch whose
    dense features are ``poison``'s (on every rank), runs it on the others."""

    def __init__(self, runnable: Callable[[Any], Any], poison: Any) -> None:
        self._runnable, self._dense, self.raised = runnable, poison.dense, 0

    def __call__(self, batch: Any) -> Any:
        if torch.equal(batch.dense, self._dense):
            self.raised += 1
            raise Fault(f"poison batch, attempt {self.raised}")
        return self._runnable(batch)


@pytest.mark.parametrize("at", [0, 1, 3, 5])
@pytest.mark.parametrize(
    "stage,third_stage",
    [("input_dist", None), ("input_dist", "prefetch"), ("prefetch", "prefetch")],
)
def test_a_poison_batch_skipped_after_retrying_equals_the_plain_loop_without_it(
    stage: str, third_stage: Optional[str], at: int
) -> None:
    """0 and 1 fail in the fill (prefetch: 0 only), 3 in the steady state, 5 is the last batch."""
    batches = make_batches(6, seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches[:at] + batches[at + 1 :], seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    poisoned: List[Poisoned] = []

    def wrap(name: str, runnable: Callable[[Any], Any]) -> Callable[[Any], Any]:
        if name != stage:
            return runnable
        poisoned.append(Poisoned(runnable, batches[at]))
        return poisoned[0]

    pipeline = _staged(dmp, third_stage, wrap)
    it = iter(batches)
    outputs, skipped = [], []
    while True:
        try:
            batch = pipeline.progress(it)
        except Fault:
            if poisoned[0].raised < 2:
                continue  # the retry fails again: a poison batch
            skipped.append(pipeline.skip_failed_batch())
            continue
        if batch is None:
            break
        outputs.append(_train_step(dmp, optimizer, batch))
    assert skipped == [at] and poisoned[0].raised == 2
    assert_runs_equal(
        ref,
        Run(outputs, weights(dmp)),
        ("plain loop without the poison batch", f"staged, {stage} at {at}"),
    )


@pytest.mark.parametrize("third_stage", [None, "prefetch"])
@pytest.mark.parametrize("at", [0, 2, 5])
def test_a_malformed_batch_raises_before_any_stage_and_training_equals_the_plain_loop_without_it(
    at: int, third_stage: Optional[str]
) -> None:
    batches = make_batches(6, seed=DATA_SEED)
    good = batches[:at] + batches[at + 1 :]
    batches[at] = _malformed(batches[at], drop=3)
    ref = plain_loop_of(DLRM, "table_wise", good, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = _staged(dmp, third_stage)
    it = iter(batches)
    outputs = []
    with pytest.raises(
        MalformedBatchError,
        match=rf"batch {at}: malformed on ranks [0-9, ]+, dropped on every rank.*key '.*'.*3 missing",
    ):
        while (batch := pipeline.progress(it)) is not None:
            outputs.append(_train_step(dmp, optimizer, batch))
    while (batch := pipeline.progress(it)) is not None:
        outputs.append(_train_step(dmp, optimizer, batch))
    assert pipeline.rejected == 1
    assert_runs_equal(
        ref,
        Run(outputs, weights(dmp)),
        ("plain loop without the malformed batch", f"staged, at {at}"),
    )


# ------------------------------------------- what the other ranks are told


def test_a_failure_of_the_forward_hook_is_told_as_a_failed_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The util's forward hook (the wait for the next batch's input_dist) runs in
    the caller's ``model(batch)``: when it raises, the peer-failure watch of the
    model's forward (:mod:`trec_pipelines.core.forward_watch`) publishes it with
    the batch, as it does a forward that raised, so a rank left waiting ends.
    The process's failure news is a fake here: nothing is written to the store."""
    news = FakeNews()
    monkeypatch.setattr(peer_failure, "news", lambda: news)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    sdd = SparseDataDistUtil(dmp, data_dist_stream=None)
    pipeline = StagedTrainPipeline(
        [
            PipelineStage("h2d", lambda batch: batch.to(DEVICE), None),
            sdd.start_sparse_data_dist_stage(),
        ]
    )
    it = iter(make_batches(4, seed=DATA_SEED))
    _train_step(dmp, optimizer, pipeline.progress(it))
    assert (news.step, news.retracts, news.failures) == (1, 1, [])
    batch = pipeline.progress(it)

    def fails() -> None:
        raise Fault("the wait for the next batch failed")

    monkeypatch.setattr(sdd, "_next_batch", fails)
    with pytest.raises(Fault):
        dmp(batch)
    assert news.step == 2
    assert news.failures == [
        ("the model's forward raised Fault: the wait for the next batch failed", 1)
    ]
