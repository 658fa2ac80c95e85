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

The end of the data reads as torchrec's reads at the same point of the step:
True from the step whose copy stage asks for a batch and finds none, even
though, with the ranks agreeing on each pull, our source learned of the end a
step earlier (see :attr:`BatchSource.ended`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Iterator, Optional

import torch
from torchrec.distributed.train_pipeline.types import PipelineState

from trec_pipelines.core.streams import StreamSet
from trec_pipelines.data.source import BatchSource


class TorchrecState:
    """torchrec's attributes, as properties onto the components that own them."""

    _source: BatchSource
    _streams: StreamSet
    # Where a step is (torchrec's ``_state``, written by torchrec's base class at
    # construction; outside code writes it too).  Holds torchrec's enum.
    _state: PipelineState
    # Whether each step moves ``_state`` through IDLE, CALL_FWD and CALL_BWD, as
    # the torchrec class of the same name does (the others stay IDLE).
    _tracks_state: ClassVar[bool] = False

    def _enter_phase(self, phase: PipelineState) -> None:
        """Set ``_state`` to ``phase`` where torchrec's class does (``_tracks_state``)."""
        if self._tracks_state:
            self._state = phase

    @property
    def _dataloader_iter(self) -> Optional[Iterator[Any]]:
        """The iterator this epoch pulls from (None before the first pull).

        Writable, as in torchrec: the pulls that follow come from the iterator
        assigned, and the batches in flight still train.
        """
        return self._source.iterator

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
    def _dataloader_exhausted(self, exhausted: bool) -> None:
        self._source.set_ended(exhausted)

    @property
    def _data_iter_stopped(self) -> bool:
        """TrainPipelineBase's name for :attr:`_dataloader_exhausted`."""
        return self._source.ended

    @_data_iter_stopped.setter
    def _data_iter_stopped(self, stopped: bool) -> None:
        self._source.set_ended(stopped)

    @property
    def _memcpy_stream(self) -> Optional[torch.Stream]:
        """The side stream of the host-to-device copies (None on CPU, as torchrec's)."""
        return self._streams.memcpy

    @property
    def _data_dist_stream(self) -> Optional[torch.Stream]:
        """The side stream of the input dist (None on CPU and where it runs on the
        default stream, as torchrec's)."""
        return self._streams.data_dist
