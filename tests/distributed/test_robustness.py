"""Uneven data across ranks: sync_exhaustion stops every rank at the same step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import trec_pipelines
from tests import devices
from tests.distributed.dlrm import (
    DLRM,
    assert_runs_equal,
    make_batches,
    make_sharded,
    plain_loop,
    plain_loop_with_eval_pass,
    run_pipeline,
)

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 7


@pytest.mark.parametrize(
    "name",
    [
        "TrainPipelineSparseDist",
        "TrainPipelineBase",
        "TrainPipelineSparseDistLite",
        "TrainPipelineFusedSparseDist",
        "PrefetchTrainPipelineSparseDist",
        "TrainPipelineSemiSync",
    ],
)
def test_sync_exhaustion_with_uneven_data(name: str) -> None:
    rank = dist.get_rank()
    # Rank 0 has 6 batches, rank 1 only 4: without agreement rank 0 would wait
    # in the all-to-all of its 5th batch for a rank that has stopped.
    batches = make_batches(6 if rank == 0 else 4, seed=DATA_SEED)
    ref = plain_loop(*make_sharded(DLRM, "table_wise", seed=SEED), batches[:4])
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    # SemiSync stays synchronous here (start_batch past the data): the plain loop is its oracle.
    extra = {"start_batch": 100} if name == "TrainPipelineSemiSync" else {}
    pipeline: Any = getattr(trec_pipelines, name)(
        dmp, optimizer, DEVICE, sync_exhaustion=True, **extra
    )
    ours = run_pipeline(pipeline, batches, model=dmp)
    assert_runs_equal(ref, ours, ("plain_loop[:4]", name))
    # Rank 0 pulled its 5th batch before learning rank 1 had run out.
    assert pipeline._source.unused == (1 if rank == 0 else 0)


def test_uneven_data_stops_in_step_with_the_agreement_one_pull_ahead() -> None:
    """sync_exhaustion=True agrees on each pull one pull ahead ([Note: agreeing on
    each batch]): the rank that pulled a batch past the other's end counts it unused."""
    rank = dist.get_rank()
    batches = make_batches(6 if rank == 0 else 4, seed=DATA_SEED)
    ref = plain_loop(*make_sharded(DLRM, "table_wise", seed=SEED), batches[:4])
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE, sync_exhaustion=True)
    assert_runs_equal(
        ref, run_pipeline(pipeline, batches, model=dmp), ("plain_loop[:4]", "SparseDist")
    )
    assert pipeline.unused_batches == (1 if rank == 0 else 0)


def test_sync_exhaustion_next_epoch_carries_on() -> None:
    rank = dist.get_rank()
    first = make_batches(5 if rank == 0 else 3, seed=DATA_SEED)
    second = make_batches(3, seed=DATA_SEED + 1)
    ref = plain_loop(*make_sharded(DLRM, "table_wise", seed=SEED), first[:3] + second)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE, sync_exhaustion=True)
    epoch1 = run_pipeline(pipeline, first, model=dmp)
    epoch2 = run_pipeline(pipeline, second, model=dmp)
    assert len(epoch1) == 3 and len(epoch2) == 3
    ours = type(ref)(list(epoch1) + list(epoch2), epoch2.weights)
    assert_runs_equal(ref, ours, ("plain_loop", "two epochs"))


def test_eval_pass_mid_training_with_input_dist_in_flight() -> None:
    """Batches whose input_dist is under way are parked through an eval pass."""
    train, evaluation = make_batches(6, seed=DATA_SEED), make_batches(3, seed=DATA_SEED + 5)
    ref_dmp, ref_optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    ref_first, ref_eval, ref_rest = plain_loop_with_eval_pass(
        ref_dmp, ref_optimizer, train, evaluation, 3
    )

    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    train_it = iter(train)
    first = [pipeline.progress(train_it).clone() for _ in range(3)]
    dmp.eval()
    eval_run = run_pipeline(pipeline, evaluation, model=dmp)
    dmp.train()
    rest = run_pipeline(pipeline, train_it, model=dmp)

    assert len(eval_run) == 3
    for step, (ours, ref) in enumerate(zip(eval_run, ref_eval, strict=True)):
        assert torch.equal(ours, ref), f"eval step {step} differs"
    ours = type(ref_rest)(first + list(rest), rest.weights)
    reference = type(ref_rest)(list(ref_first) + list(ref_rest), ref_rest.weights)
    assert_runs_equal(reference, ours, ("plain_loop", "with an eval pass"))
