"""The verbs every schedule is built from, and the batch source they pull from.

Each pipeline's ``progress()`` is a sequence of these calls; the streams they
run on are passed in explicitly.  Nothing here keeps pipeline state except
:class:`BatchSource`, which owns the epoch bookkeeping of the data iterator.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Optional

import torch
from torchrec.streamable import Multistreamable, Pipelineable

from trec_pipelines.streams import hand_off, on_stream

logger: logging.Logger = logging.getLogger(__name__)


def check_batch(batch: Any) -> None:
    """Raise a ``TypeError`` naming the fix when ``batch`` can't be pipelined."""
    if isinstance(batch, (torch.Tensor, Pipelineable)):
        return
    raise TypeError(
        f"the data iterator yielded a {type(batch).__name__}, which is neither a "
        "torch.Tensor nor a torchrec.streamable.Pipelineable. Wrap the batch in a "
        "class that implements Pipelineable (to(device, non_blocking) and "
        "record_stream(stream)), for example a dataclass of tensors and "
        "KeyedJaggedTensors."
    )


def copy_to_device(
    batch: Any,
    device: torch.device,
    stream: Optional[torch.Stream],
    inplace: bool = False,
    blocking: bool = False,
) -> Any:
    """Host-to-device copy of ``batch`` issued on ``stream``.

    With ``inplace`` the batch allocates its device memory on the current stream
    and copies on ``stream`` itself (``data_copy_stream``), so the consumer
    needs no ``record_stream``.  ``blocking`` waits for the copy to finish.
    """
    check_batch(batch)
    if blocking:
        return batch.to(device=device, non_blocking=False)
    if inplace and stream is not None:
        return batch.to(device=device, non_blocking=True, data_copy_stream=stream)
    with on_stream(stream):
        return batch.to(device=device, non_blocking=True)


def wait_for_batch(batch: Any, producer: Optional[torch.Stream], record: bool = True) -> None:
    """Make the current stream wait for ``batch``, produced on ``producer``."""
    if producer is None or batch is None:
        return
    if record:
        if not isinstance(batch, (torch.Tensor, Multistreamable)):
            raise TypeError(
                f"{type(batch).__name__} must implement Multistreamable.record_stream "
                "to cross streams"
            )
        hand_off(batch, producer)
    else:
        hand_off(None, producer)


def backward(losses: torch.Tensor) -> None:
    """Backward of the summed per-sample losses (what torchrec pipelines do)."""
    torch.sum(losses, dim=0).backward()


class BatchSource:
    """Pulls batches from the user's iterator, one epoch at a time.

    * Within an epoch ``next()`` is never called again once the iterator has
      signalled its end.
    * An epoch ends when the pipeline tells it to (:meth:`end_epoch`, after the
      last batch has been trained); the next pull then starts a new epoch on
      whatever iterator is passed, including the same iterator object refilled
      (a ``DataLoader`` with ``persistent_workers=True``).
    * A new iterator object also starts a new epoch.
    """

    def __init__(self) -> None:
        self._iterator: Optional[Iterator[Any]] = None
        self.exhausted = False
        self.loaded = 0  # batches pulled so far, over all epochs

    def next(self, iterator: Iterator[Any]) -> Optional[Any]:
        if iterator is not self._iterator:
            self._iterator = iterator
            self.exhausted = False
        if self.exhausted:
            return None
        try:
            batch = next(iterator)
        except StopIteration:
            self.exhausted = True
            return None
        check_batch(batch)
        self.loaded += 1
        return batch

    def end_epoch(self) -> None:
        self.exhausted = False
