"""TrainPipelineFusedSparseDist and EvalPipelineFusedSparseDist against torchrec and plain loops.

The Fused pipelines change only where and when the embedding lookup is issued,
not what is computed, so on CPU each must match, bit for bit:

* the plain loop (training: zero_grad, forward, backward, step per batch;
  eval: ``model.eval()`` and the forward under ``torch.no_grad()``), and
* torchrec's class of the same name, run under the test-only shim
  (ours never runs under it); where the installed torchrec's class lacks an
  option (torchrec 1.7.0's EvalPipelineFusedSparseDist has no
  ``enable_embedding_lookup_prefetch``), the plain or eval loop alone.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List

import pytest
import torch
import torchrec.distributed.train_pipeline.train_pipelines as upstream

from trec_pipelines.pipelines.eval_fused_sparse_dist import EvalPipelineFusedSparseDist
from trec_pipelines.pipelines.fused_sparse_dist import TrainPipelineFusedSparseDist
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
from trec_pipelines.testing.references import plain_loop_of
from trec_pipelines.testing.torchrec_cpu import shim_active, torchrec_on_cpu
from trec_pipelines.testing.torchrec_reference import takes

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 7
# Tables updated inside the backward (fused TBE): the Fused pipelines' premise.
FUSED_SHARDINGS = ("table_wise", "column_wise")


def run_ours(pipeline: Any, batches: Iterable[Any], model: torch.nn.Module) -> Run:
    assert not shim_active()
    return run_pipeline(pipeline, batches, model=model)


def run_theirs(
    cls: Any, batches: List[Any], sharding_type: str, eval_mode: bool = False, **kwargs: Any
) -> Run:
    dmp, optimizer = make_sharded(DLRM, sharding_type, seed=SEED)
    if eval_mode:
        dmp.eval()
    with torchrec_on_cpu():
        return run_pipeline(cls(dmp, optimizer, DEVICE, **kwargs), batches)


def eval_loop(model: torch.nn.Module, batches: Iterable[Any]) -> Run:
    """The non-pipelined eval reference."""
    model.eval()
    outputs = []
    with torch.no_grad():
        for batch in batches:
            _, pred = model(batch)
            outputs.append(pred.detach().clone())
    return Run(outputs, weights(model))


def assert_weights_equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key} changed"


# ----------------------------------------------------------------- training


@pytest.mark.parametrize("sharding_type", FUSED_SHARDINGS)
def test_fused_against_torchrec_and_plain_loop(sharding_type: str) -> None:
    batches = make_batches(seed=DATA_SEED)
    ref = plain_loop_of(DLRM, sharding_type, batches, seed=SEED)
    theirs = run_theirs(upstream.TrainPipelineFusedSparseDist, batches, sharding_type)
    dmp, optimizer = make_sharded(DLRM, sharding_type, seed=SEED)
    pipeline = TrainPipelineFusedSparseDist(dmp, optimizer, DEVICE)
    ours = run_ours(pipeline, batches, dmp)
    assert len(ref) == len(batches)
    assert_runs_equal(ref, theirs, ("plain_loop", "torchrec"))
    assert_runs_equal(ref, ours, ("plain_loop", "trec_pipelines"))
    assert len(pipeline.rewrite_result.pipelined) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"emb_lookup_stream": "new"},
        {"emb_lookup_stream": "current"},
        {"embedding_lookup_after_data_dist": True},
        {"enqueue_batch_after_forward": True},
    ],
    ids=["new", "current", "after_data_dist", "enqueue_after_forward"],
)
def test_fused_options_against_torchrec_and_plain_loop(kwargs: Dict[str, Any]) -> None:
    batches = make_batches(seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    theirs = run_theirs(upstream.TrainPipelineFusedSparseDist, batches, "table_wise", **kwargs)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    ours = run_ours(TrainPipelineFusedSparseDist(dmp, optimizer, DEVICE, **kwargs), batches, dmp)
    assert_runs_equal(ref, theirs, ("plain_loop", "torchrec"))
    assert_runs_equal(ref, ours, ("plain_loop", "trec_pipelines"))


def test_fused_lookup_streams_agree_column_wise() -> None:
    batches = make_batches(seed=DATA_SEED)
    runs = {}
    for choice in ("data_dist", "new", "current"):
        dmp, optimizer = make_sharded(DLRM, "column_wise", seed=SEED)
        pipeline = TrainPipelineFusedSparseDist(dmp, optimizer, DEVICE, emb_lookup_stream=choice)
        runs[choice] = run_ours(pipeline, batches, dmp)
    assert len(runs["data_dist"]) == len(batches)
    assert_runs_equal(runs["data_dist"], runs["new"], ("data_dist", "new"))
    assert_runs_equal(runs["data_dist"], runs["current"], ("data_dist", "current"))


# --------------------------------------------------------------------- eval


@pytest.mark.parametrize("prefetch", [False, True], ids=["in_order", "prefetch"])
@pytest.mark.parametrize("sharding_type", FUSED_SHARDINGS)
def test_eval_fused_against_torchrec_and_eval_loop(sharding_type: str, prefetch: bool) -> None:
    batches = make_batches(seed=DATA_SEED)
    ref_model, _ = make_sharded(DLRM, sharding_type, seed=SEED)
    initial = weights(ref_model)
    ref = eval_loop(ref_model, batches)
    theirs_cls = upstream.EvalPipelineFusedSparseDist
    # torchrec 1.7.0's class has no such option and always looks up in order.
    has_option = takes(theirs_cls, "enable_embedding_lookup_prefetch")
    option = {"enable_embedding_lookup_prefetch": prefetch} if has_option else {}
    theirs = None
    if has_option or not prefetch:
        theirs = run_theirs(theirs_cls, batches, sharding_type, eval_mode=True, **option)
    dmp, optimizer = make_sharded(DLRM, sharding_type, seed=SEED)
    dmp.eval()
    pipeline = EvalPipelineFusedSparseDist(
        dmp, optimizer, DEVICE, enable_embedding_lookup_prefetch=prefetch
    )
    ours = run_ours(pipeline, batches, dmp)
    assert len(ref) == len(batches)
    if theirs is not None:
        assert_runs_equal(ref, theirs, ("eval_loop", "torchrec"))
    assert_runs_equal(ref, ours, ("eval_loop", "trec_pipelines"))
    assert_weights_equal(initial, ours.weights, "eval changed the weights")


def test_eval_fused_options_and_second_epoch() -> None:
    """Lookup on a new stream after the input_dist start; a second pass needs no reset."""
    batches = make_batches(n=5, seed=DATA_SEED)
    ref_model, _ = make_sharded(DLRM, "table_wise", seed=SEED)
    ref = eval_loop(ref_model, batches)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    dmp.eval()
    pipeline = EvalPipelineFusedSparseDist(
        dmp, optimizer, DEVICE, emb_lookup_stream="new", embedding_lookup_after_data_dist=True
    )
    first = run_ours(pipeline, batches, dmp)
    second = run_ours(pipeline, batches, dmp)
    assert len(ref) == len(batches)
    assert_runs_equal(ref, first, ("eval_loop", "epoch 1"))
    assert_runs_equal(ref, second, ("eval_loop", "epoch 2"))
