"""The batch source: pulls host batches from the user's iterator, one epoch at a time.

It owns the epoch bookkeeping of the data iterator (see :class:`BatchSource`),
the ranks' agreement on each pull and the host copies a failed step is retried
from; the epochs set aside when another iterator is passed are
:class:`~trec_pipelines.data.parked.ParkedEpochs`.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Iterator, List, Optional, Tuple

import torch.distributed as dist

from trec_pipelines.core.checks import check_iterator
from trec_pipelines.core.errors import MalformedBatchError
from trec_pipelines.core.streams import PIPELINEABLE, not_pipelineable
from trec_pipelines.data import pull_failure
from trec_pipelines.data.agreement import Agreement, AgreementChannel
from trec_pipelines.data.end_of_data import EndOfData
from trec_pipelines.data.padding import Padding, nothing_to_pad_with, uneven_stop
from trec_pipelines.data.validation import batch_problem

logger: logging.Logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    """A pulled batch (None: this rank's data ended) while the ranks agree on it."""

    batch: Optional[Any]
    problem: Optional[str]  # why it is malformed here, if it is
    agreement: Optional[Agreement]  # None: no other rank agrees on it
    error: Optional[Exception] = None  # what next() raised here, if it did


class BatchSource:
    """Pulls batches from the user's iterator, one epoch at a time.

    * ``next()`` is never called again on an iterator once it has raised
      ``StopIteration``, in this epoch or later ones, unless it shows it was
      refilled (see :meth:`_is_spent`): a torch ``DataLoader`` iterator reused
      with ``persistent_workers=True`` works across epochs with no ``reset()``.
    * An epoch ends when the pipeline says so (:meth:`end_epoch`, once the last
      batch has been trained); the next pull starts a new epoch on whatever
      iterator is passed, including the same iterator object refilled (a
      ``DataLoader`` with ``persistent_workers=True``).  A new iterator object
      also starts a new epoch.
    * :meth:`fetch_ahead` pulls, at the top of ``progress()``, every host batch
      the call will need, before any work is issued: an exception raised by
      the iterator then reaches the caller with the pipeline untouched, and the
      next call carries on.  :meth:`next` hands the held batches out in order.
    * With an ``agreement`` channel every pull is agreed across ranks (see
      ``[Note: agreeing on each batch]`` in :mod:`trec_pipelines.data.agreement`):
      a batch malformed on any rank is dropped on every rank, each raising
      ``MalformedBatchError``; once any rank's iterator ends, every rank treats
      its own as ended at the same step, so no rank waits in a collective for
      a batch the others will never send.  Batches a rank pulled but could not
      use are counted in :attr:`unused`.  With ``pad_uneven`` the epoch ends
      only once every rank's data ended; until then a rank whose data ended
      gets :class:`~trec_pipelines.data.padding.Padding` batches (see
      ``[Note: padding uneven eval data]`` in :mod:`trec_pipelines.data.padding`).
    * With ``keep_in_flight`` every batch handed out stays listed, host copy
      and index, until the pipeline marks it trained (:meth:`retire`) or drops it.
      :meth:`rewind` gives the listed batches back, in order and with their
      indices, ahead of everything else: a failed step is retried from the
      host copies (see :mod:`trec_pipelines.core.step_guard`).
    """

    def __init__(
        self,
        agreement: Optional[AgreementChannel] = None,
        keep_in_flight: bool = False,
        validate: bool = False,
        pipelineable: bool = True,
        puller: Optional[Callable[[Iterator[Any]], Optional[Any]]] = None,
        agree_ahead: bool = True,
        pad_uneven: bool = False,
    ) -> None:
        # Start the next pull's agreement a call early, holding one more host batch
        # (see [Note: agreeing on each batch]); False agrees on each pull as it is
        # made, with a blocking round trip (the ``agree_ahead`` option).
        self.agree_ahead = agree_ahead
        self.iterator: Optional[Iterator[Any]] = None  # the one the current epoch pulls from
        self.agreement = agreement
        # Pad until every rank's data ended (see [Note: padding uneven eval data]).
        self.pad_uneven = pad_uneven
        self._last_real: Optional[Any] = None  # this epoch's last accepted batch: what pads
        self._pulls = 0  # pulls agreed on so far: each one's number, the same on every rank
        self._held: Deque[Any] = deque()
        # Where this source stands with the end of the data: one record, replaced
        # whole by its named transitions (see [Note: the end of the data]).
        self.end = EndOfData()
        self.loaded = 0  # batches handed out so far, over all epochs: the next new one's index
        self.last_index = -1  # the index of the batch :meth:`next` returned last
        self._keep_in_flight = keep_in_flight
        # (index, host batch) handed out and not trained yet, oldest first.
        self._in_flight: Deque[Tuple[int, Any]] = deque()
        # (index, host batch) given back by rewind(), served before anything else.
        self._rewound: Deque[Tuple[int, Any]] = deque()
        self.unused = 0  # batches pulled but dropped because another rank ran out
        self._validate = validate
        # Refuse a batch that is neither a Tensor nor Pipelineable (False: any
        # object, for a pipeline whose own stages take the batch).
        self._pipelineable = pipelineable
        # How a batch is pulled from the iterator (a pipeline's ``_next_batch``,
        # which a subclass may override): None pulls with :meth:`raw_next`.
        self._puller = puller
        self.rejected = 0  # batches dropped as malformed (here, or on another rank: ``agreement``)
        # Pulls whose agreement is under way (``agreement``), oldest first: after _held.
        self._pending: Deque[_Pending] = deque()
        # The iterator that last raised StopIteration, and its yield count then.
        self._spent: Optional[Tuple[Iterator[Any], Optional[int]]] = None
        self._pulling = False  # inside the puller (a pipeline's _next_batch)
        # A pull whose next() raised on some rank, pulled again by the next launch
        # (see [Note: a loader error on one rank]).
        self._retry: Optional[pull_failure.Retry] = None
        self._epoch_pulled = 0  # batches pulled from the iterator this epoch
        # The iterator last written to torchrec's ``_dataloader_iter`` (by torchrec's
        # own _next_batch as it pulls, or by the user): what a pull reads on entry.
        self._written_iterator: Optional[Iterator[Any]] = None

    def _switch_to(self, iterator: Iterator[Any]) -> None:
        if iterator is self.iterator:
            return
        check_iterator(iterator)
        if self.iterator is None:
            # The first iterator: batches given back by resume() are its own.
            self.iterator = iterator
            self.end = self.end.new_iterator()
            return
        self.settle()  # the previous iterator's pulls under way join its held batches
        if self._rewound:
            logger.warning(
                "%d batch(es) of a failed step were dropped: a new iterator was passed "
                "before they were retried",
                len(self._rewound),
            )
            self._rewound.clear()
        if self._held:
            logger.warning(
                "%d batch(es) fetched from the previous iterator were dropped: a new "
                "iterator was passed mid-epoch",
                len(self._held),
            )
            self._held.clear()
        self.iterator = iterator
        self._last_real = None
        self._epoch_pulled = 0
        if self._retry is not None:
            self._retry.batch = None  # the previous iterator's: the retry pulls from the new one
        self.end = self.end.new_iterator()

    def next(self, iterator: Iterator[Any]) -> Optional[Any]:
        """The next batch, or None at the end of the epoch."""
        if iterator is not self.iterator:
            self._switch_to(iterator)
        if self._rewound:
            index, batch = self._rewound.popleft()
        else:
            batch = self._held.popleft() if self._held else self._pull(iterator)
            if batch is None:
                self.end = self.end.seen()  # as torchrec's flag: a copy stage found no batch
                return None
            if isinstance(batch, Padding):
                return batch  # not counted nor kept in flight: its output is thrown away
            index = self.loaded
            self.loaded += 1
        self.last_index = index
        if self._keep_in_flight:
            self._in_flight.append((index, batch))
        return batch

    def fetch_ahead(self, iterator: Iterator[Any], count: int = 1) -> None:
        """Hold ``count`` batches (fewer at the end of data) for :meth:`next`.

        With ``agreement``, one more pull is then started, its agreement left
        under way for the next call (see ``[Note: agreeing on each batch]``).
        """
        if iterator is not self.iterator:
            self._switch_to(iterator)
        while len(self._held) + len(self._rewound) < count and not self.end.exhausted:
            batch = self._pull(iterator)
            if batch is not None:
                self._held.append(batch)
        ahead = self.agree_ahead and self.agreement is not None
        if ahead and not self.end.exhausted and not self._pending:
            self._launch(iterator)

    def _pull(self, iterator: Iterator[Any]) -> Optional[Any]:
        """The next batch, agreed with the other ranks when there is an ``agreement``."""
        if self.end.exhausted:
            return None
        if self.end.epoch_over:  # the first pull of a new epoch
            self.end = self.end.new_epoch()
            self._epoch_pulled = 0
        if self.agreement is None:
            batch = self.raw_next(iterator) if self._puller is None else self._puller_next(iterator)
            problem = batch_problem(batch) if self._validate and batch is not None else None
            return self._resolve(_Pending(batch, problem, None))
        if not self._pending:
            self._launch(iterator)
        return self._resolve(self._pending.popleft())

    def _puller_next(self, iterator: Iterator[Any]) -> Optional[Any]:
        """The next batch through the pipeline's puller (None: the end of the data)."""
        assert self._puller is not None
        self._pulling = True
        try:
            batch = self._puller(iterator)
        finally:
            self._pulling = False
        if batch is None and not self._is_spent(iterator):
            # The puller says the data ended: don't pull again this epoch.
            self._spent = (iterator, getattr(iterator, "_num_yielded", None))
        return batch

    @property
    def pulling(self) -> bool:
        """Whether this source is pulling through its puller right now."""
        return self._pulling

    def direct_next(self, iterator: Iterator[Any]) -> Optional[Any]:
        """A pull made by a subclass's own step through torchrec's ``_next_batch``:
        torchrec's end-of-data flag (:attr:`ended`) follows it at once."""
        self.assign_iterator(iterator)  # a new iterator clears the end of the data
        if self.end.ended:
            return None
        batch = self.raw_next(iterator)
        if batch is None:
            self.set_ended(True)
        return batch

    def hook_next(self, iterator: Iterator[Any]) -> Optional[Any]:
        """A pull by our ``_next_batch`` inside the puller: as torchrec's, it records
        the iterator in ``_dataloader_iter``, then calls :meth:`raw_next`."""
        self._written_iterator = iterator
        return self.raw_next(iterator)

    def raw_next(self, iterator: Iterator[Any]) -> Optional[Any]:
        """``next(iterator)``, or None once it has ended (and was not refilled)."""
        if self._spent is not None and self._is_spent(iterator):
            return None  # it ended before and was not refilled: don't call next()
        try:
            return next(iterator)
        except StopIteration:
            self._spent = (iterator, getattr(iterator, "_num_yielded", None))
            return None

    def _launch(self, iterator: Iterator[Any]) -> None:
        """Pull and check one batch, and start agreeing on it with the other ranks.
        A ``next()`` that raises is agreed on too (see ``[Note: a loader error on
        one rank]`` in :mod:`trec_pipelines.data.pull_failure`)."""
        batch, error = None, None
        if self._retry is not None:  # a pull that failed on some rank: every rank retries it
            self._retry.meet()
            batch, self._retry = self._retry.batch, None
        if batch is None:
            try:
                if self._puller is None:
                    batch = self.raw_next(iterator)
                else:
                    batch = self._puller_next(iterator)
            except StopIteration:
                raise  # a puller's own way to end the data, as before
            except Exception as raised:  # noqa: BLE001  reported with the pull, raised once agreed
                error = raised
        problem = batch_problem(batch) if self._validate and batch is not None else None
        assert self.agreement is not None  # launched only with a channel
        if error is not None:
            pull_failure.publish(error)  # before the code: a peer reads it once agreed
        ended = batch is None and error is None
        agreement = self.agreement.start(self._pulls, ended, problem is not None, error is not None)
        self._pulls += 1
        self._pending.append(_Pending(batch, problem, agreement, error))

    def _resolve(self, pending: _Pending) -> Optional[Any]:
        """A pull, agreed (``pending.agreement`` None: this rank's alone): its batch,
        or None at the end.

        Every rank decides alike: malformed if any rank's batch is (so all drop it
        in step), else ended if any rank's data ended (``pad_uneven``: padded until
        every rank's ended)."""
        batch, problem, malformed_on = pending.batch, pending.problem, None
        if pending.agreement is not None:
            agreed = pending.agreement.result()
            if agreed.failed_on:  # some rank's next() raised: every rank raises here
                self._pulls -= 1  # the retry agrees on this pull again, under its number
                index = self.loaded + len(self._held)
                raised, self._retry = pull_failure.agreed_failure(
                    pending.error, batch, agreed.failed_on, index
                )
                raise raised
            if batch is not None:
                self._epoch_pulled += 1
            if agreed.malformed_on:
                here = (
                    "this rank's data has ended" if batch is None else "this rank's batch is fine"
                )
                problem = problem or f"{here}; the error raised there says what is wrong"
                malformed_on = agreed.malformed_on
            elif agreed.ended and self.pad_uneven and not agreed.all_ended:
                batch = self._padded(batch)
            elif batch is not None and agreed.ended:
                self.unused += 1
                logger.warning("%s", uneven_stop(self._epoch_pulled, 1, self.iterator))
                batch = None
        if problem is not None:
            self.rejected += 1
            raise MalformedBatchError.dropped(self.loaded + len(self._held), problem, malformed_on)
        if batch is None:
            self.end = self.end.found()
            self._drop_pending()
            return None
        if isinstance(batch, Padding):
            return batch
        if self._pipelineable and not isinstance(batch, PIPELINEABLE):
            raise not_pipelineable(batch)
        self._last_real = batch
        return batch

    def _drop_pending(self) -> None:
        """Pulls started after the one where the data ended: agreed, and not used."""
        while self._pending:
            pending = self._pending.popleft()
            assert pending.agreement is not None  # only pulls under agreement wait here
            pending.agreement.result()
            if pending.batch is not None:
                self.unused += 1
            if pending.error is not None:  # past the agreed end: nothing to retry
                logger.warning(
                    "the data iterator raised past the end of the epoch (another rank's "
                    "data ended first); not raised, as no batch is missing: %s",
                    pull_failure.first_line(pending.error),
                )

    def settle(self) -> None:
        """Finish agreeing on the pulls under way, holding their batches (a checkpoint,
        parking an epoch).  A batch found malformed is dropped and logged."""
        while self._pending and not self.end.exhausted:
            try:
                batch = self._resolve(self._pending.popleft())
            except MalformedBatchError as error:
                logger.warning("%s", error)
                continue
            if batch is not None:
                self._held.append(batch)

    def _is_spent(self, iterator: Iterator[Any]) -> bool:
        """True for the iterator that already raised StopIteration, unless it shows
        it was refilled since: a torch ``DataLoader`` iterator (``persistent_workers``)
        restarts its ``_num_yielded`` count when ``iter(loader)`` resets it."""
        if self._spent is None or self._spent[0] is not iterator:
            return False
        ended_at = self._spent[1]
        now = getattr(iterator, "_num_yielded", None)
        if ended_at is not None and now is not None and now < ended_at:
            self._spent = None  # refilled
            return False
        return True

    def _padded(self, batch: Optional[Any]) -> Any:
        """Some rank's data ended, not every rank's (``pad_uneven``): a batch here is
        kept, and a rank without one pads with its last; with no batch accepted this
        epoch (true on every rank alike at that pull), every rank raises."""
        if self._last_real is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise nothing_to_pad_with(rank, batch is None)
        return batch if batch is not None else Padding(self._last_real)

    def end_epoch(self) -> None:
        """The pipeline ended the epoch: the next pull starts a new one."""
        self.end = self.end.epoch_ended()
        self._last_real = None

    def stop_pulling(self) -> None:
        """Pull nothing more this epoch (an eval loader's error: the batches
        already pulled still run)."""
        self.end = self.end.found()

    # ------------------------------------------- torchrec's view of the data's end

    @property
    def ended(self) -> bool:
        """Whether the epoch's data has ended, as torchrec's ``_dataloader_exhausted``
        reads at the same point: True from the step whose copy stage asks for a
        batch and finds none (not from the earlier pull that found the end, with
        the ranks agreeing a step ahead), or once the user set it between steps;
        False again from the next epoch's first pull.  Inside a pull (a
        ``_next_batch`` override) it reads what the override last wrote.
        """
        return self.end.ended or (self._pulling and self.end.puller_said_ended)

    def set_ended(self, ended: bool) -> None:
        """A write of torchrec's ``_dataloader_exhausted``.

        Inside a pull (a ``_next_batch`` override) it is only recorded for the
        override to read back: the override's return value says whether a batch
        came, and a None ends the epoch when the copy stage reaches it.  Between
        steps, True ends the epoch here: nothing more is pulled, batches already
        pulled ahead and not yet copied are dropped (counted in :attr:`unused`),
        and the batches in flight still train; False lets pulls resume from the
        iterator.
        """
        if self._pulling:
            self.end = self.end.said_by_puller(ended)
            return
        stopping = ended and not self.end.exhausted
        self.end = self.end.written(ended)
        if stopping:
            self.settle()
            self.unused += len(self._held)
            self._held.clear()
            self.end = self.end.found()

    @property
    def written_iterator(self) -> Optional[Iterator[Any]]:
        """torchrec's ``_dataloader_iter`` as a pull reads it on entry: the iterator
        last written to it (by torchrec's own ``_next_batch`` as it pulls, or by the
        user), None before the first; between pulls, :attr:`iterator` is read."""
        return self._written_iterator

    def assign_iterator(self, iterator: Optional[Iterator[Any]]) -> None:
        """A write of torchrec's ``_dataloader_iter``: the next pulls come from
        ``iterator``; the batches in flight still train (nothing is parked)."""
        self._written_iterator = iterator
        if iterator is self.iterator:
            return
        if iterator is None or self._pulling:
            self.iterator = iterator
            self.end = self.end.new_iterator()
            return
        self._switch_to(iterator)

    def restart_count(self) -> None:
        """Number the next batch 0 again (a pipeline's ``reset()``, as torchrec's).

        Call with nothing in flight: the indices are what ``sync_embeddings``
        and the records key on.
        """
        assert not self._in_flight and not self._rewound, "restart_count() with batches in flight"
        self.loaded = 0
        self.last_index = -1

    # ----------------------------------------------------- failed-step retry

    def retire(self) -> None:
        """The oldest in-flight batch was trained: forget its host copy."""
        if self._in_flight:
            self._in_flight.popleft()

    def drop_in_flight(self) -> None:
        """The in-flight batches were dropped untrained (``reset()``, end of data)."""
        self._in_flight.clear()
        self._rewound.clear()

    def rewind(self) -> Optional[int]:
        """Give every in-flight batch back, in order, ahead of the held ones.

        Returns the index of the oldest (the one the failed step was
        training), or None when nothing was in flight.
        """
        first = self._in_flight[0][0] if self._in_flight else None
        self._rewound.extendleft(reversed(self._in_flight))
        self._in_flight.clear()
        return first

    def skip_rewound(self) -> Optional[int]:
        """Drop the first batch given back by :meth:`rewind`; its index, or None."""
        if not self._rewound:
            return None
        return self._rewound.popleft()[0]

    @property
    def rewound(self) -> int:
        """Batches given back by :meth:`rewind` and not handed out again yet."""
        return len(self._rewound)

    @property
    def in_flight(self) -> int:
        """Batches handed out and neither trained nor dropped (``keep_in_flight``)."""
        return len(self._in_flight)

    def host_batches(self) -> List[Any]:
        """Every batch this source holds that is not copied to the device yet:
        fetched ahead, under agreement, or given back by :meth:`rewind`; what the
        memory ledger counts as host batches (see ``[Note: memory places]`` in
        :mod:`trec_pipelines.observe.memory`).  The host copies of the in-flight
        batches (``keep_in_flight``) were copied already: not listed."""
        batches = list(self._held) + [p.batch for p in self._pending if p.batch is not None]
        return batches + [b for _, b in self._rewound]

    @property
    def holding(self) -> int:
        """Batches fetched ahead (or given back by :meth:`rewind`) and not handed out yet."""
        return len(self._held) + len(self._rewound)

    # ------------------------------------------------------ checkpoint / resume

    def unfinished(self) -> Tuple[List[Tuple[int, Any]], int]:
        """Every batch pulled and not trained, ``(index, host batch)`` oldest first,
        and the index the next batch pulled from the iterator will take.

        Needs ``keep_in_flight``: the batches handed out are only listed then.
        """
        assert self._keep_in_flight, "unfinished() needs keep_in_flight=True"
        self.settle()
        batches = list(self._in_flight) + list(self._rewound)
        batches += [(self.loaded + k, batch) for k, batch in enumerate(self._held)]
        return batches, self.loaded + len(self._held)

    def ahead(self) -> List[Any]:
        """The batches pulled and held for :meth:`next`, oldest first (their
        agreements finished first): what a checkpoint keeps of the source
        when the pipeline lists its in-flight batches itself."""
        self.settle()
        return list(self._held)

    def is_fresh(self) -> bool:
        """Nothing pulled and nothing held: a new source, or one after ``restart_count()``."""
        return (
            self.loaded == 0
            and not self._in_flight
            and not self._rewound
            and not self._held
            and not self._pending
        )

    def resume(self, batches: List[Tuple[int, Any]], next_index: int) -> None:
        """Serve ``batches`` (``(index, host batch)``, from :meth:`unfinished`) first,
        as a failed step's are, then number new batches from ``next_index``."""
        assert self.is_fresh(), "resume() on a source that has pulled batches"
        self._rewound = deque(batches)
        self.loaded = next_index
        self.iterator = None  # the next iterator passed continues these batches

    def save(self) -> "SourceState":
        """Set this iterator's epoch aside (see :meth:`restore`); start afresh."""
        self.settle()
        state = SourceState(
            self.iterator,
            self._held,
            self.end,
            self._in_flight,
            self._rewound,
            self._last_real,
            self._epoch_pulled,
        )
        self.iterator, self._held, self.end = None, deque(), self.end.set_aside()
        self._in_flight, self._rewound = deque(), deque()
        self._last_real, self._epoch_pulled = None, 0
        return state

    def restore(self, state: "SourceState") -> None:
        """Continue an epoch set aside by :meth:`save`."""
        self.iterator, self._held = state.iterator, state.held
        self.end = state.end  # its own marks, whole: none of the iterator run meanwhile
        self._in_flight, self._rewound = state.in_flight, state.rewound
        # Its own last batch pads it, not the other iterator's (see [Note: padding uneven eval data]).
        self._last_real, self._epoch_pulled = state.last_real, state.pulled


@dataclass
class SourceState:
    """An iterator's epoch set aside: its fetched-ahead batches, its end-of-data
    record (every mark, see ``[Note: the end of the data]``),
    (``keep_in_flight``) the host copies of its in-flight and rewound batches, its
    last accepted batch (what pads it) and how many batches it pulled."""

    iterator: Optional[Iterator[Any]]
    held: Deque[Any]
    end: EndOfData
    in_flight: Deque[Tuple[int, Any]] = field(default_factory=deque)
    rewound: Deque[Tuple[int, Any]] = field(default_factory=deque)
    last_real: Optional[Any] = None
    pulled: int = 0

    def host_batches(self) -> List[Any]:
        """The host batches set aside (see :meth:`BatchSource.host_batches`)."""
        return list(self.held) + [b for _, b in self.rewound]
