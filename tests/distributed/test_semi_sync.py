"""TrainPipelineSemiSync against torchrec's class and, while synchronous, a plain loop.

torchrec 1.8.0's ``TrainPipelineSemiSync`` only runs on CPU under the test-only
shim (``torchrec_on_cpu``); ours runs without it.  Same seed, same batches,
same optimizer recipe: every step's output and the final weights must be
``torch.equal``.  ``start_batch=2`` over 9 batches gives the synchronous start,
the switch, six semi-sync steps and the drain.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Tuple

import pytest
import torch
from torch import nn
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipelineSemiSync as UpstreamSemiSync,
)
from torchrec.optim.keyed import KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from trec_pipelines.pipelines.semi_sync import TrainPipelineSemiSync
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DENSE_LR,
    DLRM,
    Run,
    assert_runs_equal,
    make_batches,
    make_sharded,
    plain_loop,
    run_pipeline,
    weights,
)
from trec_pipelines.testing.torchrec_cpu import shim_active, torchrec_on_cpu

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 7
N_BATCHES = 9
START = 2


def dense_only(dmp: nn.Module) -> KeyedOptimizer:
    """Adagrad over the parameters without an in-backward optimizer.

    What SemiSync wants: the embedding tables are updated by their fused
    optimizer inside ``embedding_backward``, the pipeline steps the rest.
    """
    return KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=DENSE_LR),
    )


def build(sharding_type: str, combined: bool) -> Tuple[nn.Module, Any]:
    """The sharded DLRM and its optimizer: make_sharded's combined one, or dense only."""
    dmp, combined_optimizer = make_sharded(DLRM, sharding_type, seed=SEED)
    return dmp, combined_optimizer if combined else dense_only(dmp)


def torchrec_run(
    sharding_type: str, batches: List[Any], combined: bool = False, **kwargs: Any
) -> Run:
    dmp, optimizer = build(sharding_type, combined)
    with torchrec_on_cpu():
        return run_pipeline(UpstreamSemiSync(dmp, optimizer, DEVICE, **kwargs), batches)


def our_run(
    sharding_type: str, batches: List[Any], combined: bool = False, **kwargs: Any
) -> Tuple[TrainPipelineSemiSync, Run, List[bool]]:
    """Run ours (shim off), noting ``is_semi_sync()`` (the next batch's mode) after each step."""
    assert not shim_active()
    dmp, optimizer = build(sharding_type, combined)
    pipeline = TrainPipelineSemiSync(dmp, optimizer, DEVICE, **kwargs)
    it = iter(batches)
    outputs: List[torch.Tensor] = []
    modes: List[bool] = []
    while True:
        try:
            out = pipeline.progress(it)
        except StopIteration:
            break
        modes.append(pipeline.is_semi_sync())
        outputs.append(out.detach().clone())
        assert len(outputs) <= len(batches), "pipeline did not stop"
    assert not shim_active()
    return pipeline, Run(outputs, weights(dmp)), modes


def plain_run(sharding_type: str, batches: List[Any]) -> Run:
    return plain_loop(*build(sharding_type, combined=False), batches)


@pytest.mark.parametrize("stash_gradients", [False, True], ids=["naive", "stash"])
@pytest.mark.parametrize("sharding_type", ["table_wise", "column_wise"])
def test_semi_sync_matches_torchrec(sharding_type: str, stash_gradients: bool) -> None:
    batches = make_batches(N_BATCHES, seed=DATA_SEED)
    kwargs = dict(start_batch=START, stash_gradients=stash_gradients)
    theirs = torchrec_run(sharding_type, batches, **kwargs)
    _, ours, modes = our_run(sharding_type, batches, **kwargs)
    assert len(ours) == N_BATCHES
    assert_runs_equal(theirs, ours, ("torchrec", "trec_pipelines"))
    # After step k the next batch is k+1: semi-sync from batch START on.
    assert modes == [k + 1 >= START for k in range(N_BATCHES - 1)] + [False]

    # The comparison above is sensitive: batches 0..START train as the plain
    # loop does (batch START was looked up after batch START-1's update), and
    # batch START+1 is the first whose lookup misses an update.
    ref = plain_run(sharding_type, batches)
    for step in range(START + 1):
        assert torch.equal(ours[step], ref[step]), f"step {step} should still be synchronous"
    assert not torch.equal(ours[START + 1], ref[START + 1]), "semi-sync never took effect"


@pytest.mark.parametrize("sharding_type", ["table_wise", "column_wise"])
def test_start_batch_past_the_data_is_the_plain_loop(sharding_type: str) -> None:
    batches = make_batches(N_BATCHES, seed=DATA_SEED)
    kwargs = dict(start_batch=N_BATCHES + 100, stash_gradients=True)
    ref = plain_run(sharding_type, batches)
    theirs = torchrec_run(sharding_type, batches, **kwargs)
    _, ours, modes = our_run(sharding_type, batches, **kwargs)
    assert len(ref) == N_BATCHES
    assert_runs_equal(ref, theirs, ("plain_loop", "torchrec"))
    assert_runs_equal(ref, ours, ("plain_loop", "trec_pipelines"))
    assert not any(modes)


