"""Mixed precision without subclassing, on 2 gloo ranks: ``autocast_dtype`` and ``grad_scaler``.

Every train variant with ``autocast_dtype=torch.bfloat16`` and a
``torch.amp.GradScaler`` trains bit for bit as the plain loop doing the same
(forward under autocast, scaled backward, ``scaler.step`` then ``update``),
on data-parallel tables (the dense kernel, trained by the optimizer the
scaler steps); a step whose gradients overflow on one rank is skipped on
every rank alike.  A scaler with fused (in-backward) table optimizers is
refused: they would update from the scaled gradient, before any overflow is
found (``trec_pipelines/core/model_step.py``, ``[Note: mixed precision]``);
what the refusal suggests instead, bfloat16 autocast without a scaler, trains
table-wise fused tables as the plain loop, on every variant.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

import trec_pipelines
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    Run,
    assert_runs_equal,
    make_batches,
    make_sharded,
    run_pipeline,
    weights,
)

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 11
DTYPE = torch.bfloat16


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler(DEVICE.type, init_scale=2.0**10, growth_interval=2)


def plain_mixed_loop(model: Any, optimizer: Any, batches: List[Any]) -> Run:
    """The plain loop with autocast and a scaler (the recipe ``grad_scaler`` follows)."""
    scaler, outputs = _scaler(), []
    model.train()
    for batch in batches:
        optimizer.zero_grad()
        with torch.autocast(device_type=DEVICE.type, dtype=DTYPE):
            loss, out = model(batch)
        scaler.scale(torch.sum(loss, dim=0)).backward()
        scaler.step(optimizer)
        scaler.update()
        outputs.append(out.detach().clone())
    return Run(outputs, weights(model))


def _pt2(dmp: Any, opt: Any, **kw: Any) -> Any:
    config = trec_pipelines.TorchCompileConfig(compile_on_iter=1000)  # eager
    return trec_pipelines.TrainPipelinePT2(dmp, opt, DEVICE, compile_configs=config, **kw)


def _named(name: str, **extra: Any) -> Callable[..., Any]:
    return lambda dmp, opt, **kw: getattr(trec_pipelines, name)(dmp, opt, DEVICE, **extra, **kw)


VARIANTS: Dict[str, Callable[..., Any]] = {
    "TrainPipelineBase": _named("TrainPipelineBase"),
    "TrainPipelinePT2": _pt2,
    "TrainPipelineSparseDist": _named("TrainPipelineSparseDist"),
    "TrainPipelineSparseDistLite": _named("TrainPipelineSparseDistLite"),
    "TrainPipelineFusedSparseDist": _named("TrainPipelineFusedSparseDist"),
    "TrainPipelineSemiSync": _named("TrainPipelineSemiSync", start_batch=100),
    "PrefetchTrainPipelineSparseDist": _named("PrefetchTrainPipelineSparseDist"),
    "TrainPipelinePEC": _named("TrainPipelinePEC"),
    "TrainPipelineSparseDistT": _named("TrainPipelineSparseDistT"),
    "TrainEvalHybridPipelineBase": _named("TrainEvalHybridPipelineBase"),
    "TrainPipelineSparseDistEmbStash": _named(
        "TrainPipelineSparseDistEmbStash", site_fqn="over_arch"
    ),
}


def _dense_kernel_tables() -> Any:
    """Data-parallel tables (the dense kernel): the optimizer the scaler steps holds them.

    (torchrec's planner offers the dense kernel to data_parallel tables only.)
    """
    return make_sharded(DLRM, "data_parallel", seed=SEED)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_autocast_and_grad_scaler_train_as_the_plain_mixed_loop(name: str) -> None:
    batches = make_batches(6, seed=DATA_SEED)
    ref = plain_mixed_loop(*_dense_kernel_tables(), batches)
    dmp, optimizer = _dense_kernel_tables()
    scaler = _scaler()
    pipeline = VARIANTS[name](dmp, optimizer, autocast_dtype=DTYPE, grad_scaler=scaler)
    ours = run_pipeline(pipeline, batches, model=dmp)
    assert_runs_equal(ref, ours, ("plain loop with autocast and a scaler", name))
    assert scaler.get_scale() == 2.0**10 * 2 ** (len(batches) // 2)  # grew every 2 steps


class _Overflow(torch.nn.Module):
    """Wraps the over-arch: at forward ``at`` on rank 0 its output is multiplied by
    1e36, so that step's scaled gradients overflow to inf."""

    def __init__(self, inner: torch.nn.Module, at: int) -> None:
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if self.training:
            self.calls += 1
            if self.calls - 1 == self.at and dist.get_rank() == 0:
                out = out * 1e36
        return out


@pytest.mark.parametrize("name", ["TrainPipelineSparseDist", "TrainPipelineBase"])
def test_an_overflow_on_one_rank_skips_that_step_on_every_rank(name: str) -> None:
    """Data-parallel tables, so every parameter is stepped through the scaler (a fused
    table would take the overflowing gradient in the backward, as in the plain loop)."""
    batches = make_batches(6, seed=DATA_SEED)
    ref_dmp, ref_optimizer = make_sharded(DLRM, "data_parallel", seed=SEED)
    ref_dmp.module.over_arch = _Overflow(ref_dmp.module.over_arch, 3)
    ref = plain_mixed_loop(ref_dmp, ref_optimizer, batches)
    dmp, optimizer = make_sharded(DLRM, "data_parallel", seed=SEED)
    dmp.module.over_arch = _Overflow(dmp.module.over_arch, 3)
    scaler = _scaler()
    pipeline = VARIANTS[name](dmp, optimizer, autocast_dtype=DTYPE, grad_scaler=scaler)
    ours = run_pipeline(pipeline, batches, model=dmp)
    assert_runs_equal(ref, ours, ("plain loop, overflow at step 3", name))
    # The scale halved once (the skipped step) where it would have doubled: on every rank.
    scales: List[Optional[float]] = [None] * dist.get_world_size()
    dist.all_gather_object(scales, scaler.get_scale())
    assert len(set(scales)) == 1, scales
    assert scales[0] != 2.0**10 * 2**3, scales


def test_the_options_are_checked() -> None:
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    with pytest.raises(ValueError, match="autocast_dtype must be torch.bfloat16"):
        trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE, autocast_dtype=torch.int8)
    with pytest.raises(
        TypeError, match="grad_scaler must be a torch.amp.grad_scaler.GradScaler or None"
    ):
        trec_pipelines.TrainPipelineBase(dmp, optimizer, DEVICE, grad_scaler=object())
    # A disabled scaler scales nothing: accepted with the fused tables.
    disabled = torch.amp.GradScaler(DEVICE.type, enabled=False)
    trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE, grad_scaler=disabled)
    with pytest.raises(TypeError):  # the eval variants take no precision options
        trec_pipelines.EvalPipelineSparseDist(dmp, None, DEVICE, grad_scaler=_scaler())


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_scaler_with_fused_table_optimizers_is_refused(name: str) -> None:
    """Fused tables take the scaled gradient inside the backward, before an inf or
    nan can be found: every variant refuses at construction, saying what to do."""
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    with pytest.raises(ValueError, match=r"grad_scaler cannot be used with in-backward"):
        VARIANTS[name](dmp, optimizer, autocast_dtype=DTYPE, grad_scaler=_scaler())


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_bf16_without_a_scaler_trains_fused_tables_as_the_plain_loop(name: str) -> None:
    """What the refusal suggests: bfloat16 autocast and no scaler, table-wise fused
    tables, bit for bit as the plain loop doing the same."""
    batches = make_batches(6, seed=DATA_SEED)
    ref_dmp, ref_optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    ref_outputs = []
    for batch in batches:
        ref_optimizer.zero_grad()
        with torch.autocast(device_type=DEVICE.type, dtype=DTYPE):
            loss, out = ref_dmp(batch)
        torch.sum(loss, dim=0).backward()
        ref_optimizer.step()
        ref_outputs.append(out.detach().clone())
    ref = Run(ref_outputs, weights(ref_dmp))
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = VARIANTS[name](dmp, optimizer, autocast_dtype=DTYPE)
    ours = run_pipeline(pipeline, batches, model=dmp)
    assert_runs_equal(ref, ours, ("plain loop with autocast", name))
