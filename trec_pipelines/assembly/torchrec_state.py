"""torchrec's instance attributes that outside code reads and writes, on our pipelines.

[Note: torchrec's state on our pipelines]
Code written against torchrec subclasses its pipelines and reads or writes
their state: a ``_next_batch`` override that switches iterators through
``_dataloader_iter`` and ends the epoch by setting ``_dataloader_exhausted``;
a ``progress()`` of its own that reads ``batches``, ``contexts`` and the
streams, and writes ``_state``.  Where one of those attributes is derived from
a component of ours, it is a property here, onto the one component that owns
it (the :class:`~trec_pipelines.data.source.BatchSource` owns the iterator and
the end of the data; the :class:`~trec_pipelines.core.streams.StreamSet` owns
the streams), with a setter where torchrec code writes it.  The attributes we
do not offer, and why, are listed in the migration guide's "Subclassing".

The properties are those of :class:`TorchrecState`, a base of
:class:`~trec_pipelines.assembly.pipeline.PipelineCore` (a property has to
live on a class in the pipeline's MRO); it comes before torchrec's classes
there, so its properties are what torchrec's code and a subclass's read.

The end of the data reads as torchrec's reads at the same point of the step:
True from the step whose copy stage asks for a batch and finds none, even
though, with the ranks agreeing on each pull, our source learned of the end a
step earlier (see :attr:`BatchSource.ended`).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from trec_pipelines.core.streams import StreamSet
from trec_pipelines.data.source import BatchSource


class TorchrecState:
    """torchrec's attributes that outside code reads and writes, each onto the part of
    ours that owns it (see ``[Note: torchrec's state on our pipelines]``)."""

    _source: BatchSource
    _streams: StreamSet

    @property
    def _dataloader_iter(self) -> Optional[Iterator[Any]]:
        """The iterator this epoch pulls from (None before the first pull).

        Inside a ``_next_batch`` override it reads as torchrec's does there: the
        iterator last written to it (by ``super()._next_batch`` or by the override
        itself), None in the first pull, so an override can tell a new iterator.
        Writable, as in torchrec: the pulls that follow come from the iterator
        assigned, and the batches in flight still train.
        """
        source = self._source
        # Inside a pull, what was last written to it, as torchrec's reads in _next_batch.
        return source.written_iterator if source.pulling else source.iterator

    @_dataloader_iter.setter
    def _dataloader_iter(self, iterator: Optional[Iterator[Any]]) -> None:
        self._source.assign_iterator(iterator)

    @property
    def _dataloader_exhausted(self) -> bool:
        """Whether this epoch's data has ended, read as torchrec's at the same point.

        Writable, as in torchrec: inside a ``_next_batch`` override the override
        reads back what it wrote, and returning None ends the epoch (seen by the
        rest of the pipeline when the copy stage reaches that pull); set to True
        between steps, on every rank, it ends the epoch there: the batches in
        flight still train and nothing more is pulled (a batch pulled ahead and
        not yet copied is dropped, and counted in ``unused_batches``).
        """
        return self._source.ended

    @_dataloader_exhausted.setter
    def _dataloader_exhausted(self, ended: bool) -> None:
        self._source.set_ended(ended)

    @property
    def _data_iter_stopped(self) -> bool:
        """TrainPipelineBase's name for ``_dataloader_exhausted``."""
        return self._source.ended

    @_data_iter_stopped.setter
    def _data_iter_stopped(self, ended: bool) -> None:
        self._source.set_ended(ended)

    @property
    def _memcpy_stream(self) -> Optional[torch.Stream]:
        """The side stream of the host-to-device copies (None on CPU, as torchrec's)."""
        return self._streams.memcpy

    @property
    def _data_dist_stream(self) -> Optional[torch.Stream]:
        """The side stream of the input dist (None on CPU and where it runs on the
        default stream, as torchrec's)."""
        return self._streams.data_dist
