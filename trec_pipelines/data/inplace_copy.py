"""``async_inplace_copy``: the in-place host-to-device copy, issued by a worker thread.

[Note: async in-place copy]
With ``enable_inplace_copy_batch`` a batch's device memory is allocated on the
stream that will consume it (the default stream) and filled on the memcpy
stream (``batch.to(..., data_copy_stream=memcpy)``), so the caching allocator
hands that memory back to the default stream's pool when the batch is freed
and no ``record_stream`` is needed.  Issuing that copy still costs the training
thread the CPU time of one allocation and one ``copy_`` per tensor of the batch.
``async_inplace_copy`` moves that issuing to one background thread:

* the training thread pulls the host batch (so iterator errors still surface
  in ``progress()``), reads its own current stream and submits the copy;
* the worker enters that stream, so the batch is allocated exactly where the
  synchronous in-place copy would allocate it (a new thread would otherwise
  issue on its own current stream), and issues the copy on the memcpy stream;
* the pipeline's batch slot holds the copy's :class:`~concurrent.futures.Future`
  until the slot is first read: :class:`BatchQueue` then waits for the worker
  to have *issued* the copy (not for the device to have run it), so every
  ``wait_stream`` that orders a consumer after the memcpy stream is issued after
  the copy it must cover.

One worker, so copies are issued in submission order.  On a device without
streams (CPU) there is no copy to issue, and the pipelines copy synchronously,
as torchrec does; see :func:`async_copy_device`.
"""

from __future__ import annotations

import logging
import weakref
from abc import ABCMeta
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, Optional, Protocol

import torch
from torchrec.distributed.train_pipeline import In

from trec_pipelines.core import lifetime
from trec_pipelines.core.streams import (
    StreamSet,
    copy_to_device,
    current_stream,
    has_streams,
    on_stream,
)

logger: logging.Logger = logging.getLogger(__name__)

# The worker thread's name, also what the stream recorder labels its work with.
WORKER_THREAD = "trec_pipelines-inplace_copy"


def async_copy_device(
    requested: bool,
    device: torch.device,
    memcpy: Optional[torch.Stream],
    pipeline: str,
    what: str = "async_inplace_copy=True",
) -> Optional[torch.device]:
    """The device the copy worker copies to, or None when the copy stays synchronous.

    ``None`` when not requested, and on a device without streams (CPU), where
    the batch needs no device copy at all: that case is logged, as torchrec
    logs it.  A device named without an index ("cuda") is made explicit from
    the memcpy stream: "cuda" means the training thread's current device, and
    a new thread's current device is device 0.
    """
    if not requested:
        return None
    if not has_streams(device) or memcpy is None:
        logger.warning(
            "%s: %s has no effect on %s, which has no streams and "
            "no host-to-device copy to issue; batches are copied synchronously, as "
            "torchrec does. It overlaps the copy's issuing on cuda/mtia devices.",
            pipeline,
            what,
            device.type,
        )
        return None
    return device if device.index is not None else memcpy.device


class InplaceCopyWorker:
    """One background thread issuing batch copies (see [Note: async in-place copy]).

    In place (the default): memory on the training thread's current stream,
    filled on the memcpy stream.  With ``inplace=False`` (TrainPipelineSparseDistT
    without ``enable_inplace_copy_batch``) the copy allocates on the memcpy
    stream, as a synchronous ``copy_batch_to_gpu`` does, and the consumer
    ``record_stream``-s it as usual.  The thread is shut down (without waiting)
    by :meth:`shutdown` or when the worker is collected with its pipeline.
    """

    def __init__(self, device: torch.device, memcpy: torch.Stream, inplace: bool = True) -> None:
        self._device = device
        self._memcpy = memcpy
        self._inplace = inplace
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=WORKER_THREAD)
        self._executor: Optional[ThreadPoolExecutor] = executor
        # Not a __del__: the executor must not keep the pipeline alive, and
        # finalize runs once whichever way the worker goes.
        self._finalizer = weakref.finalize(self, executor.shutdown, wait=False)
        lifetime.own_executor(executor)  # shut down at interpreter exit if still running

    def submit(self, batch: Any) -> "Future[Any]":
        """Issue ``batch``'s copy on the worker; returns the device batch's future."""
        if self._executor is None:
            raise RuntimeError(
                "the async in-place copy worker was shut down; build a new pipeline to train again"
            )
        # Read on the training thread: the stream the batch's memory belongs to.
        alloc_stream = current_stream(self._device)
        device, memcpy, inplace = self._device, self._memcpy, self._inplace

        def copy() -> Any:
            with on_stream(alloc_stream):
                return copy_to_device(batch, device, memcpy, inplace=inplace)

        return self._executor.submit(copy)

    def shutdown(self) -> None:
        """Stop the thread once the copies already submitted are issued."""
        self._executor = None
        self._finalizer()


