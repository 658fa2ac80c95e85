"""torchrec's StagedTrainPipeline tests, adapted: TestSparseNN on 2+ gloo ranks.

From upstream's ``StagedTrainPipelineTest`` (GPU-only there):

* ``test_pipelining`` -- copy, three pass-through stages, input_dist;
* ``test_pipelining_prefetch`` -- copy, input_dist, prefetch (upstream uses
  the UVM-caching kernel, which CPU lacks; here the fused kernel, so the
  prefetch stage runs but has no cache to fill);
* ``test_pipeline_flush`` -- when ``on_flush_end`` runs and what comes out;
* ``test_model_detach`` -- detach after five steps, train the detached model,
  then let ``progress()`` attach it again.

Streams are left ``None``, as a CPU user writes it, and given as CPU streams.
torchrec's own Staged pipeline does not run on CPU (no ``device`` on a CPU
``Stream``), so the oracle is the non-pipelined copy of the model.
"""

from __future__ import annotations

from typing import Any, List, Optional

import pytest
import torch

from tests.distributed.upstream_setup import DEVICE, Setting, generate_data, non_pipelined
from trec_pipelines import PipelineStage, SparseDataDistUtil, StagedTrainPipeline
from trec_pipelines.sparse.forwards import PipelinedForward
from trec_pipelines.testing.dlrm import Run, assert_runs_equal, weights

STREAMS = {"none": None, "cpu_stream": torch.Stream(device="cpu")}


def _copy(batch: Any) -> Any:
    return batch.to(DEVICE, non_blocking=True)


def _identity(batch: Any) -> Any:
    return batch


def _train(
    pipeline: StagedTrainPipeline, model: torch.nn.Module, optimizer: Any, batches: List[Any]
) -> Run:
    it, outputs = iter(batches), []
    while (batch := pipeline.progress(it)) is not None:
        optimizer.zero_grad()
        loss, pred = model(batch)
        loss.backward()
        optimizer.step()
        outputs.append(pred.detach().clone())
    return Run(outputs, weights(model))


@pytest.mark.parametrize("stream", sorted(STREAMS))
def test_pipelining(stream: str) -> None:
    s: Optional[torch.Stream] = STREAMS[stream]
    batches = generate_data(num_batches=8, batch_size=8, seed=5)
    (ref_dmp, ref_opt), (dmp, opt) = Setting("table_wise").pair()
    ref = non_pipelined(ref_dmp, ref_opt, batches)
    sdd = SparseDataDistUtil[Any](model=dmp, data_dist_stream=s, apply_jit=False)
    stages = [
        PipelineStage(name="data_copy", runnable=_copy, stream=s),
        PipelineStage(name="gpu_postproc", runnable=_identity, stream=s),
        PipelineStage(name="gpu_postproc_1", runnable=_identity, stream=s),
        PipelineStage(name="gpu_postproc_2", runnable=_identity, stream=s),
        PipelineStage(
            name="start_sparse_data_dist",
            runnable=sdd.start_sparse_data_dist,
            stream=sdd.data_dist_stream,
            fill_callback=sdd.wait_sdd_fill_callback,
            data_exhausted_callback=sdd.data_exhausted_callback,
        ),
    ]
    ours = _train(StagedTrainPipeline(pipeline_stages=stages), dmp, opt, batches)
    assert len(ours) == len(batches)
    assert_runs_equal(ref, ours, ("non_pipelined", f"staged ({stream})"))


@pytest.mark.parametrize("stream", sorted(STREAMS))
def test_pipelining_prefetch(stream: str) -> None:
    s: Optional[torch.Stream] = STREAMS[stream]
    batches = generate_data(num_batches=8, batch_size=8, seed=6)
    (ref_dmp, ref_opt), (dmp, opt) = Setting(
        "table_wise", fused_params={"stochastic_rounding": False}
    ).pair()
    ref = non_pipelined(ref_dmp, ref_opt, batches)
    sdd = SparseDataDistUtil[Any](model=dmp, data_dist_stream=s, apply_jit=False, prefetch_stream=s)
    stages = [
        PipelineStage(name="data_copy", runnable=_copy, stream=s),
        PipelineStage(
            name="start_sparse_data_dist",
            runnable=sdd.start_sparse_data_dist,
            stream=sdd.data_dist_stream,
            fill_callback=sdd.wait_sdd_fill_callback,
            data_exhausted_callback=sdd.data_exhausted_callback,
        ),
        # No fill_callback=sdd.load_prefetch: ours needs none (and warns that it does nothing).
        PipelineStage(name="prefetch", runnable=sdd.prefetch, stream=sdd.prefetch_stream),
    ]
    ours = _train(StagedTrainPipeline(pipeline_stages=stages), dmp, opt, batches)
    assert len(ours) == len(batches)
    assert_runs_equal(ref, ours, ("non_pipelined", f"staged + prefetch ({stream})"))


