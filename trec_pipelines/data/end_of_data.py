"""Where the batch source stands with the end of the data, in one frozen record.

[Note: the end of the data]
The :class:`~trec_pipelines.data.source.BatchSource` holds one
:class:`EndOfData` (its ``end``) and replaces it whole, through the named
transitions below; nothing else writes it.  Its marks, each with what sets it
and what clears it:

* none set: not ended (a new source).
* ``exhausted``: ended by the data, as this source sees it: nothing more is
  pulled this epoch.  Set by the pull that found the end (on any rank, with
  the ranks agreeing), by True written between steps, by an eval loader's
  error; cleared when the pipeline ends the epoch, by False written between
  steps, by a new iterator.
* ``ended``: torchrec's ``_dataloader_exhausted`` as read between steps.  Set
  when the copy stage asks for a batch and gets none, or by True written
  between steps; cleared by the next epoch's first pull, by False written
  between steps, by a new iterator.
* ``puller_said_ended``: ended as said by the puller: what a ``_next_batch``
  override last wrote inside a pull, read back inside pulls only (the pipeline
  sees the end when the copy stage reaches the pull that returned None).
  Cleared by False written inside a pull, the next epoch's first pull, a new
  iterator.
* ``stopped_from_outside``: True was written to ``_dataloader_exhausted``
  between steps this epoch (TrainPipelineBase then drops the batch it copied,
  as torchrec's does).
  Cleared by the next epoch's first pull, by False written between steps, by
  a new iterator.
* ``epoch_over``: the pipeline ended the epoch; the next pull starts a new
  one, and clears it.

The usual course of an epoch: not ended, then ``exhausted`` (a pull found the
end; with the ranks agreeing a step ahead, torchrec's flag does not read it
yet), then ``exhausted`` and ``ended`` (the copy stage found no batch), then
``ended`` and ``epoch_over``, then not ended again at the next epoch's first
pull.  A batch source that sets an epoch aside (a parked iterator) keeps the
whole record with it and, when that iterator comes back, takes it back whole:
no mark of the iterator that ran in between reaches the epoch brought back (a
True written between steps while another iterator ran does not drop its copied
batch), and none of its own is lost on the way (:meth:`set_aside`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class EndOfData:
    """The batch source's end-of-data marks (see ``[Note: the end of the data]``)."""

    exhausted: bool = False  # nothing more is pulled this epoch
    ended: bool = False  # torchrec's _dataloader_exhausted between steps
    puller_said_ended: bool = False  # what a _next_batch override wrote inside a pull
    stopped_from_outside: bool = False  # True written between steps, this epoch
    epoch_over: bool = False  # the next pull starts a new epoch

    def new_iterator(self) -> EndOfData:
        """Another iterator: its data has not ended (an epoch the pipeline ended
        stays over: the next pull starts the new one)."""
        return EndOfData(epoch_over=self.epoch_over)

    def new_epoch(self) -> EndOfData:
        """The next epoch's first pull."""
        return replace(
            self, ended=False, puller_said_ended=False, stopped_from_outside=False, epoch_over=False
        )

    def found(self) -> EndOfData:
        """A pull found the end (or the loader failed): nothing more is pulled."""
        return replace(self, exhausted=True)

    def seen(self) -> EndOfData:
        """The copy stage asked for a batch and got none: torchrec's flag reads it."""
        return replace(self, ended=True)

    def said_by_puller(self, ended: bool) -> EndOfData:
        """A ``_next_batch`` override wrote ``_dataloader_exhausted`` inside a pull."""
        return replace(self, puller_said_ended=ended)

    def written(self, ended: bool) -> EndOfData:
        """``_dataloader_exhausted`` written between steps: True stops the epoch
        here (the source drops what it pulled ahead, then :meth:`found`), False
        lets the pulls resume."""
        return replace(
            self, exhausted=self.exhausted and ended, ended=ended, stopped_from_outside=ended
        )

    def epoch_ended(self) -> EndOfData:
        """The pipeline ended the epoch: the next pull starts a new one."""
        return replace(self, exhausted=False, epoch_over=True)

    def set_aside(self) -> EndOfData:
        """The epoch's iterator was set aside (parked), this record with it: the
        source starts afresh, as for a new iterator."""
        return self.new_iterator()