class CopyingPipeline(Protocol):
    """What :func:`make_copy_worker` uses of a pipeline: its device, its side
    streams (the memcpy one) and ``enable_inplace_copy_batch``, which it may turn on."""

    _enable_inplace_copy_batch: bool

    @property
    def _device(self) -> torch.device: ...

    @property
    def _streams(self) -> StreamSet: ...


def make_copy_worker(
    pipeline: CopyingPipeline, async_inplace_copy: bool, *, every_copy: bool = False
) -> Optional[InplaceCopyWorker]:
    """The worker issuing ``pipeline``'s in-place copies for ``async_inplace_copy``, or None.

    Called once the pipeline's ``_device``, ``_streams`` and
    ``_enable_inplace_copy_batch`` are set; the pipeline keeps the result as
    ``_copy_worker`` and submits its copies there when it is not None.  With
    ``every_copy`` (TrainPipelineSparseDistT) the worker issues every copy, in
    place or not, as ``enable_inplace_copy_batch`` says; otherwise the worker
    copies in place, and sets ``enable_inplace_copy_batch`` when it was off.
    See [Note: async in-place copy].
    """
    name = type(pipeline).__name__
    memcpy: Optional[torch.Stream] = pipeline._streams.memcpy
    if every_copy:
        device = async_copy_device(True, pipeline._device, memcpy, name, "the copy thread")
        if device is None or memcpy is None:
            return None
        return InplaceCopyWorker(device, memcpy, pipeline._enable_inplace_copy_batch)
    device = async_copy_device(async_inplace_copy, pipeline._device, memcpy, name)
    if device is None or memcpy is None:
        return None
    if not pipeline._enable_inplace_copy_batch:
        logger.info(
            "%s: async_inplace_copy=True copies batches in place, as if "
            "enable_inplace_copy_batch=True (torchrec ignores it without that flag)",
            name,
        )
        pipeline._enable_inplace_copy_batch = True
    return InplaceCopyWorker(device, memcpy)


class HoldsCopyWorker:
    """A pipeline that may issue its in-place copies on a worker of its own
    (:func:`make_copy_worker`), with torchrec 1.9.2's read-only attribute that
    says whether it does."""

    # Set by the pipeline's constructor; None: copies are issued in the step.
    _copy_worker: Optional[InplaceCopyWorker] = None

    @property
    def _async_inplace_copy(self) -> bool:
        """True when in-place copies are issued by the background worker."""
        return self._copy_worker is not None


class AsyncInplaceCopyMixin(HoldsCopyWorker, Generic[In], metaclass=ABCMeta):
    """What a pipeline needs for ``async_inplace_copy`` (torchrec 1.9.2's name).

    Our pipelines hold their copy worker (:func:`make_copy_worker`) rather than
    derive from this class; each that takes ``async_inplace_copy`` is registered
    as a virtual subclass, so ``isinstance(pipeline, AsyncInplaceCopyMixin)``
    holds as it does for torchrec's.  A class of your own may still mix it in:
    it calls :meth:`_make_copy_worker` once its device, streams and
    ``enable_inplace_copy_batch`` are set, keeps the result in ``_copy_worker``
    and submits its in-place copies there when it is not None.
    """

    _device: torch.device
    _streams: Any
    _enable_inplace_copy_batch: bool

    def _make_copy_worker(
        self, async_inplace_copy: bool, *, every_copy: bool = False
    ) -> Optional[InplaceCopyWorker]:
        """The worker issuing in-place copies for ``async_inplace_copy``, or None
        (see :func:`make_copy_worker`)."""
        return make_copy_worker(self, async_inplace_copy, every_copy=every_copy)


class BatchQueue(deque):  # type: ignore[type-arg]
    """The pipeline's in-flight batches, where a slot may hold a copy's Future.

    Reading a slot (``q[k]``, ``popleft()``, ``pop()``, iteration) waits for the
    copy worker to have issued that batch's copy and stores the device batch in
    the slot, so pipeline code only ever sees device batches.  A pipeline holds
    one only with a copy worker (``async_inplace_copy``, TrainPipelineSparseDistT);
    otherwise its ``batches`` is a plain deque.
    """

    def __getitem__(self, index: Any) -> Any:
        item = super().__getitem__(index)
        if isinstance(item, Future):
            item = item.result()
            super().__setitem__(index, item)
        return item

    def popleft(self) -> Any:
        item = super().popleft()
        return item.result() if isinstance(item, Future) else item

    def pop(self) -> Any:  # type: ignore[override]  # deque's pop takes no index
        item = super().pop()
        return item.result() if isinstance(item, Future) else item

    def __iter__(self) -> Any:
        for index in range(len(self)):
            yield self[index]


__all__ = [
    "AsyncInplaceCopyMixin",
    "BatchQueue",
    "HoldsCopyWorker",
    "InplaceCopyWorker",
    "WORKER_THREAD",
    "async_copy_device",
    "make_copy_worker",
]
