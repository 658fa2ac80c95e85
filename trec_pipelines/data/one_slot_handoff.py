"""A one-item hand-over from one producer thread to one consumer.

The producer loads the next item only once the consumer has taken the previous
one, so at most one item waits in the slot.  The eval pipeline's loader thread
and :class:`~trec_pipelines.data.data_loading.DataLoadingThread` are built on it.
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, Optional, Tuple, Type, TypeVar, Union

T = TypeVar("T")


class _Raised:
    """A recoverable exception standing in the slot for the item it replaced."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class OneSlotHandoff(Generic[T]):
    """The slot, and the protocol both threads follow around it.

    The producer thread runs :meth:`produce`; the consumer calls :meth:`take`;
    either may call :meth:`stop`.  An exception raised by the producer's
    ``load`` ends production and is raised by the next :meth:`take`, once,
    after the item loaded before it has been taken; one of the ``recoverable``
    types instead takes that item's place in the slot (the :meth:`take` that
    would have got the item raises it) and production goes on.
    """

    def __init__(self, recoverable: Tuple[Type[BaseException], ...] = ()) -> None:
        self._cond = threading.Condition()
        self._recoverable = recoverable
        self._slot: Optional[Union[T, _Raised]] = None
        self._error: Optional[BaseException] = None
        self._finished = False
        self._stopping = False

    def produce(self, load: Callable[[], Optional[T]]) -> None:
        """Fill the slot with ``load()`` until it returns None, raises, or :meth:`stop`."""
        try:
            while True:
                with self._cond:
                    while self._slot is not None and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                # Outside the lock: take() and stop() must not wait for a load.
                try:
                    item: Optional[Union[T, _Raised]] = load()
                except self._recoverable as error:
                    item = _Raised(error)
                if item is None:
                    return
                with self._cond:
                    if self._stopping:
                        return  # stopped during the load: the item is dropped
                    self._slot = item
                    self._cond.notify_all()
        except BaseException as error:  # handed to the consumer by take()
            with self._cond:
                self._error = error
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def take(self) -> Optional[T]:
        """The next item, waiting for it; None once production has ended or stopped.

        Raises the producer's exception, once, in place of the item it failed to load.
        """
        with self._cond:
            while self._slot is None and not self._finished and not self._stopping:
                self._cond.wait()
            item: Optional[Union[T, _Raised]] = self._slot
            self._slot = None
            error = None
            if item is None:
                error, self._error = self._error, None
            elif isinstance(item, _Raised):
                error = item.error
                item = None
            self._cond.notify_all()
        if error is not None:
            raise error
        return item

    def settle(self) -> None:
        """Wait until the producer is idle: its item is in the slot, or it has ended."""
        with self._cond:
            while self._slot is None and not self._finished and not self._stopping:
                self._cond.wait()

    def stop_when_idle(self) -> Optional[BaseException]:
        """Wait until the producer is idle, end production (an item in the slot is
        dropped) and return the exception it raised and :meth:`take` did not raise
        yet, if any; after it, the producer calls ``load`` no more."""
        with self._cond:
            while self._slot is None and not self._finished and not self._stopping:
                self._cond.wait()
            left = self._slot.error if isinstance(self._slot, _Raised) else self._error
            self._slot, self._error = None, None
            self._stopping = True
            self._cond.notify_all()
        return left

    def stop(self) -> None:
        """End production (an item in the slot is dropped); returns without waiting."""
        with self._cond:
            self._stopping = True
            self._slot = None
            self._cond.notify_all()
