"""StagedTrainPipeline: a declared list of pre-forward stages, one batch per stage."""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from typing import (
    Any,
    Callable,
    Deque,
    Iterator,
    List,
    Optional,
    Tuple,
)

import torch
from torchrec.distributed.train_pipeline import In, TrainPipeline
from typing_extensions import Unpack

from trec_pipelines.assembly.options import BatchOptions, takes_options
from trec_pipelines.assembly.pipeline import PipelineCore
from trec_pipelines.assembly.resume import ResumeHooks
from trec_pipelines.core.errors import MalformedBatchError
from trec_pipelines.core.streams import (
    current_stream,
    on_stream,
    record_event,
)
from trec_pipelines.core.subclass_hooks import Refused
from trec_pipelines.data.source import BatchSource
from trec_pipelines.observe import recorder as rec
from trec_pipelines.pipelines.stages import (
    InFlight,
    PipelineStage,
    SkipAware,
    StageFailure,
    StageOut,
    agreement_carriers,
    declare_stages,
    side_stream,
    skip_aware_owners,
)

logger: logging.Logger = logging.getLogger(__name__)


# One unit of a fill or a step: (stage index, slot, is the stage's fill_callback).
_Work = Tuple[int, int, bool]


class _StagedResume(ResumeHooks):
    """The state is the host copies of the batches in the stages (and of the one a
    failed step was about to return), not their stage outputs: a resumed
    pipeline runs every stage on them again, as a fresh fill would."""

    pipeline: StagedTrainPipeline[Any, Any]

    def unfinished(self) -> Tuple[List[Tuple[int, Any]], int]:
        p = self.pipeline
        items = [p._ready] + p._slots
        held = sorted((item.index, item.host) for item in items if item is not None)
        held += list(p._resumed)
        ahead = p._source.ahead()
        held += [(p._loaded + k, batch) for k, batch in enumerate(ahead)]
        return held, p._loaded + len(ahead)

    def is_fresh(self) -> bool:
        p = self.pipeline
        return (
            p._loaded == 0
            and p._ready is None
            and all(slot is None for slot in p._slots)
            and not p._resumed
            and p._source.is_fresh()
        )

    def resume(self, batches: List[Tuple[int, Any]], next_index: int) -> None:
        p = self.pipeline
        p._resumed = deque(batches)
        p._loaded = next_index
        p._source.resume([], next_index)


