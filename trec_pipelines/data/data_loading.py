"""A thread that loads the next batch and copies it to the device while you train.

:class:`DataLoadingThread` is torchrec's standalone loader thread, for loops
that do not use a pipeline: ``start()`` it, call :meth:`get_next_batch` once per
step, :meth:`stop` it at the end.  It holds at most one batch ahead.
"""

from __future__ import annotations

import logging
import threading
from typing import Generic, Iterator, Optional, cast

import torch
from torchrec.distributed.train_pipeline import In

from trec_pipelines.core import lifetime
from trec_pipelines.core.streams import device_module, new_stream, on_stream
from trec_pipelines.data.one_slot_handoff import OneSlotHandoff

logger: logging.Logger = logging.getLogger(__name__)


class DataLoadingThread(threading.Thread, Generic[In]):
    """Loads batches from ``dataloader_iter`` and copies them to ``device``, one ahead.

    Args:
        device: where batches go.
        dataloader_iter: the host batches.
        to_device_non_blocking: passed to ``batch.to(device, non_blocking=...)``.
        memcpy_stream_priority: priority of the copy stream it creates (CUDA/MTIA).
        memcpy_stream: the copy stream to use instead of creating one.

    The copy runs on the memcpy stream (``None`` on CPU: the thread's current
    stream).  An exception raised by the iterator ends the thread and is raised
    by the next :meth:`get_next_batch`; the batches loaded before it are
    handed over first.
    """

    def __init__(
        self,
        device: torch.device,
        dataloader_iter: Iterator[In],
        to_device_non_blocking: bool,
        memcpy_stream_priority: int = 0,
        memcpy_stream: Optional[torch.Stream] = None,
    ) -> None:
        super().__init__(name="DataLoadingThread", daemon=True)
        self._device = device
        self._dataloader_iter = dataloader_iter
        self._non_blocking = to_device_non_blocking
        self._memcpy_stream = (
            memcpy_stream
            if memcpy_stream is not None
            else new_stream(device, memcpy_stream_priority)
        )
        self._handoff: OneSlotHandoff[In] = OneSlotHandoff()
        # Stopped and joined at interpreter exit if still running (see [Note: a clean exit]).
        lifetime.own_thread(self, self._handoff.stop)

    def run(self) -> None:
        if self._memcpy_stream is not None:
            # A new thread starts on the default device; copy on the caller's.
            device_module(self._device).set_device(self._memcpy_stream.device)
        self._handoff.produce(self._load_one)

    def _load_one(self) -> Optional[In]:
        try:
            batch = next(self._dataloader_iter)
        except StopIteration:
            return None
        except BaseException as error:  # raised to the consumer by get_next_batch()
            logger.error(
                "DataLoadingThread: loading stopped on %s: %s", type(error).__name__, error
            )
            raise
        with on_stream(self._memcpy_stream):
            return cast(In, batch.to(self._device, non_blocking=self._non_blocking))

    def stop(self) -> None:
        """Stop loading (the batch it holds is dropped); returns without waiting."""
        self._handoff.stop()

    def get_next_batch(self, none_throws: bool = False) -> Optional[In]:
        """The next batch on the device, waiting for it.

        At the end of the data (or after :meth:`stop`): ``None``, or
        ``StopIteration`` with ``none_throws``.  The copy was issued on the
        memcpy stream: on a GPU make your stream wait for it before use.
        """
        batch = self._handoff.take()
        if batch is None and none_throws:
            raise StopIteration
        return batch
