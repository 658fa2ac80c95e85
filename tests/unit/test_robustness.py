"""Loader failures, end-of-data policies and bad input, on the fake model."""

from __future__ import annotations

import logging
from typing import Any, Iterator, List

import pytest
import torch

import trec_pipelines as tp
from tests.unit.fakes import (
    ModifyingModel,
    TinyModel,
    assert_same_training,
    base_pipeline,
    drain,
    make_batches,
    optimizer_for,
    plain_loop,
    sparse_dist_pipeline,
)
from trec_pipelines import TrainPipelineBase, TrainPipelineSparseDist


class FailsOnce:
    """Yields ``batches`` but raises ``error`` once, when asked for batch ``at``."""

    def __init__(self, batches: List[Any], at: int) -> None:
        self._batches, self._at, self._pos, self._failed = batches, at, 0, False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._pos == self._at and not self._failed:
            self._failed = True
            raise OSError("transient read error")
        if self._pos >= len(self._batches):
            raise StopIteration
        self._pos += 1
        return self._batches[self._pos - 1]


def _variant(name: str, **kwargs: Any) -> Any:
    def make(model: torch.nn.Module) -> Any:
        return getattr(tp, name)(model, optimizer_for(model), torch.device("cpu"), **kwargs)

    return make


TRAINING_VARIANTS = {
    "base": base_pipeline,
    "sparse_dist": sparse_dist_pipeline,
    "lite": _variant("TrainPipelineSparseDistLite"),
    "fused": _variant("TrainPipelineFusedSparseDist"),
    "prefetch": _variant("PrefetchTrainPipelineSparseDist"),
    "pec": _variant("TrainPipelinePEC"),
    # synchronous phase only, so the plain loop is its oracle
    "semi_sync": _variant("TrainPipelineSemiSync", start_batch=100),
}


@pytest.mark.parametrize("make", list(TRAINING_VARIANTS.values()), ids=list(TRAINING_VARIANTS))
@pytest.mark.parametrize("at", [0, 1, 2, 3, 5])
def test_iterator_error_reaches_caller_and_nothing_is_lost(at: int, make: Any) -> None:
    batches = make_batches(6)
    model, ref = TinyModel(), TinyModel()
    pipeline = make(model)
    loader = FailsOnce(batches, at)
    outputs: List[torch.Tensor] = []
    with pytest.raises(OSError, match="transient"):
        while True:
            outputs.append(pipeline.progress(loader))
    outputs += drain(pipeline, loader)
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)


def test_model_detached_exception_is_offered_as_torchrecs() -> None:
    # torchrec exports it (progress() after detach() attaches instead of raising
    # it); code catching it, or a RuntimeError, keeps working.
    assert issubclass(tp.ModelDetachedException, RuntimeError)


def test_execute_all_batches_false_drops_the_in_flight_batches(
    caplog: pytest.LogCaptureFixture,
) -> None:
    batches = make_batches(5)
    model, ref = TinyModel(), TinyModel()
    outputs = drain(sparse_dist_pipeline(model, execute_all_batches=False), iter(batches))
    # Like torchrec: the two batches in flight when the data ends are dropped.
    assert_same_training(outputs, plain_loop(ref, batches[:3]), model, ref)
    assert "dropping 2 in-flight batch(es)" in caplog.text


def test_on_unpipelined_raise_names_the_module_and_the_fix() -> None:
    pipeline = sparse_dist_pipeline(ModifyingModel(), on_unpipelined="raise")
    with pytest.raises(
        RuntimeError, match="(?s)NOT pipelined: sparse.*permute.*on_unpipelined='warn'"
    ):
        pipeline.progress(iter(make_batches(3)))


def test_on_unpipelined_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match="on_unpipelined"):
        sparse_dist_pipeline(TinyModel(), on_unpipelined="ignore")


def test_progress_after_detach_attaches_again_and_trains_every_batch_once() -> None:
    batches = make_batches(5)
    model, ref = TinyModel(), TinyModel()
    pipeline = sparse_dist_pipeline(model)
    it = iter(batches)
    outputs = [pipeline.progress(it)]
    pipeline.detach()
    assert "forward" not in model.sparse.__dict__
    outputs.append(pipeline.progress(it))  # attaches again, as upstream
    assert "forward" in model.sparse.__dict__
    outputs += drain(pipeline, it)
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)


@pytest.mark.parametrize("cls", [TrainPipelineBase, TrainPipelineSparseDist])
def test_model_on_another_device_is_rejected_with_the_fix(cls: Any) -> None:
    model = TinyModel()
    with pytest.raises(ValueError, match="parameters are on cpu.*device is cuda:0"):
        cls(model, optimizer_for(model), torch.device("cuda:0"))


def test_model_without_sharded_modules_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    class Dense(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(3, 1)

        def forward(self, batch: Any) -> Any:
            out = self.linear(batch.dense).squeeze(1)
            return out.pow(2), out.detach()

    model = Dense()
    with caplog.at_level(logging.WARNING):
        drain(
            TrainPipelineSparseDist(model, optimizer_for(model), torch.device("cpu")),
            iter(make_batches(4)),
        )
    assert caplog.text.count("no ShardedModule") == 1


def test_sync_exhaustion_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        sparse_dist_pipeline(TinyModel(), sync_exhaustion=True)


SWITCHING_VARIANTS = {
    "base": base_pipeline,
    "sparse_dist": sparse_dist_pipeline,
    "lite": _variant("TrainPipelineSparseDistLite"),
    "fused": _variant("TrainPipelineFusedSparseDist"),
    "prefetch": _variant("PrefetchTrainPipelineSparseDist"),
    "pec": _variant("TrainPipelinePEC"),
}


@pytest.mark.parametrize("make", list(SWITCHING_VARIANTS.values()), ids=list(SWITCHING_VARIANTS))
def test_eval_pass_between_train_steps_is_attributed_and_changes_nothing(make: Any) -> None:
    train, evaluation = make_batches(6), make_batches(3, seed=42)
    model, ref = TinyModel(), TinyModel()
    pipeline = make(model)
    train_it = iter(train)
    outputs = [pipeline.progress(train_it) for _ in range(3)]

    model.eval()
    eval_outputs = drain(pipeline, iter(evaluation))
    model.train()
    outputs += drain(pipeline, train_it)

    ref_optimizer = optimizer_for(ref)
    ref_outputs, ref_eval = [], []
    for step, batch in enumerate(train):
        if step == 3:
            ref.eval()
            ref_eval = [ref(b)[1] for b in evaluation]
            ref.train()
        ref_optimizer.zero_grad()
        loss, pred = ref(batch)
        torch.sum(loss, dim=0).backward()
        ref_optimizer.step()
        ref_outputs.append(pred)
    assert len(eval_outputs) == 3
    assert all(torch.equal(a, b) for a, b in zip(eval_outputs, ref_eval, strict=True)), (
        "eval outputs misattributed"
    )
    assert_same_training(outputs, ref_outputs, model, ref)


def test_reset_drops_parked_batches(caplog: pytest.LogCaptureFixture) -> None:
    pipeline = sparse_dist_pipeline(TinyModel())
    pipeline.progress(iter(make_batches(5)))
    pipeline.progress(iter(make_batches(5, seed=3)))
    pipeline.reset()
    assert "parked" in caplog.text and "drops 4 in-flight" in caplog.text