@takes_options(BatchOptions)
class StagedTrainPipeline(PipelineCore, TrainPipeline[In, Optional[StageOut]]):
    """N batches in flight, one per stage; the caller trains the batch it returns.

    With stages ``s0 .. s(N-1)``, one ``progress()`` call issues, in order:

    ==========  ===========  ==================================================
    stream      slot         work
    ==========  ===========  ==================================================
    s0's        ``i+N``      load from the iterator, run s0
    s1's        ``i+N-1``    wait for s0's event, run s1
    ...         ...          ...
    s(N-1)'s    ``i+1``      wait for s(N-2)'s event, run s(N-1)
    compute     ``i``        wait for s(N-1)'s event; returned to the caller
    ==========  ===========  ==================================================

    The newest batch goes first, so a stage's work for batch ``i+k`` overlaps
    the caller's forward/backward/step of batch ``i``; a stage waits by event only
    for the one earlier stage of that batch.  Filling an empty pipeline loads N
    batches (all N stages for batch 0, ..., stage 0 only for batch N-1).

    ``progress()`` returns ``None`` once every batch has come out; called again,
    it starts a new epoch, on a new iterator or the same one refilled.
    :meth:`set_flush` ``(True)`` stops loading; when the in-flight batches have
    all come out, ``on_flush_end`` is called and the pipeline fills again from
    the same iterator, in the same ``progress()`` call.  A stage's stream may be
    ``None`` (CPU), and a stage may run on the current stream.  Use
    :class:`~trec_pipelines.pipelines.sparse_data_dist_util.SparseDataDistUtil`
    to put the sparse ``input_dist`` among the stages; it must come last.  A
    stage, fill callback or iterator that raises inside ``progress()`` is resumed
    at that unit of work by the next call (a stage is re-run from its start), and
    :meth:`skip_failed_batch` drops a batch a stage fails on every time (a stage's
    owner that keeps state per batch learns of it through :class:`SkipAware`).
    When your own step raises, train the batch again or call ``progress()`` again
    to move on, alike on every rank.  Our ``validate_batches`` and
    ``sync_exhaustion`` apply before stage 0 (:doc:`/guides/what-happens-when`).

    Differences from torchrec: :ref:`the migration guide <migrating-staged>` (docs/guides/migrating.md).

    Example::

        pipeline = StagedTrainPipeline([
            PipelineStage("h2d", lambda b: b.to(device, non_blocking=True), torch.cuda.Stream()),
            PipelineStage("postproc", gpu_postproc, torch.cuda.Stream()),
        ])
        while (batch := pipeline.progress(it)) is not None:
            optimizer.zero_grad()
            loss, pred = model(batch)
            loss.backward()
            optimizer.step()

    Args:
        pipeline_stages: The ``PipelineStage`` list, in order: each batch goes through every stage
            before ``progress()`` returns it.
        debug_mode: Log each stage's work on each batch (at INFO).
        compute_stream: The stream the caller trains the returned batch on; ``None``: the current
            stream.
        on_flush_end: Called once a flush (``set_flush(True)``) has drained the pipeline, before it
            fills again; ``None``: nothing.

    Our keyword-only options: :class:`~trec_pipelines.PipelineOptions` (this
    ``progress()`` is its own, described above).
    """

    # torchrec's stage bookkeeping (a list of outputs with events) has another
    # shape here: batches in slots, each with its host copy and index.
    _traits = PipelineCore._traits.updated(
        hooks={
            hook: Refused(
                "it works on torchrec's per-stage output list, which is not how this pipeline "
                "keeps its in-flight batches (slots, each with its host copy and index)",
                "a PipelineStage's runnable (wrap it), or progress(dataloader_iter)",
            )
            for hook in ("_run_stage", "_advance", "_run_with_event")
        },
        # No step guard: a stage that raises is resumed by the next call instead
        # (see [Note: a stage or the iterator raises]).
        guards_user_progress=False,
        resume=_StagedResume,
    )

    @property
    def _initialized(self) -> bool:
        """Whether the stages are filled (torchrec's attribute)."""
        return self._filled

    def __init__(
        self,
        pipeline_stages: List[PipelineStage],
        debug_mode: bool = False,
        compute_stream: Optional[torch.Stream] = None,
        on_flush_end: Optional[Callable[[], None]] = None,
        **options: Unpack[BatchOptions],
    ) -> None:
        super().__init__()
        self._init_options(options)
        # Each load's agreement rides a SparseDataDistUtil stage's splits
        # exchange where there is one, else an all-reduce started a call ahead.
        # Its model says which ranks train together; without one, the world.
        carriers = agreement_carriers(pipeline_stages)
        model = next((c.trained_model for c in carriers if c.trained_model is not None), None)
        channel = self._agreement_over(model, carried=bool(carriers))
        if channel is not None:
            for carrier in carriers:
                carrier.carry_agreement(channel)
        self._source = BatchSource(
            channel,
            validate=self._options["validate_batches"],
            pipelineable=False,  # the stages take whatever the iterator yields
            puller=self._next_batch,
            agree_ahead=self._options["agree_ahead"],
        )
        if not pipeline_stages:
            raise ValueError(
                "StagedTrainPipeline needs at least one PipelineStage, got none; "
                "pass e.g. a stage that copies the batch to the device"
            )
        self._pipeline_stages = list(pipeline_stages)
        declare_stages(self._pipeline_stages)
        self._debug_mode = debug_mode
        self.on_flush_end = on_flush_end
        self._stage_streams = [side_stream(stage.stream) for stage in self._pipeline_stages]
        # Recorded stream role: the stage's own name when it was given a stream.
        self._roles = [
            "default" if stage.stream is None else stage.name for stage in self._pipeline_stages
        ]
        devices = [s.device for s in self._stage_streams if s is not None]
        if compute_stream is not None and side_stream(compute_stream) is not None:
            devices.append(compute_stream.device)
        self._device = devices[0] if devices else torch.device("cpu")
        self._compute_stream = (
            side_stream(compute_stream)
            if compute_stream is not None
            else current_stream(self._device)
        )
        # slot k holds the batch that has been through stages 0 .. N-2-k
        # before a progress() call advances the slots (None: no batch).
        self._slots: List[Optional[InFlight]] = [None] * self.num_stages
        self._filled = False
        self._flushing = False
        self._loaded = 0  # batches handed to stage 0 so far: the next one's index
        # Where the last progress() raised, if it did (see skip_failed_batch).
        self._failure: Optional[StageFailure] = None
        # A fill or step that raised resumes at the unit that raised (see
        # [Note: a stage or the iterator raises]): how many units of the
        # current one are done, and the batch the current step returns.
        self._done_units = 0
        self._ready: Optional[InFlight] = None
        self._mid_step = False
        # Batches a checkpointed pipeline had in flight, loaded before the iterator's.
        self._resumed: Deque[Tuple[int, Any]] = deque()

    @property
    def num_stages(self) -> int:
        """How many stages each batch goes through (``len(pipeline_stages)``)."""
        return len(self._pipeline_stages)

    # ------------------------------------------------------------------ verbs

    def _fetch_ahead(self, dataloader_iter: Iterator[Any]) -> None:
        """Pull the batches this call loads before any stage runs (with several
        ranks, agreed; see :class:`~trec_pipelines.data.source.BatchSource`).

        A malformed batch raises here, dropped, and takes no index: the next
        load pulls the one after it, as in the other pipelines.
        """
        if self._flushing:
            return
        loads = self._loads_left()
        try:
            with self._noting_failure("the data iterator"):
                self._source.fetch_ahead(dataloader_iter, loads)
        except MalformedBatchError as error:
            self._failure = StageFailure("validation", None, error.index, str(error))
            raise

    def _loads_left(self) -> int:
        """How many batches this call's units left to run load (stage 0 on an empty slot)."""
        if self._filled:
            # A step loads once, in its first unit, unless it raised after loading.
            loaded = self._done_units > 0 or self._slots[-1] is not None
            return 0 if self._mid_step and loaded else 1
        units = self._fill_units()[self._done_units :]
        fill = sum(
            1
            for stage_idx, slot, callback in units
            if stage_idx == 0 and not callback and self._slots[slot] is None
        )
        return fill + 1  # and the step that follows the fill in the same call

    def _next_batch(self, dataloader_iter: Iterator[Any]) -> Optional[Any]:
        """The next batch from ``dataloader_iter``, or None at the end of the data.

        torchrec's hook, honoured: every batch is pulled through it, once, at the
        top of the ``progress()`` whose stage 0 takes it (with several ranks
        agreeing, a call ahead).  An override may skip or transform batches;
        ``super()._next_batch(dataloader_iter)`` pulls.  Not called while flushing.
        """
        return self._source.raw_next(dataloader_iter)

    def _load(self, dataloader_iter: Iterator[Any]) -> Optional[InFlight]:
        """The next batch, or None once the epoch's data ran out or while flushing."""
        if self._resumed:  # in flight when the checkpoint was taken: first, as they were
            index, host = self._resumed.popleft()
            return InFlight(host, None, None, index, host)
        if self._flushing:
            return None
        with self._noting_failure("the data iterator"):
            batch = self._source.next(dataloader_iter)
        if batch is None:
            return None
        self._loaded += 1
        return InFlight(batch, None, None, self._loaded - 1, batch)

    @property
    def rejected(self) -> int:
        """Malformed batches dropped (``validate_batches``; with several ranks, a
        batch malformed on any rank)."""
        return self._source.rejected

    @property
    def unused_batches(self) -> int:
        """Batches this rank pulled but did not train because another rank's data
        ended first."""
        return self._source.unused

    @contextlib.contextmanager
    def _noting_failure(
        self,
        where: str,
        slot: Optional[int] = None,
        item: Optional[InFlight] = None,
        stage_idx: Optional[int] = None,
    ) -> Iterator[None]:
        """Remember ``where`` (and stage ``stage_idx``'s batch ``item`` in ``slot``) if the body raises."""
        try:
            yield
        except BaseException as error:
            index = None if item is None else item.index
            message = f"{type(error).__name__}: {error}"
            self._failure = StageFailure(where, slot, index, message, stage_idx)
            raise

    def _stage_stream(self, stage_idx: int) -> Optional[torch.Stream]:
        """Where stage ``stage_idx`` runs: its own stream or the current one."""
        stream = self._stage_streams[stage_idx]
        return stream if stream is not None else current_stream(self._device)

    def _run(self, stage_idx: int, item: InFlight) -> InFlight:
        """Run one stage on ``item`` on the stage's stream; record its event."""
        stage = self._pipeline_stages[stage_idx]
        with self._recording.span(stage.name, item.index, self._roles[stage_idx]):
            with on_stream(self._stage_streams[stage_idx]):
                runs_on = self._stage_stream(stage_idx)
                item.hand_to(runs_on, f"stage {stage.name!r}")
                value = stage.runnable(item.value)
                return InFlight(value, runs_on, record_event(runs_on), item.index, item.host)

    def _run_unit(self, stage_idx: int, slot: int, dataloader_iter: Iterator[Any]) -> None:
        """Stage ``stage_idx`` takes the batch in ``slot`` (stage 0 loads one) and puts it back."""
        stage = self._pipeline_stages[stage_idx]
        if stage_idx == 0 and self._slots[slot] is None:
            # Kept in the slot before stage 0 runs: if it raises, the retry
            # runs it on this batch instead of loading another.
            self._slots[slot] = self._load(dataloader_iter)
        item = self._slots[slot]
        if item is None:
            if self._debug_mode:
                logger.info("stage %d (%s): no batch, skipped", stage_idx, stage.name)
            if stage.data_exhausted_callback is not None:
                with self._noting_failure(f"stage {stage.name!r}'s data_exhausted_callback"):
                    stage.data_exhausted_callback()
            self._slots[slot] = None
        else:
            if self._debug_mode:
                logger.info("stage %d (%s): batch %d", stage_idx, stage.name, item.index)
            with self._noting_failure(f"stage {stage.name!r}", slot, item, stage_idx):
                self._slots[slot] = self._run(stage_idx, item)

    def _fill_callback(self, stage_idx: int) -> None:
        stage = self._pipeline_stages[stage_idx]
        if stage.fill_callback is not None:
            with self._noting_failure(f"stage {stage.name!r}'s fill_callback"):
                stage.fill_callback()

    def _hand_to_compute(self, item: InFlight) -> Any:
        with self._recording.span(rec.WAIT_BATCH, item.index):  # last stage -> compute
            item.hand_to(self._compute_stream, "the compute stream")
        return item.value

    # --------------------------------------------------------------- schedule

    # [Note: a stage or the iterator raises]
    # A fill or a step is a fixed list of units (run stage s on slot k, or a
    # stage's fill callback), done in order; ``_done_units`` counts those that
    # returned.  A unit that raises is not counted, so the next progress()
    # carries on with it.  Stage 0 puts the batch it loads into its slot before
    # running, so a retry runs it on that batch; a step takes its ready batch
    # out once (``_mid_step``) and hands it over when its last unit is done.

    def _fill_units(self) -> List[_Work]:
        """Batch ``k`` runs stages ``0 .. N-1-k``, each followed by its fill callback."""
        n = self.num_stages
        return [
            (stage_idx, slot, callback)
            for slot in range(n)
            for stage_idx in range(n - slot)
            for callback in (False, True)
        ]

    def _step_units(self) -> List[_Work]:
        """Newest batch first: stage ``s`` works on slot ``N-1-s``."""
        n = self.num_stages
        return [(stage_idx, n - 1 - stage_idx, False) for stage_idx in range(n)]

    def _run_units(self, units: List[_Work], dataloader_iter: Iterator[Any]) -> None:
        """Run ``units`` from the first one not yet done; one that raises stays undone."""
        while self._done_units < len(units):
            stage_idx, slot, callback = units[self._done_units]
            if callback:
                self._fill_callback(stage_idx)
            else:
                self._run_unit(stage_idx, slot, dataloader_iter)
            self._done_units += 1
        self._done_units = 0

    def _fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        self._run_units(self._fill_units(), dataloader_iter)
        self._filled = True

    def _step(self, dataloader_iter: Iterator[Any]) -> Optional[InFlight]:
        """Take the ready batch out and move every other one a stage on; returns the ready one."""
        if not self._mid_step:
            self._ready = self._slots.pop(0)  # through every stage: trained by the caller next
            self._slots.append(None)
            self._mid_step = True
        self._run_units(self._step_units(), dataloader_iter)
        ready, self._ready, self._mid_step = self._ready, None, False
        return ready

    def progress(self, dataloader_iter: Iterator[Any]) -> Optional[Any]:
        """Advance every in-flight batch by one stage; return the one that is ready.

        Returns ``None`` when the data is exhausted and every batch has come
        out; calling again then starts a new epoch.
        """
        self._recording.begin_call()
        self._failure = None
        self._fetch_ahead(dataloader_iter)
        if not self._filled:
            self._fill_pipeline(dataloader_iter)
        ready = self._step(dataloader_iter)
        if ready is None:
            if any(slot is not None for slot in self._slots):
                # A gap left by a flush called off before it drained: skip it.
                return self.progress(dataloader_iter)
            if self._flushing:
                self.flush_end()
                return self.progress(dataloader_iter)
            self._end_epoch()
            return None
        return self._hand_to_compute(ready)

    def skip_failed_batch(self) -> int:
        """Drop the batch a stage raised on in the last ``progress()``; return its index.

        Call it before the next ``progress()``, instead of letting that call
        run the stage on the batch again (on every rank, with several).  The
        batch goes through no later stage and never comes out; the next
        ``progress()`` finishes the interrupted fill or step without it (see
        the class docstring).  Raises ``RuntimeError`` when the last
        ``progress()`` did not raise in a stage's runnable: then no batch is
        half way through a stage.
        """
        failure = self._failure
        if failure is None or failure.slot is None:
            raise RuntimeError(self._nothing_to_skip(failure))
        item = self._slots[failure.slot]
        assert item is not None and item.index == failure.index, (item, failure)
        assert failure.stage is not None
        self._slots[failure.slot] = None
        self._failure = None
        filling = not self._filled
        if filling:
            # Nothing newer is loaded yet: the slot starts over with the next batch.
            self._done_units = self._fill_units().index((0, failure.slot, False))
        for first_stage, owner in skip_aware_owners(self._pipeline_stages):
            owner.batch_skipped(passed=failure.stage > first_stage, filling=filling)
        logger.warning(
            "StagedTrainPipeline: batch %d skipped after %s raised on it (%s); "
            "it goes through no later stage and is not returned",
            item.index,
            failure.where,
            failure.error,
        )
        return item.index

    @staticmethod
    def _nothing_to_skip(failure: Optional[StageFailure]) -> str:
        """Why :meth:`skip_failed_batch` has no batch to drop after ``failure``."""
        head = "StagedTrainPipeline.skip_failed_batch(): "
        if failure is None:
            return head + (
                "the last progress() did not raise, so no stage failed on a batch "
                "(if your forward, backward or optimizer step raised, call progress() "
                "again to move on to the next batch, or train the same one again). "
                "Call it right after a progress() that raised in a stage."
            )
        if failure.where == "validation":
            return head + (
                f"batch {failure.index} was malformed and is already dropped; the "
                "next progress() goes on with the next batch"
            )
        return head + (
            f"{failure.where} raised ({failure.error}) while no stage was working on "
            "a batch, so there is none to skip; the next progress() calls it again"
        )

    def reset(self) -> None:
        """As torchrec's: nothing (the core's reset is for pipelines that park batches)."""
        TrainPipeline.reset(self)

    def set_flush(self, flush: bool) -> None:
        """Stop (``True``) or resume (``False``) loading new batches.

        While flushing the in-flight batches keep coming out; after the last one
        :meth:`flush_end` runs and the pipeline fills again.  With several ranks
        agreeing on each batch (``sync_exhaustion``), the batch pulled a step
        ahead stays held through the flush and is the first one after it (a
        checkpoint taken at the flush's end includes it).
        """
        self._flushing = flush

    def flush_end(self) -> None:
        """End a flush: resume loading, refill on the next call, run ``on_flush_end``."""
        in_flight = sum(slot is not None for slot in self._slots)
        if in_flight:
            raise RuntimeError(
                f"flush_end() with {in_flight} batch(es) in flight would drop them; "
                "call set_flush(True) and keep calling progress(), which ends the "
                "flush itself once they have all come out"
            )
        self._flushing = False
        self._filled = False
        if self.on_flush_end is not None:
            self.on_flush_end()

    def _end_epoch(self) -> None:
        self._filled = False
        self._source.end_epoch()


__all__ = ["PipelineStage", "SkipAware", "StagedTrainPipeline", "StageOut", "side_stream"]
