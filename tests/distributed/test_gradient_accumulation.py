"""GradientAccumulationWrapper around our pipelines, on 2 gloo ranks.

Three runs per case on the same seed and batches, compared step by step and by
final weights (``torch.equal``):

* the plain accumulation loop below: forward and backward per batch, under
  every DDP module's ``no_sync()`` except on the first call, the warm-up calls
  and the last call of each window; optimizer step and zero_grad at the end of
  each window and once more for a final partial window, whose gradients are
  averaged over the ranks first if they were accumulated under ``no_sync()``;
* our wrapper around our pipeline;
* torchrec's wrapper around torchrec's pipeline of the same name (Fused under
  the test-only CPU shim, torchrec's side only).  It steps a final partial window on each rank's local gradients, so
  the data-parallel weights of the ranks part; with data ending on a window
  boundary all three must agree, with a partial window torchrec's per-step
  outputs must and its final weights are shown to disagree across ranks.

num_steps=3 with num_warmup_steps=2 covers a window that is all-reduced inside
(warm-up) and windows that are not; 9 batches end on a window, 8 inside one.
"""

from __future__ import annotations

import contextlib
from typing import Any, List, Sequence

import pytest
import torch
import torch.distributed as dist
import torchrec.distributed.train_pipeline as upstream
import torchrec.distributed.train_pipeline.train_pipelines as upstream_pipelines
from torch.nn.parallel import DistributedDataParallel

import trec_pipelines
from trec_pipelines import GradientAccumulationConfig, GradientAccumulationWrapper
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
from trec_pipelines.testing.references import kept, plain_loop_of
from trec_pipelines.testing.torchrec_cpu import shim_active, torchrec_on_cpu

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 7
NUM_STEPS, NUM_WARMUP = 3, 2
PIPELINES = (
    "TrainPipelineBase",
    "TrainPipelineSparseDist",
    "TrainPipelineSparseDistLite",
    "TrainPipelineFusedSparseDist",
)
# torchrec's classes that only run on CPU under the test shim.
NEEDS_SHIM = ("TrainPipelineFusedSparseDist",)


def accumulation_loop(
    model: torch.nn.Module,
    optimizer: Any,
    batches: Sequence[Any],
    num_steps: int,
    num_warmup: int,
    last_batch_flagged: bool = False,
) -> Run:
    """The non-pipelined reference for the accumulation schedule in the module docstring.

    ``last_batch_flagged``: the caller marks the last batch (``is_last_batch``),
    whose backward then synchronises like a window's last one (DDP's bucketed
    all-reduce; with more than two ranks its sum order differs from averaging
    afterwards, so the reference must take the same path).
    """
    ddp = [m for m in model.modules() if isinstance(m, DistributedDataParallel)]
    assert ddp, "the model has no DDP module: no_sync would not be exercised"
    model.train()
    optimizer.zero_grad()
    outputs: List[torch.Tensor] = []
    for k, batch in enumerate(batches):
        ends_window = (k + 1) % num_steps == 0 or (last_batch_flagged and k == len(batches) - 1)
        all_reduce = k == 0 or k < num_warmup or ends_window
        with contextlib.ExitStack() as stack:
            if not all_reduce:
                for module in ddp:
                    stack.enter_context(module.no_sync())
            loss, out = model(batch)
            torch.sum(loss, dim=0).backward()
        if ends_window:
            optimizer.step()
            optimizer.zero_grad()
        outputs.append(out.detach().clone())
    last = len(batches) - 1
    if len(batches) % num_steps and not last_batch_flagged:
        if not (last == 0 or last < num_warmup):  # the window's grads are still local
            average_over_ranks(ddp)
        optimizer.step()
        optimizer.zero_grad()
    return Run(outputs, weights(model))


def average_over_ranks(ddp: List[DistributedDataParallel]) -> None:
    """What a synchronising backward does to the gradients DDP holds: divide, sum."""
    done = set()
    for module in ddp:
        for name, param in module.module.named_parameters():
            if name in module.parameters_to_ignore or id(param) in done or param.grad is None:
                continue
            done.add(id(param))
            param.grad.div_(dist.get_world_size(module.process_group))
            dist.all_reduce(param.grad, group=module.process_group)


def dense_weights_agree_across_ranks(model: torch.nn.Module) -> bool:
    """Whether every DDP-replicated parameter is bit-identical on all ranks."""
    agree = True
    for module in model.modules():
        if not isinstance(module, DistributedDataParallel):
            continue
        for name, param in module.module.named_parameters():
            if name in module.parameters_to_ignore:
                continue
            gathered = [
                torch.empty_like(param) for _ in range(dist.get_world_size(module.process_group))
            ]
            dist.all_gather(gathered, param.detach().contiguous(), group=module.process_group)
            agree = agree and all(torch.equal(g, gathered[0]) for g in gathered)
    return agree


