"""TrainPipelineSparseDistLite and EvalPipelineSparseDist against torchrec and a plain loop.

Three runs per case on the same seed and batches: torchrec's same-named class,
ours, and the non-pipelined loop.  Every step's output and the final weights
must be ``torch.equal`` across all three.  For Eval the plain loop is
``model.eval()`` and one ``torch.no_grad()`` forward per batch, and the final
weights must also equal the weights before the run; ours runs both ways it can
load: inline (the default on CPU) and on its loader thread (``loader_thread=True``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import pytest
import torch
from torch import nn
from torchrec.distributed.train_pipeline import EvalPipelineSparseDist as UpstreamEval
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipelineSparseDistLite as UpstreamLite,
)

import trec_pipelines
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    SHARDING_TYPES,
    NestedDLRM,
    Run,
    assert_runs_equal,
    make_batches,
    make_sharded,
    run_pipeline,
    weights,
)
from trec_pipelines.testing.references import plain_loop_of

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 7


def _batches(factory: Callable[..., nn.Module]) -> list:
    return make_batches(seed=DATA_SEED, nested=factory is NestedDLRM)


# ------------------------------------------------------------------ Lite


def lite_three_ways(
    factory: Callable[..., nn.Module], sharding_type: str, **ours_kwargs: Any
) -> Any:
    batches = _batches(factory)
    ref = plain_loop_of(factory, sharding_type, batches, seed=SEED)
    theirs = run_pipeline(
        UpstreamLite(*make_sharded(factory, sharding_type, seed=SEED), DEVICE), batches
    )
    dmp, optimizer = make_sharded(factory, sharding_type, seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDistLite(dmp, optimizer, DEVICE, **ours_kwargs)
    ours = run_pipeline(pipeline, batches, model=dmp)
    assert len(ref) == len(batches)
    assert_runs_equal(ref, theirs, ("plain_loop", "torchrec"))
    assert_runs_equal(ref, ours, ("plain_loop", "trec_pipelines"))
    return pipeline


@pytest.mark.parametrize("sharding_type", SHARDING_TYPES)
def test_lite(sharding_type: str) -> None:
    pipeline = lite_three_ways(DLRM, sharding_type)
    result = pipeline.rewrite_result
    assert len(result.pipelined) == 1 and result.not_pipelined == ()


@pytest.mark.parametrize("strategy", ["fx", "direct"])
def test_lite_kjt_inside_a_dict(strategy: str) -> None:
    pipeline = lite_three_ways(NestedDLRM, "column_wise", rewrite_strategy=strategy)
    (pipelined,) = pipeline.rewrite_result.pipelined
    assert str(pipelined.call_args) == "(batch.features['sparse'])"


# ------------------------------------------------------------------ Eval


class PredictionsOnlyDLRM(DLRM):
    """DLRM that returns only its predictions, as many eval models do."""

    def forward(self, batch: Any) -> torch.Tensor:  # type: ignore[override]
        return super().forward(batch)[1]


def plain_eval(model: nn.Module, batches: Iterable[Any]) -> Run:
    """The Eval oracle: eval mode, one no_grad forward per batch."""
    model.eval()
    outputs = []
    with torch.no_grad():
        for batch in batches:
            out = model(batch)
            outputs.append((out[1] if isinstance(out, tuple) else out).detach().clone())
    return Run(outputs, weights(model))


def eval_run(
    pipeline_cls: Any,
    factory: Callable[..., nn.Module],
    sharding_type: str,
    batches: list,
    **kwargs: Any,
) -> Run:
    dmp, optimizer = make_sharded(factory, sharding_type, seed=SEED)
    dmp.eval()
    before = weights(dmp)
    run = run_pipeline(pipeline_cls(dmp, optimizer, DEVICE, **kwargs), batches, model=dmp)
    assert_runs_equal(Run([], before), Run([], run.weights), ("before", "after"))
    return run


@pytest.mark.parametrize("sharding_type", SHARDING_TYPES)
def test_eval(sharding_type: str) -> None:
    batches = _batches(DLRM)
    ref = plain_eval(make_sharded(DLRM, sharding_type, seed=SEED)[0], batches)
    theirs = eval_run(UpstreamEval, DLRM, sharding_type, batches)
    ours = eval_run(trec_pipelines.EvalPipelineSparseDist, DLRM, sharding_type, batches)
    threaded = eval_run(
        trec_pipelines.EvalPipelineSparseDist, DLRM, sharding_type, batches, loader_thread=True
    )
    assert len(ref) == len(batches)
    assert_runs_equal(ref, theirs, ("plain_eval", "torchrec"))
    assert_runs_equal(ref, ours, ("plain_eval", "trec_pipelines"))
    assert_runs_equal(ref, threaded, ("plain_eval", "trec_pipelines, loader thread"))
    # the weights really are the untrained ones
    assert_runs_equal(ref, Run(list(ref), weights(make_sharded(DLRM, sharding_type, seed=SEED)[0])))


@pytest.mark.parametrize("sharding_type", ["table_wise", "column_wise"])
def test_eval_kjt_inside_a_dict(sharding_type: str) -> None:
    batches = _batches(NestedDLRM)
    ref = plain_eval(make_sharded(NestedDLRM, sharding_type, seed=SEED)[0], batches)
    theirs = eval_run(UpstreamEval, NestedDLRM, sharding_type, batches)
    ours = eval_run(
        trec_pipelines.EvalPipelineSparseDist,
        NestedDLRM,
        sharding_type,
        batches,
        rewrite_strategy="fx",
    )
    assert_runs_equal(ref, theirs, ("plain_eval", "torchrec"))
    assert_runs_equal(ref, ours, ("plain_eval", "trec_pipelines"))


@pytest.mark.parametrize("sharding_type", ["table_wise", "column_wise"])
def test_eval_predictions_only_model(sharding_type: str) -> None:
    """torchrec unpacks every output as (loss, pred), so only the plain loop is the oracle."""
    batches = _batches(DLRM)
    ref = plain_eval(make_sharded(PredictionsOnlyDLRM, sharding_type, seed=SEED)[0], batches)
    ours = eval_run(
        trec_pipelines.EvalPipelineSparseDist, PredictionsOnlyDLRM, sharding_type, batches
    )
    assert_runs_equal(ref, ours, ("plain_eval", "trec_pipelines"))
    # ... and it is the same model: same predictions as DLRM's (loss, pred)
    assert_runs_equal(plain_eval(make_sharded(DLRM, sharding_type, seed=SEED)[0], batches), ours)


@pytest.mark.parametrize("loader_thread", [None, True], ids=["inline", "thread"])
@pytest.mark.parametrize("n", [0, 1, 2])
def test_eval_short_data_then_a_second_epoch(n: int, loader_thread: Any) -> None:
    batches = make_batches(n, seed=DATA_SEED)
    ref = plain_eval(make_sharded(DLRM, "table_wise", seed=SEED)[0], batches + batches)
    dmp, _ = make_sharded(DLRM, "table_wise", seed=SEED)
    dmp.eval()
    pipeline = trec_pipelines.EvalPipelineSparseDist(dmp, None, DEVICE, loader_thread=loader_thread)
    first = run_pipeline(pipeline, batches, model=dmp)
    second = run_pipeline(pipeline, batches, model=dmp)  # no reset() needed
    assert_runs_equal(ref, Run(list(first) + list(second), second.weights))
