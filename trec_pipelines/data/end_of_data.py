"""Where the batch source stands with the end of the data, in one frozen record.

[Note: the end of the data]
The :class:`~trec_pipelines.data.source.BatchSource` holds one
:class:`EndOfData` (its ``end``) and replaces it whole, through the named
transitions below; nothing else writes it.  What each mark means, and what
sets and clears it:

====================  =====================================  ======================================
mark                  set by                                 cleared by
====================  =====================================  ======================================
(none)                not ended: a new source                --
``exhausted``         ended by the data: the pull that       the epoch's end (:meth:`epoch_ended`),
                      found the end (every rank's, with the  False written between steps, a new
                      ranks agreeing), True written between  iterator
                      steps, an eval loader's error: nothing
                      more is pulled this epoch
``ended``             torchrec's ``_dataloader_exhausted``   the next epoch's first pull
                      between steps: the copy stage asked   (:meth:`new_epoch`), False written
                      for a batch and got none, or True was  between steps, a new iterator
                      written between steps
``puller_said_ended`` ended as said by the puller: what a    the next epoch's first pull, a new
                      ``_next_batch`` override wrote inside  iterator (False written inside a pull)
                      a pull; read back inside pulls only
``stopped_from_       stopped from outside: True written to  the next epoch's first pull, False
outside``             ``_dataloader_exhausted`` between      written between steps, a new iterator
                      steps (the copied batch is not
                      trained, as torchrec's)
``epoch_over``        epoch over: the pipeline ended the     the next epoch's first pull
                      epoch; the next pull starts a new one
====================  =====================================  ======================================

The usual course of an epoch: not ended, then ``exhausted`` (a pull found the
end; with the ranks agreeing a step ahead, torchrec's flag does not read it
yet), then ``exhausted`` and ``ended`` (the copy stage found no batch), then
``ended`` and ``epoch_over``, then not ended again at the next epoch's first
pull.  A batch source that sets an epoch aside (a parked iterator) keeps only
``exhausted`` and ``ended`` with it (:meth:`set_aside`, :meth:`brought_back`).
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
        """The epoch's iterator was set aside (parked): the source starts afresh."""
        return replace(self, exhausted=False, ended=False)

    def brought_back(self, exhausted: bool, ended: bool) -> EndOfData:
        """An epoch set aside comes back with its own ``exhausted`` and ``ended``."""
        return replace(self, exhausted=exhausted, ended=ended)
