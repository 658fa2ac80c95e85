"""Newcomers' mistakes: each raises (or logs) a message that names the fix.

One row per mistake, run over every variant it applies to.  A mistake in the
model or the data is not reported as a retryable step failure: no note offers
a retry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple, Type

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.optim.keyed import CombinedOptimizer

import trec_pipelines as tp
from tests.unit.fakes import Batch, TinyModel, make_batches, optimizer_for, plain_loop
from trec_pipelines.core.errors import ForwardOutputError

CPU = torch.device("cpu")


def _train(name: str, **kwargs: Any) -> Callable[[nn.Module, Any], Any]:
    def make(model: nn.Module, optimizer: Any = None) -> Any:
        optimizer = optimizer_for(model) if optimizer is None else optimizer
        return getattr(tp, name)(model, optimizer, CPU, **kwargs)

    return make


def _staged(model: nn.Module, optimizer: Any = None) -> Any:
    return tp.StagedTrainPipeline([tp.PipelineStage("h2d", lambda b: b.to(CPU), None)])


VARIANTS: Dict[str, Callable[..., Any]] = {
    "base": _train("TrainPipelineBase"),
    "sparse_dist": _train("TrainPipelineSparseDist"),
    "semi_sync": _train("TrainPipelineSemiSync", start_batch=0),
    "pt2": _train("TrainPipelinePT2"),
    "eval": _train("EvalPipelineSparseDist"),
    "staged": _staged,
}
TRAINING = ["base", "sparse_dist", "semi_sync", "pt2"]
CLASS = {
    "base": "TrainPipelineBase",
    "sparse_dist": "TrainPipelineSparseDist",
    "semi_sync": "TrainPipelineSemiSync",
    "pt2": "TrainPipelinePT2",
}


# ------------------------------------------------------------ the forward's result


class ReturnsLossOnly(TinyModel):
    def forward(self, batch: Batch) -> Any:  # type: ignore[override]
        return super().forward(batch)[0].sum()


class ReturnsPerSampleLoss(TinyModel):
    def forward(self, batch: Batch) -> Any:  # type: ignore[override]
        return super().forward(batch)[0]


class ReturnsDict(TinyModel):
    def forward(self, batch: Batch) -> Any:  # type: ignore[override]
        loss, pred = super().forward(batch)
        return {"loss": loss, "pred": pred}


class ReturnsTriple(TinyModel):
    def forward(self, batch: Batch) -> Any:  # type: ignore[override]
        loss, pred = super().forward(batch)
        return loss, pred, batch.labels


@dataclass(frozen=True)
class ForwardRow:
    model: Type[TinyModel]
    described: str  # how the message names what came back


FORWARD_ROWS = {
    "bare_scalar_loss": ForwardRow(ReturnsLossOnly, "a 0-d (scalar) tensor alone"),
    "bare_per_sample_loss": ForwardRow(ReturnsPerSampleLoss, "a (3,) tensor alone"),
    "dict": ForwardRow(ReturnsDict, "a dict with keys ['loss', 'pred']"),
    "triple": ForwardRow(ReturnsTriple, "a tuple of 3 elements"),
}


@pytest.mark.parametrize("variant", TRAINING)
@pytest.mark.parametrize("row", list(FORWARD_ROWS.values()), ids=list(FORWARD_ROWS))
def test_forward_without_the_pair_names_it(row: ForwardRow, variant: str) -> None:
    pipeline = VARIANTS[variant](row.model())
    with pytest.raises(ForwardOutputError) as raised:
        pipeline.progress(iter(make_batches(4)))
    name = type(pipeline).__name__
    assert str(raised.value) == (
        f"{name}: the model's forward returned {row.described}, but a training pipeline "
        "needs torchrec's pair (losses, output): it backpropagates torch.sum(losses, "
        "dim=0) and progress() returns output. Return e.g. (loss, (loss.detach(), "
        "logits)) from the forward (torchrec's DLRMTrain returns (loss, (loss.detach(), "
        "logits, labels))), or pass custom_model_fwd= a function of the batch that "
        "returns the pair."
    )
    assert isinstance(raised.value, TypeError)
    # The model's mistake: no note offering a retry.
    assert not getattr(raised.value, "__notes__", [])


@pytest.mark.parametrize("variant", ["base", "sparse_dist"])
def test_custom_model_fwd_fixes_a_dict_forward(variant: str) -> None:
    # The fix the message names works, and trains as the plain loop does.
    model, ref = ReturnsDict(), TinyModel()

    def pair(batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        out = model(batch)
        return out["loss"], out["pred"]

    batches = make_batches(5)
    pipeline = _train(CLASS[variant], custom_model_fwd=pair)(model)
    outputs = _drain(pipeline, iter(batches))
    expected = plain_loop(ref, batches)
    assert len(outputs) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))


def test_eval_takes_a_forward_of_predictions_alone() -> None:
    # Not a mistake for the eval pipelines (torchrec's take it too): no check there.
    model = ReturnsPerSampleLoss()
    outputs = _drain(VARIANTS["eval"](model.eval()), iter(make_batches(3)))
    assert [o.shape for o in outputs] == [torch.Size([3])] * 3


# ----------------------------------------------------------------- progress()'s data

ITERABLE_ROWS: Dict[str, Tuple[Callable[[List[Any]], Any], str]] = {
    "list": (
        lambda batches: batches,
        "progress() takes an iterator, got a list (4 items): an iterable, not an iterator. "
        "Pass an iterator: it = iter(batches), then progress(it) until it raises "
        "StopIteration.",
    ),
    "dataloader": (
        lambda batches: torch.utils.data.DataLoader(batches, batch_size=None),
        "progress() takes an iterator, got a DataLoader (an iterable, not an iterator). "
        "Pass iter(dataloader), once per epoch: it = iter(dataloader), then progress(it) "
        "until it raises StopIteration.",
    ),
    "tuple": (
        tuple,
        "progress() takes an iterator, got a tuple (4 items): an iterable, not an "
        "iterator. Pass an iterator: it = iter(batches), then progress(it) until it "
        "raises StopIteration.",
    ),
    "not_iterable": (
        lambda batches: batches[0],
        "progress() takes an iterator of batches, got a Batch. Pass iter(dataloader) (or "
        "iter(batches) for a list of batches).",
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("row", list(ITERABLE_ROWS.values()), ids=list(ITERABLE_ROWS))
def test_an_iterable_instead_of_an_iterator(row: Tuple[Any, str], variant: str) -> None:
    make_source, message = row
    model, ref = TinyModel(), TinyModel()
    pipeline = VARIANTS[variant](model)
    batches = make_batches(4)
    with pytest.raises(TypeError) as raised:
        pipeline.progress(make_source(batches))
    assert str(raised.value) == message
    assert not getattr(raised.value, "__notes__", [])
    if variant in ("base", "sparse_dist"):
        # Nothing happened: the fix then trains as the plain loop does.
        outputs = _drain(pipeline, iter(batches))
        expected = plain_loop(ref, batches)
        assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))


@pytest.mark.parametrize("variant", ["base", "sparse_dist", "semi_sync", "pt2", "eval"])
def test_a_batch_that_is_not_pipelineable(variant: str) -> None:
    pipeline = VARIANTS[variant](TinyModel())
    with pytest.raises(TypeError) as raised:
        pipeline.progress(iter([{"dense": torch.ones(3, 3)}] * 3))
    assert str(raised.value) == (
        "the data iterator yielded a dict, which is neither a torch.Tensor nor a "
        "torchrec.streamable.Pipelineable. Wrap the batch in a class that implements "
        "Pipelineable (to(device, non_blocking) and record_stream(stream)), for example "
        "a dataclass of tensors and KeyedJaggedTensors."
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_after_the_end_the_spent_iterator_ends_again(variant: str) -> None:
    # As torchrec's pipelines: StopIteration again (None for Staged), with no error;
    # the same iterator is never called again once it ended.
    pipeline = VARIANTS[variant](TinyModel())
    calls: List[int] = []

    def counted() -> Any:
        for batch in make_batches(2):
            calls.append(1)
            yield batch

    it = counted()
    outputs = _drain(pipeline, it)
    assert len(outputs) == 2
    for _ in range(3):
        if variant == "staged":
            assert pipeline.progress(it) is None
        else:
            with pytest.raises(StopIteration):
                pipeline.progress(it)
    assert len(calls) == 2


# ------------------------------------------------------------ the constructor's args


@pytest.mark.parametrize("variant", TRAINING)
def test_an_optimizer_over_no_parameters(variant: str) -> None:
    with pytest.raises(ValueError) as raised:
        VARIANTS[variant](TinyModel(), CombinedOptimizer([]))
    name = CLASS[variant]
    assert str(raised.value) == (
        f"{name}: the optimizer holds no parameters, so the model's 5 trainable "
        "parameter(s) that no fused optimizer updates ('sparse.bag.weight', "
        "'dense.weight', 'dense.bias' and 2 more) would never change. Build the optimizer "
        "over them, e.g. KeyedOptimizerWrapper(dict(in_backward_optimizer_filter("
        "model.named_parameters())), lambda params: torch.optim.SGD(params, lr=0.1)), "
        "after wrapping the model in DistributedModelParallel and from the wrapped "
        "model's parameters (a generator of parameters can be read only once)."
    )


def test_an_empty_optimizer_is_fine_when_nothing_needs_it() -> None:
    # Every trainable parameter is updated in the backward: torchrec accepts it, so do we.
    model = TinyModel()
    for param in model.parameters():
        param._in_backward_optimizers = []  # type: ignore[attr-defined]
    pipeline = tp.TrainPipelineSparseDist(model, CombinedOptimizer([]), CPU)
    assert len(_drain(pipeline, iter(make_batches(2)))) == 2


# ------------------------------------------------------------ a model not sharded


class UnshardedModel(nn.Module):
    """An EmbeddingBagCollection left out of DistributedModelParallel."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    name="t", feature_names=["f0", "f1"], num_embeddings=20, embedding_dim=4
                )
            ]
        )
        self.over = nn.Linear(8 + 3, 1)

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.ebc(batch.sparse).values(), batch.dense], dim=1)
        logits = self.over(x).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(
            logits, batch.labels, reduction="none"
        )
        return loss, logits.detach()