def config() -> GradientAccumulationConfig:
    return GradientAccumulationConfig(num_steps=NUM_STEPS, num_warmup_steps=NUM_WARMUP)


@pytest.mark.parametrize("num_batches", [9, 8], ids=["whole_windows", "partial_window"])
@pytest.mark.parametrize("sharding_type", ["table_wise", "data_parallel"])
@pytest.mark.parametrize("name", PIPELINES)
def test_ours_matches_the_accumulation_loop_and_torchrec(
    name: str, sharding_type: str, num_batches: int
) -> None:
    batches = make_batches(num_batches, seed=DATA_SEED)
    # The same for the four pipelines: trained once per run.
    ref = kept(
        f"{__name__}.accumulation_loop:DLRM;{SEED}",
        (sharding_type, batches, NUM_STEPS, NUM_WARMUP),
        lambda: accumulation_loop(
            *make_sharded(DLRM, sharding_type, seed=SEED), batches, NUM_STEPS, NUM_WARMUP
        ),
    )

    dmp, optimizer = make_sharded(DLRM, sharding_type, seed=SEED)
    pipeline = getattr(trec_pipelines, name)(dmp, optimizer, DEVICE)
    wrapped = GradientAccumulationWrapper(pipeline, optimizer, dmp, config())
    assert not shim_active()
    ours = run_pipeline(wrapped, batches, model=dmp)
    assert wrapped.current_step == len(batches)
    assert_runs_equal(ref, ours, ("accumulation_loop", "trec_pipelines"))
    assert dense_weights_agree_across_ranks(dmp)

    their_dmp, their_optimizer = make_sharded(DLRM, sharding_type, seed=SEED)
    their_pipeline = getattr(upstream_pipelines, name)(their_dmp, their_optimizer, DEVICE)
    their_config = upstream.GradientAccumulationConfig(
        num_steps=NUM_STEPS, num_warmup_steps=NUM_WARMUP
    )
    with torchrec_on_cpu() if name in NEEDS_SHIM else contextlib.nullcontext():
        theirs = run_pipeline(
            upstream.GradientAccumulationWrapper(
                their_pipeline, their_optimizer, their_dmp, their_config
            ),
            batches,
            model=their_dmp,
        )
    if num_batches % NUM_STEPS == 0:
        assert_runs_equal(ref, theirs, ("accumulation_loop", "torchrec"))
    else:
        # Same steps; only the last, local-gradient step differs (see the module docstring).
        assert_runs_equal(ref, Run(theirs, ref.weights), ("accumulation_loop", "torchrec"))
        assert not dense_weights_agree_across_ranks(their_dmp), (
            "torchrec's wrapper now all-reduces a final partial window: compare its "
            "final weights too, and drop this difference from gradient_accumulation.py's docstring"
        )


def test_accumulation_changes_training() -> None:
    """Guards the test above: accumulating is not the same as stepping every batch."""
    batches = make_batches(seed=DATA_SEED)
    every_batch = plain_loop_of(DLRM, "data_parallel", batches, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "data_parallel", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    ours = run_pipeline(
        GradientAccumulationWrapper(pipeline, optimizer, dmp, config()), batches, model=dmp
    )
    changed = [
        k for k in every_batch.weights if not torch.equal(every_batch.weights[k], ours.weights[k])
    ]
    assert changed, "accumulating over 3 batches left every weight as stepping each batch does"


def test_is_last_batch_steps_on_the_partial_window() -> None:
    batches = make_batches(4, seed=DATA_SEED)  # one full window, then one batch
    ref = accumulation_loop(
        *make_sharded(DLRM, "table_wise", seed=SEED),
        batches,
        NUM_STEPS,
        NUM_WARMUP,
        last_batch_flagged=True,
    )
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    wrapped = GradientAccumulationWrapper(
        trec_pipelines.TrainPipelineBase(dmp, optimizer, DEVICE), optimizer, dmp, config()
    )
    it = iter(batches)
    outputs = [
        wrapped.progress(it, is_last_batch=k == len(batches) - 1).detach().clone()
        for k in range(len(batches))
    ]
    assert_runs_equal(ref, Run(outputs, weights(dmp)), ("accumulation_loop", "trec_pipelines"))


def test_disabled_is_the_pipeline_alone() -> None:
    batches = make_batches(seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    wrapped = GradientAccumulationWrapper(pipeline, optimizer, dmp, GradientAccumulationConfig())
    assert pipeline._optimizer is optimizer
    assert_runs_equal(
        ref, run_pipeline(wrapped, batches, model=dmp), ("plain_loop", "trec_pipelines")
    )
