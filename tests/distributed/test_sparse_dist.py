"""TrainPipelineBase and TrainPipelineSparseDist against torchrec and a plain loop.

Three runs per case on the same seed and batches: torchrec's same-named class,
ours, and the non-pipelined loop.  Every step's output and the final weights
must be ``torch.equal`` across all three.
"""

from __future__ import annotations

from typing import Any, Callable, Type

import pytest
import torch
import torchrec.distributed.train_pipeline as upstream

import trec_pipelines
from tests.distributed.dlrm import (
    DLRM,
    SHARDING_TYPES,
    NestedDLRM,
    Run,
    assert_runs_equal,
    make_batches,
    make_sharded,
    plain_loop,
    run_pipeline,
)

CPU = torch.device("cpu")
SEED, DATA_SEED = 1234, 7


def three_ways(
    name: str, factory: Callable[..., Any], sharding_type: str, **ours_kwargs: Any
) -> Any:
    batches = make_batches(seed=DATA_SEED, nested=factory is NestedDLRM)
    ref = plain_loop(*make_sharded(factory, sharding_type, seed=SEED), batches)
    theirs_cls: Type[Any] = getattr(upstream, name)
    theirs = run_pipeline(theirs_cls(*make_sharded(factory, sharding_type, seed=SEED), CPU), batches)
    dmp, optimizer = make_sharded(factory, sharding_type, seed=SEED)
    pipeline = getattr(trec_pipelines, name)(dmp, optimizer, CPU, **ours_kwargs)
    ours = run_pipeline(pipeline, batches, model=dmp)
    assert len(ref) == len(batches)
    assert_runs_equal(ref, theirs, ("plain_loop", "torchrec"))
    assert_runs_equal(ref, ours, ("plain_loop", "trec_pipelines"))
    return pipeline


@pytest.mark.parametrize("sharding_type", SHARDING_TYPES)
def test_base(sharding_type: str) -> None:
    three_ways("TrainPipelineBase", DLRM, sharding_type)


@pytest.mark.parametrize("strategy", ["fx", "direct"])
@pytest.mark.parametrize("sharding_type", SHARDING_TYPES)
def test_sparse_dist(sharding_type: str, strategy: str) -> None:
    pipeline = three_ways(
        "TrainPipelineSparseDist", DLRM, sharding_type, rewrite_strategy=strategy
    )
    result = pipeline.rewrite_result
    assert result.strategy == strategy
    assert len(result.pipelined) == 1 and result.not_pipelined == ()


@pytest.mark.parametrize("sharding_type", ["table_wise", "column_wise"])
def test_sparse_dist_kjt_inside_a_dict(sharding_type: str) -> None:
    pipeline = three_ways("TrainPipelineSparseDist", NestedDLRM, sharding_type, rewrite_strategy="fx")
    (pipelined,) = pipeline.rewrite_result.pipelined
    assert str(pipelined.call_args) == "(batch.features['sparse'])"


def test_sparse_dist_enqueue_after_forward() -> None:
    three_ways("TrainPipelineSparseDist", DLRM, "table_wise", enqueue_batch_after_forward=True)


def test_sparse_dist_detach_attach_mid_epoch() -> None:
    batches = make_batches(seed=DATA_SEED)
    ref = plain_loop(*make_sharded(DLRM, "table_wise", seed=SEED), batches)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, CPU)
    it = iter(batches)
    outputs = [pipeline.progress(it) for _ in range(3)]
    pipeline.detach()
    pipeline.attach()
    rest = run_pipeline(pipeline, it, model=dmp)
    ours = Run([o.clone() for o in outputs] + list(rest), rest.weights)
    assert_runs_equal(ref, ours, ("plain_loop", "detach/attach"))