@pytest.mark.parametrize("variant", ["sparse_dist", "semi_sync"])
def test_a_model_not_wrapped_in_dmp_trains_and_says_how(
    variant: str, caplog: pytest.LogCaptureFixture
) -> None:
    # torchrec trains such a model unpipelined: so do we, and say what to wrap.
    model, ref = UnshardedModel(), UnshardedModel()
    batches = make_batches(4)
    with caplog.at_level(logging.WARNING, logger="trec_pipelines"):
        outputs = _drain(VARIANTS[variant](model), iter(batches))
    name = CLASS[variant]
    assert (
        f"{name}: the model has no ShardedModule, so there is no input_dist to pipeline; "
        "it trains unpipelined, as torchrec's class does (a plain loop with the H2D copy "
        "overlapped). Its embedding module(s) 'ebc' are not sharded: wrap the model in "
        "DistributedModelParallel (DistributedModelParallel(model, device=device)) before "
        "building the pipeline, so their input_dist is pipelined."
    ) in caplog.messages
    expected = plain_loop(ref, batches)
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))


def test_base_takes_any_module_without_a_word(caplog: pytest.LogCaptureFixture) -> None:
    model, ref = UnshardedModel(), UnshardedModel()
    batches = make_batches(3)
    with caplog.at_level(logging.WARNING, logger="trec_pipelines"):
        outputs = _drain(VARIANTS["base"](model), iter(batches))
    assert not [m for m in caplog.messages if "ShardedModule" in m]
    expected = plain_loop(ref, batches)
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))


def _drain(pipeline: Any, it: Any) -> List[Any]:
    outputs: List[Any] = []
    for _ in range(100):
        try:
            out = pipeline.progress(it)
        except StopIteration:
            return outputs
        if out is None and isinstance(pipeline, tp.StagedTrainPipeline):
            return outputs
        outputs.append(out)
    raise AssertionError("the pipeline did not stop")
