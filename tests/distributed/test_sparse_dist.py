"""TrainPipelineBase and TrainPipelineSparseDist against torchrec and a plain loop.

Three runs per case on the same seed and batches: torchrec's same-named class,
ours, and the non-pipelined loop.  Every step's output and the final weights
must be ``torch.equal`` across all three.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Type

import pytest
import torch
import torchrec.distributed.train_pipeline as upstream

import trec_pipelines
from tests.user_subclass import TaggedSparseDist
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
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
from trec_pipelines.testing.references import plain_loop_of

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 7


def three_ways(
    name: str, factory: Callable[..., Any], sharding_type: str, **ours_kwargs: Any
) -> Any:
    batches = make_batches(seed=DATA_SEED, nested=factory is NestedDLRM)
    ref = plain_loop_of(factory, sharding_type, batches, seed=SEED)
    theirs_cls: Type[Any] = getattr(upstream, name)
    theirs = run_pipeline(
        theirs_cls(*make_sharded(factory, sharding_type, seed=SEED), DEVICE), batches
    )
    dmp, optimizer = make_sharded(factory, sharding_type, seed=SEED)
    pipeline = getattr(trec_pipelines, name)(dmp, optimizer, DEVICE, **ours_kwargs)
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
    pipeline = three_ways("TrainPipelineSparseDist", DLRM, sharding_type, rewrite_strategy=strategy)
    result = pipeline.rewrite_result
    assert result.strategy == strategy
    assert len(result.pipelined) == 1 and result.not_pipelined == ()


@pytest.mark.parametrize("sharding_type", ["table_wise", "column_wise"])
def test_sparse_dist_kjt_inside_a_dict(sharding_type: str) -> None:
    pipeline = three_ways(
        "TrainPipelineSparseDist", NestedDLRM, sharding_type, rewrite_strategy="fx"
    )
    (pipelined,) = pipeline.rewrite_result.pipelined
    assert str(pipelined.call_args) == "(batch.features['sparse'])"


def test_sparse_dist_enqueue_after_forward() -> None:
    three_ways("TrainPipelineSparseDist", DLRM, "table_wise", enqueue_batch_after_forward=True)


@pytest.mark.parametrize(
    "options", [{}, {"rewrite_strategy": "direct", "sync_exhaustion": True}], ids=["none", "some"]
)
def test_a_users_subclass_with_options_for_type_checkers_only_trains_as_ours(
    options: Dict[str, Any],
) -> None:
    """tests/user_subclass.py (its options' types imported under TYPE_CHECKING only)
    trains as TrainPipelineSparseDist itself, bit for bit."""
    batches = make_batches(seed=DATA_SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE, **options)
    ours = run_pipeline(pipeline, batches, model=dmp)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    subclass = TaggedSparseDist(dmp, optimizer, DEVICE, tag="mine", **options)
    users = run_pipeline(subclass, batches, model=dmp)
    assert len(ours) == len(batches)
    assert subclass.rewrite_result.strategy == pipeline.rewrite_result.strategy
    assert_runs_equal(ours, users, ("TrainPipelineSparseDist", "TaggedSparseDist"))


def test_sparse_dist_detach_attach_mid_epoch() -> None:
    batches = make_batches(seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    it = iter(batches)
    outputs = [pipeline.progress(it) for _ in range(3)]
    pipeline.detach()
    pipeline.attach()
    rest = run_pipeline(pipeline, it, model=dmp)
    ours = Run([o.clone() for o in outputs] + list(rest), rest.weights)
    assert_runs_equal(ref, ours, ("plain_loop", "detach/attach"))


@pytest.mark.parametrize(
    "name", ["TrainPipelineSparseDist", "TrainPipelineFusedSparseDist", "EvalPipelineSparseDist"]
)
def test_free_features_storage_early_never_frees_the_loaders_own_batch(name: str) -> None:
    # On CPU the device "copy" of a batch is the loader's own tensors: freeing
    # its features after input_dist (torchrec does) destroys the dataset, and
    # the second epoch over the same batches fails.  Ours frees only storage
    # the copy made, so both epochs train as the plain loop does.
    batches = make_batches(seed=DATA_SEED)
    values_before = [b.sparse.values().clone() for b in batches]
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    ref_dmp, ref_optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    if name.startswith("Eval"):
        dmp.eval()
        ref_dmp.eval()
        with torch.no_grad():
            ref = [ref_dmp(b)[1] for b in batches + batches]
    else:
        ref = plain_loop(ref_dmp, ref_optimizer, batches + batches)
    pipeline = getattr(trec_pipelines, name)(
        dmp, optimizer, DEVICE, free_features_storage_early=True
    )
    ours = run_pipeline(pipeline, batches, model=dmp) + run_pipeline(pipeline, batches, model=dmp)
    assert len(ours) == len(ref) == 2 * len(batches)
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert torch.equal(a, b), f"step {step}"
    for batch, before in zip(batches, values_before, strict=True):
        assert torch.equal(batch.sparse.values(), before)
