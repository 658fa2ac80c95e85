"""The agreement's decision on an end of data, and the source's padding, with no process group.

A fake channel stands in for the other rank: it holds ``other`` batches per
epoch, and each pull's agreement is :func:`~trec_pipelines.data.agreement.decide`
over this rank's code and the other rank's, as the real exchange delivers them.
"""

from __future__ import annotations

from typing import Any, List, Optional

import pytest
import torch.distributed

from trec_pipelines.data.agreement import ENDED, FAILED, FINE, MALFORMED, Agreed, decide, encode
from trec_pipelines.data.padding import Padding, uneven_stop, unwrap
from trec_pipelines.data.source import BatchSource


def test_decide_tells_some_ended_from_all_ended() -> None:
    ranks = [0, 1]
    assert decide([encode(7, FINE), encode(7, FINE)], ranks) == Agreed([], False, False)
    assert decide([encode(7, ENDED), encode(7, FINE)], ranks) == Agreed([], True, False)
    assert decide([encode(7, ENDED), encode(7, ENDED)], ranks) == Agreed([], True, True)
    assert decide([encode(7, MALFORMED), encode(7, ENDED)], ranks) == Agreed([0], True, False)
    # A pull whose next() raised on rank 1: every rank learns it, whatever else happened.
    assert decide([encode(7, ENDED), encode(7, FAILED)], ranks) == Agreed([], True, False, [1])


class _Decided:
    def __init__(self, agreed: Agreed) -> None:
        self._agreed = agreed

    def result(self) -> Agreed:
        return self._agreed


class _OtherRank:
    """The channel of a two-rank world whose other rank holds ``other`` batches an epoch."""

    def __init__(self, other: int) -> None:
        self.other = other
        self._epoch_start = 0

    def start(self, pull: int, ended: bool, malformed: bool, failed: bool = False) -> _Decided:
        here = FAILED if failed else ENDED if ended else MALFORMED if malformed else FINE
        there = ENDED if pull - self._epoch_start >= self.other else FINE
        return _Decided(decide([encode(pull, here), encode(pull, there)], [0, 1]))

    def new_epoch(self, pull: int) -> None:
        self._epoch_start = pull


def _epoch(source: BatchSource, batches: List[Any]) -> List[Any]:
    """What an eval pipeline's copy stage gets from ``source`` over one epoch."""
    it, got = iter(batches), []
    while True:
        source.fetch_ahead(it)
        batch: Optional[Any] = source.next(it)
        if batch is None:
            source.end_epoch()
            return got
        got.append(batch)


@pytest.mark.parametrize("here, other", [(2, 5), (5, 2), (3, 3)])
def test_a_rank_whose_data_ended_pads_with_its_last_batch_until_all_ended(
    here: int, other: int
) -> None:
    channel = _OtherRank(other)
    source = BatchSource(channel, pipelineable=False, pad_uneven=True)  # type: ignore[arg-type]
    batches = [f"b{i}" for i in range(here)]
    got = _epoch(source, batches)
    assert [unwrap(b)[0] for b in got] == batches + [batches[-1]] * max(0, other - here)
    assert [isinstance(b, Padding) for b in got] == [False] * here + [True] * max(0, other - here)
    assert source.unused == 0 and source.loaded == here


def test_the_stop_policy_ends_at_the_shortest_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)  # its warning names the rank
    source = BatchSource(_OtherRank(2), pipelineable=False)  # type: ignore[arg-type]
    assert _epoch(source, ["a", "b", "c", "d"]) == ["a", "b"]
    assert source.unused == 1  # the pull ahead, made before the end was known


def test_a_rank_with_no_batch_has_nothing_to_pad_with_and_says_what_to_do() -> None:
    for here, other in [(0, 3), (3, 0)]:
        source = BatchSource(_OtherRank(other), pipelineable=False, pad_uneven=True)  # type: ignore[arg-type]
        where = "this rank" if here == 0 else "another rank"
        with pytest.raises(RuntimeError, match=f"{where} has no batch at all.*uneven_data='stop'"):
            _epoch(source, [f"b{i}" for i in range(here)])


def test_the_next_epoch_pads_with_its_own_last_batch() -> None:
    channel = _OtherRank(3)
    source = BatchSource(channel, pipelineable=False, pad_uneven=True)  # type: ignore[arg-type]
    assert [unwrap(b)[0] for b in _epoch(source, ["a", "b"])] == ["a", "b", "b"]
    channel.new_epoch(source._pulls)
    assert [unwrap(b)[0] for b in _epoch(source, ["x"])] == ["x", "x", "x"]


def test_the_uneven_stop_warning_says_how_many_batches_are_not_trained() -> None:
    """20 batches here, 12 on the other rank: 13 pulled (the agreement runs a pull
    ahead), 12 trained, 1 dropped and 7 never read: 8 not trained."""
    it = iter(range(20))
    for _ in range(13):
        next(it)
    message = uneven_stop(13, 1, it)
    assert "8 of this rank's batches are not trained" in message, message
    assert "pulled 13 batch(es) this epoch and trains 12; 1 pulled batch(es)" in message
    assert "the 7 batch(es) still in its iterator are not read" in message
    generator = (i for i in range(3))
    next(generator)
    message = uneven_stop(1, 1, generator)
    assert "cannot say how many batches are left" in message, message
    assert "not trained:" not in message


def test_an_epoch_set_aside_pads_with_its_own_last_batch() -> None:
    """An eval epoch parked after its last batch (another iterator's epoch ran meanwhile)
    pads with that batch when it comes back, as it would have without the detour; before,
    it padded with the other iterator's batch."""
    source = BatchSource(  # type: ignore[arg-type]
        _OtherRank(10), pipelineable=False, pad_uneven=True, agree_ahead=False
    )
    first = iter(["a0", "a1"])
    got = []
    for _ in range(2):
        source.fetch_ahead(first)
        got.append(source.next(first))
    parked = source.save()
    other = iter(["b0", "b1", "b2"])
    source.fetch_ahead(other)
    assert source.next(other) == "b0"
    source.restore(parked)
    source.fetch_ahead(first)
    padding = source.next(first)  # this rank's data ended, the other rank's has not
    assert got == ["a0", "a1"] and isinstance(padding, Padding)
    assert unwrap(padding)[0] == "a1"
