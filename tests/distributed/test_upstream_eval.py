"""Eval pipelines on a model in eval mode, both model shapes, on 2 gloo ranks.

Adapted from upstream's eval coverage (``EvalPipelineSparseDistTest`` and the
"model in eval mode" cases): a model in eval mode may return ``(loss, pred)``
or predictions only.  Both eval pipelines must take both, and each run must
equal the plain eval loop (``model.eval()``, one ``no_grad`` forward per
batch) bit for bit, leaving the weights untouched.  torchrec's class is a
second oracle where it runs: it unpacks every output as ``(loss, pred)``, so
it cannot run the predictions-only model.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Type

import pytest
import torch
from torch import nn
from torchrec.distributed.train_pipeline.train_pipelines import (
    EvalPipelineFusedSparseDist as UpstreamEvalFused,
    EvalPipelineSparseDist as UpstreamEval,
)

from trec_pipelines import EvalPipelineFusedSparseDist, EvalPipelineSparseDist
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
from trec_pipelines.testing.references import kept
from trec_pipelines.testing.torchrec_cpu import shim_active, torchrec_on_cpu

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 7


class PredictionsOnlyDLRM(DLRM):
    """The DLRM returning only its predictions, as many eval models do."""

    def forward(self, batch: Any) -> torch.Tensor:  # type: ignore[override]
        return super().forward(batch)[1]


class EvalShapeDLRM(DLRM):
    """``(loss, pred)`` in training mode, predictions only in eval mode."""

    def forward(self, batch: Any) -> Any:  # type: ignore[override]
        loss, pred = super().forward(batch)
        return (loss, pred) if self.training else pred


MODELS = {"loss_and_pred": DLRM, "pred_only": PredictionsOnlyDLRM, "pred_in_eval": EvalShapeDLRM}
OURS: List[Type[Any]] = [EvalPipelineSparseDist, EvalPipelineFusedSparseDist]


def eval_loop(model: nn.Module, batches: Iterable[Any]) -> Run:
    model.eval()
    outputs = []
    with torch.no_grad():
        for batch in batches:
            out = model(batch)
            outputs.append((out[1] if isinstance(out, tuple) else out).detach().clone())
    return Run(outputs, weights(model))


def eval_run(
    cls: Any,
    factory: Callable[..., nn.Module],
    batches: List[Any],
    sharding_type: str,
    **kwargs: Any,
) -> Run:
    dmp, optimizer = make_sharded(factory, sharding_type, seed=SEED)
    dmp.eval()
    before = weights(dmp)
    run = run_pipeline(cls(dmp, optimizer, DEVICE, **kwargs), batches, model=dmp)
    assert_runs_equal(Run([], before), Run([], run.weights), ("weights before", "after eval"))
    return run


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("cls", OURS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("sharding_type", ["table_wise", "column_wise"])
def test_eval_mode_model_matches_eval_loop(cls: Any, model: str, sharding_type: str) -> None:
    factory = MODELS[model]
    batches = make_batches(seed=DATA_SEED)
    # The same for both pipelines: scored once per run.
    ref = kept(
        f"{__name__}.eval_loop:{model};{SEED}",
        (sharding_type, batches),
        lambda: eval_loop(make_sharded(factory, sharding_type, seed=SEED)[0], batches),
    )
    assert not shim_active()
    ours = eval_run(cls, factory, batches, sharding_type)
    assert len(ref) == len(batches)
    assert_runs_equal(ref, ours, ("eval_loop", cls.__name__))


@pytest.mark.parametrize("prefetch", [False, True], ids=["in_order", "lookup_prefetch"])
def test_eval_fused_pred_only_with_lookup_prefetch(prefetch: bool) -> None:
    batches = make_batches(seed=DATA_SEED)
    ref = eval_loop(make_sharded(PredictionsOnlyDLRM, "table_wise", seed=SEED)[0], batches)
    ours = eval_run(
        EvalPipelineFusedSparseDist,
        PredictionsOnlyDLRM,
        batches,
        "table_wise",
        enable_embedding_lookup_prefetch=prefetch,
        emb_lookup_stream="new",
    )
    assert_runs_equal(ref, ours, ("eval_loop", "EvalFused, predictions only"))


@pytest.mark.parametrize(
    "ours_cls, theirs_cls",
    [(EvalPipelineSparseDist, UpstreamEval), (EvalPipelineFusedSparseDist, UpstreamEvalFused)],
    ids=["EvalSparseDist", "EvalFused"],
)
def test_loss_and_pred_model_matches_torchrec(ours_cls: Any, theirs_cls: Any) -> None:
    """torchrec runs the (loss, pred) model in eval mode (its Fused one only
    under the test shim): it must agree with the eval loop and with ours."""
    batches = make_batches(seed=DATA_SEED)
    ref = eval_loop(make_sharded(DLRM, "table_wise", seed=SEED)[0], batches)
    with torchrec_on_cpu():
        theirs = eval_run(theirs_cls, DLRM, batches, "table_wise")
    ours = eval_run(ours_cls, DLRM, batches, "table_wise")
    assert_runs_equal(ref, theirs, ("eval_loop", "torchrec"))
    assert_runs_equal(ref, ours, ("eval_loop", "trec_pipelines"))


def test_torchrec_eval_fused_cannot_run_a_predictions_only_model() -> None:
    """Why the plain loop is the only oracle for that shape."""
    dmp, optimizer = make_sharded(PredictionsOnlyDLRM, "table_wise", seed=SEED)
    dmp.eval()
    with torchrec_on_cpu(), pytest.raises(ValueError, match="unpack"):
        run_pipeline(UpstreamEvalFused(dmp, optimizer, DEVICE), make_batches(seed=DATA_SEED))
