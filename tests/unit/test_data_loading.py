"""DataLoadingThread against torchrec's, on CPU: same batches, same end, same errors."""

from __future__ import annotations

from typing import Any, Iterator, List, Optional

import pytest
import torch
import torchrec
from torchrec.distributed.train_pipeline import DataLoadingThread as UpstreamThread

from trec_pipelines import DataLoadingThread

CPU = torch.device("cpu")
# torchrec's thread hands a loader's error to the caller from 1.8.0 on; 1.7.0's thread
# dies with it and get_next_batch() then waits forever (ours raises it there too).
_TORCHREC = tuple(int(part) for part in torchrec.__version__.split(".")[:2])
UPSTREAM_RAISES = pytest.param(
    UpstreamThread,
    marks=pytest.mark.skipif(
        _TORCHREC < (1, 8),
        reason=f"torchrec {torchrec.__version__}'s DataLoadingThread never hands a loader "
        "error to the caller (get_next_batch() waits forever); ours raises it",
    ),
)


def batches(n: int) -> List[torch.Tensor]:
    return [torch.full((2, 3), float(i)) for i in range(n)]


def failing_after(n: int) -> Iterator[torch.Tensor]:
    yield from batches(n)
    raise ValueError("loader broke")


def drain(thread: Any, calls: int) -> List[Optional[torch.Tensor]]:
    thread.start()
    out = [thread.get_next_batch() for _ in range(calls)]
    thread.stop()
    return out


def assert_same(ours: List[Optional[torch.Tensor]], theirs: List[Optional[torch.Tensor]]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


def test_hands_over_every_batch_then_none_like_torchrec() -> None:
    ours = drain(DataLoadingThread(CPU, iter(batches(3)), False), 5)
    theirs = drain(UpstreamThread(CPU, iter(batches(3)), False), 5)
    assert [b is None for b in ours] == [False, False, False, True, True]
    assert_same(ours, theirs)


@pytest.mark.parametrize("cls", [DataLoadingThread, UpstreamThread], ids=["ours", "torchrec"])
def test_none_throws_raises_stop_iteration_at_the_end(cls: Any) -> None:
    thread = cls(CPU, iter(batches(1)), True)
    thread.start()
    assert torch.equal(thread.get_next_batch(none_throws=True), batches(1)[0])
    with pytest.raises(StopIteration):
        thread.get_next_batch(none_throws=True)
    thread.stop()


@pytest.mark.parametrize("cls", [DataLoadingThread, UPSTREAM_RAISES], ids=["ours", "torchrec"])
def test_loader_error_reaches_the_caller_after_the_batches_before_it(cls: Any) -> None:
    thread = cls(CPU, failing_after(2), False)
    thread.start()
    got = [thread.get_next_batch(), thread.get_next_batch()]
    assert_same(got, batches(2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loader broke"):
        thread.get_next_batch()
    thread.stop()


@pytest.mark.parametrize("cls", [DataLoadingThread, UpstreamThread], ids=["ours", "torchrec"])
def test_batches_in_order_then_none_then_stop_iteration(cls: Any) -> None:
    # torchrec's DataLoadingThreadTest.test_fetch_data: once the data has ended,
    # it stays ended, whichever way the caller asks for the next batch.
    thread = cls(CPU, iter([torch.tensor([i]) for i in range(7)]), True)
    thread.start()
    assert [thread.get_next_batch().item() for _ in range(7)] == list(range(7))
    assert thread.get_next_batch(False) is None
    with pytest.raises(StopIteration):
        thread.get_next_batch(True)
    assert thread.get_next_batch() is None
    thread.stop()


def test_stop_ends_the_thread_and_join_returns() -> None:
    # torchrec's thread keeps a bool in Thread._stop, which breaks its join().
    def endless() -> Iterator[torch.Tensor]:
        while True:
            yield torch.zeros(1)

    thread = DataLoadingThread(CPU, endless(), False)
    thread.start()
    assert thread.get_next_batch() is not None
    thread.stop()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert thread.daemon
