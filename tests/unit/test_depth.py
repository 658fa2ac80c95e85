"""A variant's depth, declared with the class keyword ``depth``: how many host batches a step
pulls ahead, and the errors a wrong one gets."""

from __future__ import annotations

from typing import Any, Iterator, List

import pytest
import torch

from tests.unit.fakes import TinyModel, drain, make_batches, optimizer_for, plain_loop
from trec_pipelines import TrainPipelineBase, TrainPipelineSparseDist

CPU = torch.device("cpu")


class Counted:
    """An iterator over ``batches`` that counts its ``next()`` calls."""

    def __init__(self, batches: List[Any]) -> None:
        self.it: Iterator[Any] = iter(batches)
        self.pulled = 0

    def __iter__(self) -> "Counted":
        return self

    def __next__(self) -> Any:
        batch = next(self.it)
        self.pulled += 1
        return batch


class CopyAhead(TrainPipelineSparseDist[Any, Any], depth=4):
    """The guide's variant: one batch more copied at the fill."""

    def fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        empty = not self.batches
        super().fill_pipeline(dataloader_iter)
        if empty and len(self.batches) == 2:
            self.enqueue_batch(dataloader_iter)


class AheadOnly(TrainPipelineSparseDist[Any, Any], depth=4):
    """Declares a depth of 4 and holds SparseDist's three: the fourth waits on the host."""


class AheadByTrait(TrainPipelineSparseDist[Any, Any]):
    """The private trait, as the classes of this package declare it."""

    _traits = TrainPipelineSparseDist._traits.updated(depth=4)


def _first_step(cls: type) -> tuple[Any, Counted]:
    model = TinyModel()
    pipeline = cls(model, optimizer_for(model), CPU)
    it = Counted(make_batches(8))
    pipeline.progress(it)
    return pipeline, it


def test_the_class_keyword_sets_how_many_batches_a_step_pulls() -> None:
    assert TrainPipelineSparseDist._traits.depth == 3
    assert CopyAhead._traits.depth == AheadOnly._traits.depth == AheadByTrait._traits.depth == 4
    for cls, held, pulled in [
        (TrainPipelineSparseDist, 2, 3),  # nxt and new after the first step
        (CopyAhead, 3, 4),  # one more copied
        (AheadOnly, 2, 4),  # the fourth pulled, not copied
        (AheadByTrait, 2, 4),
    ]:
        pipeline, it = _first_step(cls)
        assert (len(pipeline.batches), it.pulled) == (held, pulled), cls.__name__


@pytest.mark.parametrize("cls", [CopyAhead, AheadOnly, AheadByTrait], ids=lambda c: c.__name__)
def test_a_deeper_variant_trains_every_batch_as_the_plain_loop(cls: type) -> None:
    batches = make_batches(7)
    reference = plain_loop(TinyModel(), batches)
    model = TinyModel()
    outputs = drain(cls(model, optimizer_for(model), CPU), iter(batches))
    assert len(outputs) == len(reference)
    for ours, ref in zip(outputs, reference, strict=True):
        assert torch.equal(ours, ref)


@pytest.mark.parametrize("depth", [0, -1, "4", 2.0, True])
def test_a_depth_that_is_not_a_positive_int_says_what_it_is(depth: Any) -> None:
    with pytest.raises(TypeError, match=r"Bad: depth must be a positive int .* got "):

        class Bad(TrainPipelineSparseDist[Any, Any], depth=depth):
            pass


def test_a_depth_on_a_pipeline_that_holds_a_fixed_number_says_what_to_subclass() -> None:
    with pytest.raises(
        TypeError,
        match=r"Deep: depth=4 applies to a pipeline that holds a queue of batches .*"
        r"TrainPipelineBase holds a fixed number: subclass TrainPipelineSparseDist",
    ):

        class Deep(TrainPipelineBase[Any, Any], depth=4):
            pass