def test_combined_optimizer_with_fused_part_matches_torchrec() -> None:
    """make_sharded's CombinedOptimizer (fused + dense) passes the sharing check:
    the fused optimizer holds the sharded tables' own tensors, not the module's
    parameters, and its step is a no-op (the update ran in backward)."""
    batches = make_batches(N_BATCHES, seed=DATA_SEED)
    kwargs = dict(start_batch=START, stash_gradients=True, strict=True)
    theirs = torchrec_run("table_wise", batches, combined=True, **kwargs)
    _, ours, _ = our_run("table_wise", batches, combined=True, **kwargs)
    assert_runs_equal(theirs, ours, ("torchrec", "trec_pipelines"))


def test_second_epoch_stays_semi_sync_and_matches_torchrec() -> None:
    """A new iterator continues the batch count (no reset): still semi-sync,
    and the last stashed gradient of epoch 1 is applied in epoch 2."""
    first = make_batches(5, seed=DATA_SEED)
    second = make_batches(4, seed=DATA_SEED + 1)
    kwargs = dict(start_batch=START, stash_gradients=True)

    def two_epochs(pipeline: Any, model: Optional[nn.Module]) -> Run:
        a = run_pipeline(pipeline, first, model=model)
        b = run_pipeline(pipeline, second, model=model)
        return Run(list(a) + list(b), b.weights)

    dmp, optimizer = build("table_wise", combined=False)
    with torchrec_on_cpu():
        theirs = two_epochs(UpstreamSemiSync(dmp, optimizer, DEVICE, **kwargs), None)
    dmp, optimizer = build("table_wise", combined=False)
    ours = two_epochs(TrainPipelineSemiSync(dmp, optimizer, DEVICE, **kwargs), dmp)
    assert len(ours) == 9
    assert_runs_equal(theirs, ours, ("torchrec", "trec_pipelines"))


# torchrec's KJTAllToAllTensorsAwaitable.clear_inputs frees through tensor.storage().
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
def test_clear_data_dist_inputs_matches_torchrec() -> None:
    batches = make_batches(N_BATCHES, seed=DATA_SEED)
    kwargs = dict(start_batch=START, clear_data_dist_inputs=True)
    theirs = torchrec_run("column_wise", batches, **kwargs)
    _, ours, _ = our_run("column_wise", batches, **kwargs)
    assert_runs_equal(theirs, ours, ("torchrec", "trec_pipelines"))


def test_direct_binding_matches_torchrec() -> None:
    batches = make_batches(N_BATCHES, seed=DATA_SEED)
    theirs = torchrec_run("table_wise", batches, start_batch=START)
    pipeline, ours, _ = our_run("table_wise", batches, start_batch=START, rewrite_strategy="direct")
    assert pipeline.rewrite_result is not None
    assert pipeline.rewrite_result.strategy == "direct"
    assert len(pipeline.rewrite_result.pipelined) == 1
    assert_runs_equal(theirs, ours, ("torchrec", "trec_pipelines"))


SYNCHRONOUS_START = (
    "TrainPipelineSemiSync: synchronous until batch 900 (start_batch=900, torchrec's default): "
    "until then each batch is looked up after the previous batch's update, as "
    "TrainPipelineSparseDist trains; pass start_batch=0 (or another number) to overlap them sooner"
)


def test_a_synchronous_start_is_said_once_per_pipeline_and_after_reset(caplog: Any) -> None:
    """torchrec's default start_batch keeps a short run synchronous: the first progress()
    says so at INFO, once (not again in the second epoch), and again after reset()."""
    batches = make_batches(3, seed=DATA_SEED)
    dmp, optimizer = build("table_wise", combined=False)

    def said() -> List[str]:
        return [r.getMessage() for r in caplog.records if "synchronous until" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="trec_pipelines.pipelines.semi_sync"):
        pipeline = TrainPipelineSemiSync(dmp, optimizer, DEVICE)
        for _ in range(2):  # two epochs
            run_pipeline(pipeline, batches, model=dmp)
        assert said() == [SYNCHRONOUS_START]
        pipeline.reset()
        run_pipeline(pipeline, batches, model=dmp)
        assert said() == [SYNCHRONOUS_START] * 2
        # Semi-sync from the first batch: nothing to say.
        caplog.clear()
        eager = TrainPipelineSemiSync(*build("table_wise", combined=False), DEVICE, start_batch=0)
        run_pipeline(eager, batches)
        assert said() == []