def test_pipeline_flush() -> None:
    """10 batches, 3 stages: flush after the first; the three in flight still
    come out; the fourth call ends the flush (on_flush_end once) and refills;
    then the rest, then None.  Every batch is trained, as upstream's test
    implies; here it is also checked against the non-pipelined copy."""
    batches = generate_data(num_batches=10, batch_size=8, seed=7)
    (ref_dmp, ref_opt), (dmp, opt) = Setting("table_wise").pair()
    ref = non_pipelined(ref_dmp, ref_opt, batches)
    sdd = SparseDataDistUtil[Any](model=dmp, data_dist_stream=None, apply_jit=False)
    flush_ends: List[int] = []
    pipeline = StagedTrainPipeline(
        pipeline_stages=[
            PipelineStage(name="data_copy", runnable=_copy, stream=None),
            PipelineStage(name="gpu_postproc", runnable=_identity, stream=None),
            sdd.start_sparse_data_dist_stage(),
        ],
        on_flush_end=lambda: flush_ends.append(len(outputs)),
    )
    it = iter(batches)
    outputs: List[torch.Tensor] = []

    def step() -> Optional[Any]:
        batch = pipeline.progress(it)
        if batch is not None:
            opt.zero_grad()
            loss, pred = dmp(batch)
            loss.backward()
            opt.step()
            outputs.append(pred.detach().clone())
        return batch

    assert step() is not None
    pipeline.set_flush(True)
    for _ in range(3):
        assert step() is not None
    assert flush_ends == []
    assert step() is not None
    assert flush_ends == [4]  # ended once the 4 batches taken before the flush were out
    for _ in range(5):
        assert step() is not None
    assert step() is None
    assert flush_ends == [4]
    assert_runs_equal(ref, Run(outputs, weights(dmp)), ("non_pipelined", "staged, flushed"))


def test_model_detach() -> None:
    """Five steps beside the non-pipelined copy, each prediction equal; then
    ``detach()``: the sharded modules run their own forwards again and the
    model carries no hook; the detached model trains one batch and predicts
    another like the copy; then ``progress()`` attaches it again (one forward
    hook, torchrec's) and the rest of the data trains like the copy, to the end."""
    batches = generate_data(num_batches=12, batch_size=32, seed=8)
    (ref_dmp, ref_opt), (dmp, opt) = Setting("table_wise").pair()
    sdd = SparseDataDistUtil[Any](model=dmp, data_dist_stream=None, apply_jit=False)
    pipeline = StagedTrainPipeline(
        pipeline_stages=[
            PipelineStage(name="data_copy", runnable=_copy, stream=None),
            PipelineStage(
                name="start_sparse_data_dist",
                runnable=sdd.start_sparse_data_dist,
                stream=sdd.data_dist_stream,
                fill_callback=sdd.wait_sdd_fill_callback,
                data_exhausted_callback=sdd.data_exhausted_callback,
            ),
        ]
    )
    it = iter(batches)
    sparse = dmp.module.sparse
    towers = [sparse.ebc, sparse.weighted_ebc]

    def train_both(index: int) -> None:
        ref_opt.zero_grad()
        ref_loss, expected = ref_dmp(batches[index].to(DEVICE))
        ref_loss.backward()
        ref_opt.step()
        batch = pipeline.progress(it)
        assert batch is not None, f"batch {index}: the pipeline ended early"
        opt.zero_grad()
        loss, got = dmp(batch)
        loss.backward()
        opt.step()
        assert torch.equal(got, expected), f"batch {index}: prediction differs"

    def assert_attached() -> None:
        assert all(isinstance(t.forward, PipelinedForward) for t in towers)
        assert len(dmp._forward_hooks) == 1, list(dmp._forward_hooks.values())
        assert len(dmp._forward_pre_hooks) == 0, list(dmp._forward_pre_hooks.values())

    for index in range(5):
        train_both(index)
    assert_attached()

    detached = sdd.detach()
    assert detached is dmp
    assert not any(isinstance(t.forward, PipelinedForward) for t in towers)
    assert len(dmp._forward_hooks) == 0 and len(dmp._forward_pre_hooks) == 0
    assert "forward" not in dmp.__dict__  # the model's own forward, unwrapped
    # The detached model trains and predicts as the copy does (batches 5 and 6,
    # which the pipeline also holds in flight and trains again below, as the copy does).
    loss_detached, out_detached = detached(batches[5].to(DEVICE))
    loss_ref, out_ref = ref_dmp(batches[5].to(DEVICE))
    assert torch.equal(out_detached, out_ref)
    loss_detached.backward()
    loss_ref.backward()
    opt.step()
    ref_opt.step()
    with torch.no_grad():
        assert torch.equal(detached(batches[6].to(DEVICE))[1], ref_dmp(batches[6].to(DEVICE))[1])

    for index in range(5, 12):
        train_both(index)
    assert_attached()
    assert pipeline.progress(it) is None
    assert_runs_equal(
        Run([], weights(ref_dmp)), Run([], weights(dmp)), ("non_pipelined", "staged, detached")
    )
