"""The batch source's end-of-data record through an epoch, against written-out states.

Each test drives a :class:`BatchSource` (one rank, no agreement) with a plain
iterator and checks its ``end`` record and torchrec's view (:attr:`BatchSource.ended`)
after each call; see ``[Note: the end of the data]``.  The last ones switch
iterators on ``TrainPipelineBase`` (the fake model) and compare with a plain loop
over the batches that should train: an epoch set aside keeps its own marks.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional

import pytest

from tests.unit.fakes import (
    TinyModel,
    assert_same_training,
    base_pipeline,
    drain,
    make_batches,
    plain_loop,
)
from trec_pipelines.data.end_of_data import EndOfData
from trec_pipelines.data.source import BatchSource

NOT_ENDED = EndOfData()


def test_an_epoch_ends_by_the_data_then_the_next_pull_starts_the_next() -> None:
    source = BatchSource(pipelineable=False)
    first = iter([1, 2])
    assert source.next(first) == 1
    source.fetch_ahead(first, 2)  # holds 2, then finds the end
    assert source.end == EndOfData(exhausted=True)
    assert not source.ended  # torchrec's flag: not until the copy stage finds no batch
    assert source.next(first) == 2
    assert source.next(first) is None
    assert source.end == EndOfData(exhausted=True, ended=True)
    assert source.ended
    source.end_epoch()
    assert source.end == EndOfData(ended=True, epoch_over=True)
    assert source.ended  # until the next epoch's first pull
    assert source.next(iter([3])) == 3
    assert source.end == NOT_ENDED


def test_true_written_between_steps_stops_the_epoch_and_false_resumes_it() -> None:
    source = BatchSource(pipelineable=False)
    data = iter([1, 2, 3])
    source.fetch_ahead(data, 2)
    source.set_ended(True)
    assert source.end == EndOfData(exhausted=True, ended=True, stopped_from_outside=True)
    assert source.unused == 2  # pulled ahead, not copied: dropped
    assert source.next(data) is None
    source.set_ended(False)
    assert source.end == NOT_ENDED
    assert source.next(data) == 3


def test_what_the_puller_writes_is_read_back_inside_pulls_only() -> None:
    seen: List[bool] = []

    def puller(iterator: Iterator[Any]) -> Optional[Any]:
        seen.append(source.ended)
        source.set_ended(True)  # says the data ended, and still returns a batch
        return next(iterator, None)

    source = BatchSource(pipelineable=False, puller=puller)
    data = iter([1, 2])
    assert source.next(data) == 1
    assert source.end == EndOfData(puller_said_ended=True)
    assert not source.ended  # between steps torchrec's view is the copy stage's
    assert source.next(data) == 2
    assert seen == [False, True]  # the second pull read the first one's write back


def test_an_epoch_set_aside_keeps_whether_its_data_ended() -> None:
    source = BatchSource(pipelineable=False)
    data = iter([1])
    assert source.next(data) == 1
    assert source.next(data) is None
    saved = source.save()
    assert saved.end == EndOfData(exhausted=True, ended=True)
    assert source.end == NOT_ENDED
    source.restore(saved)
    assert source.end == EndOfData(exhausted=True, ended=True)


def test_true_written_while_another_iterator_runs_leaves_a_parked_epoch_training() -> None:
    first, second = make_batches(4), make_batches(3, seed=3)
    model, ref = TinyModel(), TinyModel()
    pipeline = base_pipeline(model)
    parked = iter(first)
    outputs = [pipeline.progress(parked)]  # trains first[0]; first[1] copied
    running = iter(second)
    outputs.append(pipeline.progress(running))  # parks first[1]; trains second[0]
    pipeline._data_iter_stopped = True  # ends the running iterator's epoch only
    outputs += drain(pipeline, parked)  # first[1:] train, as with no switch
    expected = plain_loop(ref, [first[0], second[0], *first[1:]])
    assert_same_training(outputs, expected, model, ref)


def test_true_written_before_an_epoch_is_set_aside_comes_back_with_it() -> None:
    first, second = make_batches(4), make_batches(3, seed=3)
    model, ref = TinyModel(), TinyModel()
    pipeline = base_pipeline(model)
    stopped = iter(first)
    outputs = [pipeline.progress(stopped)]  # trains first[0]; first[1] copied
    pipeline._data_iter_stopped = True  # as torchrec's: first[1] will not train
    other = iter(second)
    outputs.append(pipeline.progress(other))  # parks first[1]; trains second[0]
    with pytest.raises(StopIteration):
        pipeline.progress(stopped)  # back: its epoch ends, first[1] untrained
    outputs += drain(pipeline, other)  # second[1:]
    expected = plain_loop(ref, [first[0], *second])
    assert_same_training(outputs, expected, model, ref)
