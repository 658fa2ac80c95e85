"""Memory stashing for the stash variants (OptStash, EmbStash, PrefetchEMS): one place.

torchrec's ``MemoryStashingManager`` (``torchrec.distributed.memory_stashing``)
moves device memory to the host between the moment it was last read and the
moment it is needed again: an optimizer's state between two steps, an
embedding table's weights between its lookup and its backward (the sharded
embedding modules stash them right after the lookup when their table config
says ``stash_weights`` and the manager has streams), a UVM cache between the
forward and the backward.  The copies run on its own host-to-device and
device-to-host streams and a worker thread; its state is global (class level).

The pipelines never call it directly: they hold a :class:`Stashing`, which is
the manager's on a device with streams and a no-op on one without (CPU), where
every tensor already lives in host memory and there is nothing to free.  So the
schedules, their hooks and their recorded verbs are the same everywhere, and a
test can put a recording stand-in in its place.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Callable, Optional, cast

import torch

from trec_pipelines.streams import StreamSet, new_stream

logger: logging.Logger = logging.getLogger(__name__)


class Stashing:
    """Where nothing is stashed (no device memory to free): every call is a no-op.

    The subclass :class:`ManagerStashing` does the work; the pipelines call
    these methods at the points of their schedules.
    """

    enabled: bool = False

    def set_delay_stash(self, delay: bool) -> None:
        """Embedding stashes wait for :meth:`execute_pending_stashes` instead of
        running right after the lookup."""

    def execute_pending_stashes(self) -> None:
        """Run the embedding stashes delayed by :meth:`set_delay_stash`."""

    def restore_embedding_weights(self) -> None:
        """Bring the stashed embedding weights back (before their backward)."""

    def restore_cache(self) -> None:
        """Bring stashed UVM caches back (PrefetchEMS)."""

    def start_optimizer_restore(self) -> None:
        """Start bringing the optimizer state back, on the worker thread."""

    def finish_optimizer_restore(self) -> bool:
        """Wait until the optimizer state is back; False if no restore had been
        started, in which case it is restored now."""
        return True

    def finish_optimizer_stash(self) -> None:
        """Wait for the previous step's optimizer stash to be issued (its
        restore must not start before)."""

    def start_optimizer_stash(self, optimizer: torch.optim.Optimizer) -> None:
        """Start moving ``optimizer``'s state to the host, on the worker thread."""


class ManagerStashing(Stashing):
    """torchrec's ``MemoryStashingManager``, given this pipeline's streams."""

    enabled = True

    def __init__(self, streams: StreamSet, device: torch.device) -> None:
        from torchrec.distributed.memory_stashing import MemoryStashingManager

        # Typed Any: torchrec annotates CUDA streams, ours are the device-generic kind.
        self._manager: Any = cast(Any, MemoryStashingManager)
        # Host-to-device copies share the memcpy stream (as torchrec's classes
        # do); device-to-host copies get a stream of their own.
        self._manager.set_streams(streams.memcpy, new_stream(device))
        self._restore: Optional["Future[None]"] = None
        self._stash: Optional["Future[Any]"] = None
        self._await_restore: Callable[[], None] = _nothing

    def set_delay_stash(self, delay: bool) -> None:
        self._manager.set_delay_stash(delay)

    def execute_pending_stashes(self) -> None:
        self._manager.execute_pending_stashes()

    def restore_embedding_weights(self) -> None:
        self._manager.restore_embedding_weights()

    def restore_cache(self) -> None:
        self._manager.restore_emo_cache()

    def start_optimizer_restore(self) -> None:
        self._restore = self._manager.restore_optimizer_state_threaded()

    def finish_optimizer_restore(self) -> bool:
        started = self._restore is not None
        if self._restore is not None:
            self._restore.result()
            self._restore = None
        else:
            self._manager.restore_optimizer_state()
        self._await_restore()
        self._await_restore = _nothing
        return started

    def finish_optimizer_stash(self) -> None:
        if self._stash is not None:
            self._await_restore, _ = self._stash.result()
            self._stash = None

    def start_optimizer_stash(self, optimizer: torch.optim.Optimizer) -> None:
        self._stash = self._manager.stash_optimizer_state_threaded(optimizer)


def _nothing() -> None:
    pass


def stashing_for(streams: StreamSet, device: torch.device) -> Stashing:
    """The manager's stashing where the device has streams, else the no-op one."""
    if streams.memcpy is None:
        logger.info(
            "memory stashing: %s has no streams and no device memory to free; the "
            "stash and restore points of the schedule do nothing",
            device.type,
        )
        return Stashing()
    return ManagerStashing(streams, device)
