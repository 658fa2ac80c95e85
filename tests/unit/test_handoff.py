"""The one-slot hand-over both loader threads are built on."""

from __future__ import annotations

import threading
from typing import Iterator, List, Optional

import pytest

from trec_pipelines.data.one_slot_handoff import OneSlotHandoff


def _producer(handoff: OneSlotHandoff[int], items: Iterator[int]) -> threading.Thread:
    def load() -> Optional[int]:
        return next(items, None)

    thread = threading.Thread(target=handoff.produce, args=(load,), daemon=True)
    thread.start()
    return thread


def test_every_item_is_taken_once_in_order_then_none() -> None:
    handoff: OneSlotHandoff[int] = OneSlotHandoff()
    thread = _producer(handoff, iter(range(1, 50)))
    taken: List[Optional[int]] = [handoff.take() for _ in range(49)]
    assert taken == list(range(1, 50))
    assert handoff.take() is None and handoff.take() is None
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_the_producer_holds_at_most_one_item_ahead() -> None:
    handoff: OneSlotHandoff[int] = OneSlotHandoff()
    loaded: List[int] = []
    gate = threading.Event()

    def load() -> Optional[int]:
        loaded.append(len(loaded) + 1)
        if len(loaded) == 2:
            gate.set()
        return loaded[-1] if len(loaded) <= 5 else None

    thread = threading.Thread(target=handoff.produce, args=(load,), daemon=True)
    thread.start()
    assert handoff.take() == 1
    gate.wait(timeout=10)
    # Item 2 sits in the slot; the producer waits for take() before loading 3.
    thread.join(timeout=0.2)
    assert loaded == [1, 2]
    handoff.stop()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_an_error_comes_once_after_the_items_loaded_before_it() -> None:
    handoff: OneSlotHandoff[int] = OneSlotHandoff()

    def items() -> Iterator[int]:
        yield 1
        raise KeyError("broken shard")

    it = items()
    thread = threading.Thread(target=handoff.produce, args=(lambda: next(it),), daemon=True)
    thread.start()
    assert handoff.take() == 1
    with pytest.raises(KeyError, match="broken shard"):
        handoff.take()
    assert handoff.take() is None
    thread.join(timeout=10)


def test_stop_drops_the_waiting_item_and_ends_the_producer() -> None:
    handoff: OneSlotHandoff[int] = OneSlotHandoff()
    thread = _producer(handoff, iter(range(1, 1000)))
    assert handoff.take() == 1
    handoff.stop()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert handoff.take() is None


@pytest.mark.parametrize("recoverable", [True, False])
def test_stop_when_idle_returns_the_error_take_did_not_raise_and_ends_the_producer(
    recoverable: bool,
) -> None:
    """A rollback stops the eval loader thread this way: it waits for the load
    under way, drops a loaded item and keeps an error not handed over yet."""
    handoff: OneSlotHandoff[int] = OneSlotHandoff(recoverable=(KeyError,))
    error = KeyError("malformed") if recoverable else OSError("disk gone")
    loads: List[int] = []

    def load() -> Optional[int]:
        loads.append(1)
        if len(loads) == 2:
            raise error
        return len(loads)

    thread = threading.Thread(target=handoff.produce, args=(load,), daemon=True)
    thread.start()
    assert handoff.take() == 1
    assert handoff.stop_when_idle() is error
    thread.join(timeout=10)
    assert not thread.is_alive() and len(loads) == 2
    assert handoff.take() is None  # nothing is left to raise


def test_stop_when_idle_drops_a_loaded_item() -> None:
    handoff: OneSlotHandoff[int] = OneSlotHandoff()
    thread = _producer(handoff, iter(range(1, 50)))
    assert handoff.take() == 1
    assert handoff.stop_when_idle() is None  # item 2 was loaded: dropped
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert handoff.take() is None
