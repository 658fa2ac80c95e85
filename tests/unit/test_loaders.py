"""Every batch trained once, in order, as the plain loop would; epochs and odd batches."""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import pytest
import torch
from torch import nn

from tests.unit.fakes import (
    TinyModel,
    assert_same_training,
    base_pipeline,
    drain,
    make_batches,
    plain_loop,
    sparse_dist_pipeline,
)

PIPELINES = [base_pipeline, sparse_dist_pipeline]


@pytest.mark.parametrize("make", PIPELINES, ids=["base", "sparse_dist"])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4])
def test_loader_lengths_match_plain_loop(make: Callable[..., Any], n: int) -> None:
    batches = make_batches(n)
    model, ref = TinyModel(), TinyModel()
    outputs = drain(make(model), iter(batches))
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)


@pytest.mark.parametrize("make", PIPELINES, ids=["base", "sparse_dist"])
def test_new_iterator_starts_new_epoch_without_reset(make: Callable[..., Any]) -> None:
    batches = make_batches(3)
    model, ref = TinyModel(), TinyModel()
    pipeline = make(model)
    outputs = drain(pipeline, iter(batches)) + drain(pipeline, iter(batches))
    assert_same_training(outputs, plain_loop(ref, batches + batches), model, ref)


class Refillable:
    """One iterator object reused across epochs, like a persistent-workers DataLoader
    iterator: ``refill()`` (what ``iter(loader)`` does) restarts its ``_num_yielded``."""

    def __init__(self, batches: List[Any]) -> None:
        self._batches = batches
        self._num_yielded = 0
        self.next_calls_after_end = 0
        self._ended = False

    def __iter__(self) -> "Refillable":
        return self

    def refill(self) -> None:
        self._num_yielded, self._ended = 0, False

    def __next__(self) -> Any:
        if self._ended:
            self.next_calls_after_end += 1
        if self._num_yielded >= len(self._batches):
            self._ended = True
            raise StopIteration
        self._num_yielded += 1
        return self._batches[self._num_yielded - 1]


@pytest.mark.parametrize("make", PIPELINES, ids=["base", "sparse_dist"])
def test_same_iterator_refilled_starts_new_epoch(make: Callable[..., Any]) -> None:
    batches = make_batches(4)
    model, ref = TinyModel(), TinyModel()
    pipeline = make(model)
    loader = Refillable(batches)
    first = drain(pipeline, loader)
    assert loader.next_calls_after_end == 0, "next() called again after StopIteration"
    loader.refill()
    second = drain(pipeline, loader)
    assert loader.next_calls_after_end == 0
    assert_same_training(first + second, plain_loop(ref, batches + batches), model, ref)


class TensorModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        out = self.linear(x).squeeze(1)
        return out.pow(2), out.detach()


@pytest.mark.parametrize("make", PIPELINES, ids=["base", "sparse_dist"])
def test_plain_tensor_batches(make: Callable[..., Any]) -> None:
    batches = [torch.rand(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model, ref = TensorModel(), TensorModel()
    outputs = drain(make(model), iter(batches))
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)


def test_last_partial_batch() -> None:
    batches = make_batches(3) + make_batches(1, batch_size=1, seed=9)
    model, ref = TinyModel(), TinyModel()
    outputs = drain(sparse_dist_pipeline(model), iter(batches))
    assert [o.shape[0] for o in outputs] == [3, 3, 3, 1]
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)


def test_custom_model_fwd_is_used_by_base() -> None:
    calls: List[int] = []
    model = TinyModel()

    def fwd(batch: Any) -> Any:
        calls.append(1)
        return model(batch)

    drain(base_pipeline(model, custom_model_fwd=fwd), iter(make_batches(2)))
    assert len(calls) == 2


@pytest.mark.parametrize("make", PIPELINES, ids=["base", "sparse_dist"])
def test_dict_batch_is_rejected_with_the_fix(make: Callable[..., Any]) -> None:
    pipeline = make(TinyModel())
    with pytest.raises(TypeError, match="Pipelineable"):
        pipeline.progress(iter([{"dense": torch.zeros(2)}]))


def test_optimizer_none_is_rejected() -> None:
    from trec_pipelines import TrainPipelineBase, TrainPipelineSparseDist

    for cls in (TrainPipelineBase, TrainPipelineSparseDist):
        with pytest.raises(ValueError, match="optimizer"):
            cls(TinyModel(), None, torch.device("cpu"))  # type: ignore[arg-type]


class Strict:
    """Fails the test if next() is called after it raised StopIteration."""

    def __init__(self, batches: List[Any]) -> None:
        self._it, self._ended = iter(batches), False

    def __iter__(self) -> "Strict":
        return self

    def __next__(self) -> Any:
        assert not self._ended, "next() called on an iterator that already raised StopIteration"
        try:
            return next(self._it)
        except StopIteration:
            self._ended = True
            raise


@pytest.mark.parametrize("make", PIPELINES, ids=["base", "sparse_dist"])
def test_an_ended_iterator_is_never_asked_again(make: Callable[..., Any]) -> None:
    pipeline = make(TinyModel())
    loader = Strict(make_batches(3))
    assert len(drain(pipeline, loader)) == 3
    for _ in range(3):  # later epochs on the same ended iterator: nothing, and no next()
        with pytest.raises(StopIteration):
            pipeline.progress(loader)


@pytest.mark.parametrize("make", PIPELINES, ids=["base", "sparse_dist"])
def test_persistent_workers_dataloader_across_epochs(make: Callable[..., Any]) -> None:
    batches = make_batches(4)
    loader = torch.utils.data.DataLoader(
        batches, batch_size=None, num_workers=1, persistent_workers=True, collate_fn=lambda b: b
    )
    model, ref = TinyModel(), TinyModel()
    pipeline = make(model)
    it = iter(loader)
    first = drain(pipeline, it)
    assert iter(loader) is it  # the same iterator object, reset by the DataLoader
    second = drain(pipeline, it)
    assert_same_training(first + second, plain_loop(ref, batches + batches), model, ref)
