"""StagedTrainPipeline with SparseDataDistUtil stages against the plain loop, on 2 gloo ranks.

The pipeline only prepares batches (copy, input_dist); the test's own loop
trains them with the same four calls as the plain loop, so every step's output
and the final weights must be ``torch.equal``.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import pytest
import torch
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipelineSemiSync as UpstreamSemiSync,
)

from trec_pipelines.pipelines.sparse_data_dist_util import SparseDataDistUtil
from trec_pipelines.pipelines.staged import PipelineStage, StagedTrainPipeline
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    SHARDING_TYPES,
    Run,
    assert_runs_equal,
    make_batches,
    make_sharded,
    run_pipeline,
    weights,
)
from trec_pipelines.testing.references import plain_loop_of
from trec_pipelines.testing.torchrec_cpu import shim_active, torchrec_on_cpu

DEVICE = devices.device()
CPU_STREAM = torch.Stream(device="cpu")
SEED, DATA_SEED = 1234, 7


class Counting:
    """Iterates ``items`` and counts how many were taken."""

    def __init__(self, items: List[Any]) -> None:
        self._it = iter(items)
        self.taken = 0

    def __iter__(self) -> "Counting":
        return self

    def __next__(self) -> Any:
        item = next(self._it)
        self.taken += 1
        return item


def staged_run(
    sharding_type: str,
    batches: List[Any],
    third_stage: Optional[str] = None,
    after_step: Optional[Callable[[StagedTrainPipeline, int], None]] = None,
    on_flush_end: Optional[Callable[[], None]] = None,
    it: Optional[Any] = None,
    stream: Optional[torch.Stream] = CPU_STREAM,
) -> Run:
    """``stream=None``: every stream left None, as a CPU user writes it."""
    dmp, optimizer = make_sharded(DLRM, sharding_type, seed=SEED)
    sdd = SparseDataDistUtil(
        dmp,
        data_dist_stream=stream,
        prefetch_stream=stream if third_stage == "prefetch" else None,
    )
    stages = [
        PipelineStage("h2d", lambda batch: batch.to(DEVICE, non_blocking=True), stream),
        sdd.start_sparse_data_dist_stage(),
    ]
    if third_stage == "prefetch":
        stages.append(PipelineStage("prefetch", sdd.prefetch, sdd.prefetch_stream))
    elif third_stage == "lookup":
        stages.append(sdd.start_embedding_lookup_stage())
    pipeline = StagedTrainPipeline(stages, on_flush_end=on_flush_end)
    outputs = []
    source = it if it is not None else iter(batches)
    while (batch := pipeline.progress(source)) is not None:
        assert not shim_active()
        optimizer.zero_grad()
        loss, pred = dmp(batch)
        torch.sum(loss, dim=0).backward()
        optimizer.step()
        outputs.append(pred.detach().clone())
        if after_step is not None:
            after_step(pipeline, len(outputs))
    assert sdd.rewrite_result is not None and sdd.rewrite_result.names == ["ebc"]
    return Run(outputs, weights(dmp))


@pytest.mark.parametrize("sharding_type", SHARDING_TYPES)
def test_h2d_and_input_dist_stages_match_plain_loop(sharding_type: str) -> None:
    batches = make_batches(seed=DATA_SEED)
    ref = plain_loop_of(DLRM, sharding_type, batches, seed=SEED)
    ours = staged_run(sharding_type, batches)
    assert len(ref) == len(batches)
    assert_runs_equal(ref, ours, ("plain_loop", "staged"))


def test_prefetch_stage_matches_plain_loop() -> None:
    batches = make_batches(seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    ours = staged_run("table_wise", batches, third_stage="prefetch")
    assert_runs_equal(ref, ours, ("plain_loop", "staged+prefetch"))


@pytest.mark.parametrize("flush_after", [1, 4])
def test_flush_mid_stream_loses_and_repeats_nothing(flush_after: int) -> None:
    batches = make_batches(seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    it = Counting(batches)
    trained: List[int] = []
    flushes: List[tuple] = []

    def after_step(pipeline: StagedTrainPipeline, done: int) -> None:
        trained.append(done)
        if done == flush_after:
            pipeline.set_flush(True)

    ours = staged_run(
        "table_wise",
        batches,
        after_step=after_step,
        on_flush_end=lambda: flushes.append((it.taken, len(trained))),
        it=it,
    )
    # When the flush ended every batch taken from the loader had been trained, but
    # the one pulled a step ahead while the ranks agree on it (the first one after).
    assert len(flushes) == 1
    taken, done = flushes[0]
    assert done == flush_after + 2  # the two batches in flight at the flush
    assert taken == done + 1
    assert_runs_equal(ref, ours, ("plain_loop", f"staged, flushed after {flush_after}"))


@pytest.mark.parametrize("third_stage", [None, "prefetch"])
def test_none_streams_match_plain_loop(third_stage: Optional[str]) -> None:
    """No stream anywhere: the stages run on the current stream, the prefetch
    stage included (the mode comes from the stage list, not from a stream)."""
    batches = make_batches(seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    ours = staged_run("table_wise", batches, third_stage=third_stage, stream=None)
    assert len(ref) == len(batches)
    assert_runs_equal(ref, ours, ("plain_loop", f"staged, None streams, {third_stage}"))


@pytest.mark.parametrize("stream", [None, CPU_STREAM], ids=["none", "cpu_stream"])
def test_lookup_stage_matches_torchrec_semi_sync_from_batch_0(
    stream: Optional[torch.Stream],
) -> None:
    """A lookup stage looks batch i+1 up before batch i's backward updates the
    tables: semi-synchronous from the first batch, which is what torchrec's
    TrainPipelineSemiSync(start_batch=0) computes (torchrec's own Staged
    pipeline does not run on CPU)."""
    batches = make_batches(seed=DATA_SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    with torchrec_on_cpu():
        theirs = run_pipeline(UpstreamSemiSync(dmp, optimizer, DEVICE, start_batch=0), batches)
    ours = staged_run("table_wise", batches, third_stage="lookup", stream=stream)
    assert len(theirs) == len(batches)
    assert_runs_equal(theirs, ours, ("torchrec SemiSync", "staged + lookup"))
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    assert not torch.equal(ref[1], ours[1]), "the lookup stage ran synchronously"


@pytest.mark.parametrize("k", [0, 2, 5])
def test_resumed_from_a_checkpoint_equals_the_plain_loop(k: int) -> None:
    from tests.distributed.test_resume import assert_resumed_equal

    """After ``k`` trained batches: the stages' in-flight batches (their host
    copies) are in the pipeline's state; a new pipeline over a freshly built
    model (loaded from the checkpoint) runs every stage on them again first."""
    batches = make_batches(seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)

    def build(seed: int) -> Any:
        dmp, optimizer = make_sharded(DLRM, "table_wise", seed=seed)
        sdd = SparseDataDistUtil(dmp, data_dist_stream=CPU_STREAM)
        stages = [
            PipelineStage("h2d", lambda batch: batch.to(DEVICE, non_blocking=True), CPU_STREAM),
            sdd.start_sparse_data_dist_stage(),
        ]
        return dmp, optimizer, StagedTrainPipeline(stages)

    def train(dmp: Any, optimizer: Any, pipeline: Any, it: Any, steps: int) -> List[torch.Tensor]:
        outputs = []
        while len(outputs) < steps and (batch := pipeline.progress(it)) is not None:
            optimizer.zero_grad()
            loss, pred = dmp(batch)
            torch.sum(loss, dim=0).backward()
            optimizer.step()
            outputs.append(pred.detach().clone())
        return outputs

    dmp, optimizer, pipeline = build(SEED)
    it = Counting(batches)
    outputs = train(dmp, optimizer, pipeline, it, k)
    state = pipeline.state_dict()
    dmp2, optimizer2, resumed = build(SEED + 1)
    dmp2.load_state_dict(dmp.state_dict())
    optimizer2.load_state_dict(optimizer.state_dict())
    resumed.load_state_dict(state)
    if 0 < k:
        assert resumed._resumed, "nothing was in flight: the test resumes nothing"
    outputs += train(dmp2, optimizer2, resumed, iter(batches[it.taken :]), len(batches))
    assert_resumed_equal(
        ref, Run(outputs, weights(dmp2)), ("plain loop", f"staged resumed after {k}")
    )
