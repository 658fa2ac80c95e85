"""A step's frame: the guard around each ``progress()``, and its rollback when it raises.

Every ``progress()`` is wrapped by :func:`guarded_step` and starts with the
core's ``_start_step`` (:meth:`~trec_pipelines.assembly.pipeline.PipelineCore._start_step`):
the schedule recorder's new call, the take-over of a model another pipeline
left attached, the switch to a new iterator (parking the previous one's
in-flight batches), the pull of the host batches the step will copy, and,
last, the guard's begin (:meth:`StepGuard.begin`): from there a failure is
rolled back (see below).  A failed step is told to the other ranks by
:mod:`trec_pipelines.core.peer_failure`.

[Note: retrying a failed step]

A step touches several batches at once: it trains ``cur`` and, on the way,
consumes ``cur``'s input_dist (or lookup, or prefetch) result, starts the
input_dist of ``nxt`` and copies ``new``.  If anything raises half-way (the
model, the loss, the backward, the optimizer, the data iterator), some of that
work is done and some is not, and no single in-flight batch can be resumed
where it stopped.  So a failed step is undone as a whole, without issuing
anything: the pipeline forgets its in-flight device batches and contexts and
gives their *host* batches back to its :class:`~trec_pipelines.data.source.BatchSource`,
in order and with their indices.  The next ``progress()`` then finds an empty
pipeline and fills it from those host batches, re-running every copy,
input_dist, lookup and prefetch, and trains ``cur`` again from scratch: no
batch is pulled twice from the iterator, none is lost, none is trained twice
(a batch is retired only once its step returned).

What the failed attempt already did to the model stays done, as in a plain
loop that retries: a fused (in-backward) embedding update that ran before the
optimizer raised is not undone; the dense gradients are cleared by the retry's
``zero_grad``.  (A PEC module's update is not made in the backward, and
TrainPipelinePEC keeps a gradient one step defers to the next across a
rollback: see [Note: PEC, retrying a step] in
:mod:`trec_pipelines.pipelines.pec`.)

:func:`guarded_step` wraps each variant's ``progress()`` (one decorator line,
so ``progress()`` stays a literal timeline) and :class:`StepGuard` holds the
per-pipeline state.  A pipeline using it provides ``_step_guard``,
``_source`` (with ``keep_in_flight=True``) and ``_drop_in_flight_state()``,
and marks the guard begun once the step starts issuing work (the end of
``_start_step``; for a user's own ``progress()``, its first line:
:func:`guarded_user_step`):
failures before that (a detached pipeline, an iterator error while pulling
the host batches) change nothing and need no rollback.  An eval pipeline's
loader pulls and copies inside the begun step; its errors are not the step's
(:meth:`StepGuard.leave_as_is`; see ``[Note: a failed eval step]`` in
:mod:`trec_pipelines.pipelines.eval_sparse_dist`).

A failure that is the user's mistake
(:func:`~trec_pipelines.core.errors.is_users_mistake`: a forward that does not
return ``(losses, output)``) is rolled back the same way, but its error gets
no note offering a retry, nor one naming a peer that "failed first": every
rank made the same mistake, and only a fix helps.  A failure that says a
peer's process is gone (:func:`~trec_pipelines.core.peer_failure.gone_peer`:
gloo's "Connection closed by peer", "Connection reset by peer") is rolled
back too, but its note names that peer and advises a restart from the last
checkpoint instead of a retry: the process group cannot take the peer back,
so no retry can succeed.

Several ranks: a rank whose step raised after some of the step's collectives
were issued leaves the other ranks waiting in the matching collective.  It
tells them (see ``[Note: a failed step on one rank]`` in
:mod:`trec_pipelines.core.peer_failure`): a rank left waiting exits within
seconds, naming the failed rank and batch (the last resort: its wait is in
the model's collectives, which cannot be interrupted; a data iterator's error
is agreed before any work instead, and raises ``PeerFailedError`` on the other
ranks, see ``[Note: a loader error on one rank]`` in
:mod:`trec_pipelines.data.pull_failure`), and a retry (or skip) on one rank
only raises ``OutOfStepError`` instead of pairing the wrong collectives.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol, TypeVar

import torch.distributed as dist

from trec_pipelines.core.errors import is_users_mistake
from trec_pipelines.core.notes import add_note
from trec_pipelines.core.peer_failure import (
    RETRY_WAIT,
    gone_peer,
    grace_seconds,
    news,
    note_peers,
)

logger: logging.Logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FailedStep:
    """The last ``progress()`` that raised after issuing work."""

    index: Optional[int]  # the batch it was training; retried by the next progress()
    error: str  # the exception's type and message, for logs


class RollbackSource(Protocol):
    """What the guard asks of a pipeline's batch source (a
    :class:`~trec_pipelines.data.source.BatchSource` kept with ``keep_in_flight=True``)."""

    def retire(self) -> None:
        """The oldest in-flight batch was trained: forget its host copy."""

    def rewind(self) -> Optional[int]:
        """Give every in-flight batch back, in order; the index of the first, or None."""

    def skip_rewound(self) -> Optional[int]:
        """Drop the first batch :meth:`rewind` gave back; its index, or None."""


class StepGuard:
    """Whether a step is running, whether it issued work, and the last failure."""

    def __init__(self, work: str = "training") -> None:
        self.work = work  # what a step does to its batch, for the notes: "evaluating" in eval
        self.running = False
        self.begun = False
        self.failed: Optional[FailedStep] = None
        self.steps = 0  # steps begun so far: tells state saved in this step from older

    def begin(self) -> None:
        """The step starts issuing work: from here a failure is rolled back (once per call)."""
        if not self.begun:
            self.begun = True
            self.steps += 1

    def leave_as_is(self) -> None:
        """The error being raised is the loading's, not the step's work: the pipeline
        stays as it is, nothing is rolled back nor told to the other ranks.

        For a pipeline whose loading runs inside the begun step (an eval pipeline's
        loader, see ``[Note: a failed eval step]`` in
        :mod:`trec_pipelines.pipelines.eval_sparse_dist`): its loading errors end or
        skip the loading, and the batches in flight run on; the ranks agree on them
        as they pull (``[Note: a loader error on one rank]``)."""
        self.begun = False

    def skip_failed(self, source: RollbackSource, pipeline: str) -> int:
        """Drop the batch the last, failed ``progress()`` was training from ``source``;
        return its index (``pipeline``: the class's name, for the messages)."""
        failed = self.failed
        if failed is None or failed.index is None:
            raise RuntimeError(
                f"{pipeline}.skip_failed_batch(): the last progress() did not fail while "
                "training a batch, so there is nothing to skip. Call it right after the "
                "progress() that raised, before calling progress() again."
            )
        ranks = news()
        if ranks is not None:
            ranks.retry_allowed(failed.index)  # every rank failed there, or none goes on
        skipped = source.skip_rewound()
        assert skipped == failed.index, (skipped, failed.index)
        self.failed = None
        logger.warning(
            "%s: batch %d skipped after its step failed (%s); it is not trained",
            pipeline,
            skipped,
            failed.error,
        )
        return skipped


class Guarded(Protocol):
    """What :func:`guarded_step` needs of a pipeline (``PipelineCore`` has it all)."""

    @property
    def _step_guard(self) -> StepGuard: ...

    @property
    def _source(self) -> RollbackSource: ...

    def _drop_in_flight_state(self) -> None: ...


G = TypeVar("G", bound=Guarded)
P = TypeVar("P")


def _where() -> str:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f"rank {dist.get_rank()}: "
    return ""


def _explain(error: BaseException, pipeline: str, index: Optional[int], work: str) -> None:
    batch = "its batch" if index is None else f"batch {index}"
    gone = gone_peer(error)
    where = _where()
    if gone is None:
        note = (
            f"trec_pipelines: {where}{pipeline}.progress() raised while {work} "
            f"{batch}; the pipeline rolled back, and the next progress() retries {batch} "
            "from its host copy (call pipeline.skip_failed_batch() first to drop it instead)."
        )
    else:
        note = (
            f"trec_pipelines: {where}{pipeline}.progress() raised while {work} "
            f"{batch} because {gone} is gone: its process ended (its own output says why: "
            "an error, killed, out of memory) or it left the process group. The pipeline "
            "rolled back, but no retry can succeed in this job: the process group cannot "
            "take that peer back, so progress() and skip_failed_batch() would fail again. "
            "Restart the job from the last checkpoint (torchrun --max-restarts restarts "
            "every rank)."
        )
    if where:
        grace = grace_seconds()
        note += (
            " With several ranks: the other ranks that did not raise are waiting in this "
            "step's collectives, which this rank left. Each reads this failure in the job's "
            "store and, "
            + (
                f"after {grace:.0f} s (TREC_PIPELINES_PEER_FAILURE_GRACE), ends its process "
                "with status 1 naming this rank and batch, whatever this rank does next: a "
                "wait in the model's collectives cannot be interrupted short of the process "
                "group's timeout, so ending is the last resort (torchrun then ends the job, or "
                "restarts it from the last checkpoint with --max-restarts)."
                if grace > 0
                else "with TREC_PIPELINES_PEER_FAILURE_GRACE=0, waits until the process "
                "group's timeout."
            )
        )
        if gone is None:
            note += (
                f" A retry goes on only where every rank raised at {batch}: call progress() "
                "(or skip_failed_batch()) on every rank within "
                f"{RETRY_WAIT.total_seconds():.0f} s of each other; a rank that "
                "retries while another did not fail there raises OutOfStepError."
            )
    add_note(error, note)


def guarded_step(progress: Callable[[G, Iterator[Any]], P]) -> Callable[[G, Iterator[Any]], P]:
    """Make ``progress`` roll the pipeline back when it raises (see the module note)."""

    @functools.wraps(progress)
    def step(self: G, dataloader_iter: Iterator[Any]) -> P:
        guard = self._step_guard
        if guard.running:  # a nested call from the same step
            return progress(self, dataloader_iter)
        ranks = news()
        if ranks is not None and guard.failed is not None:
            ranks.retry_allowed(guard.failed.index)  # every rank failed there, or none goes on
        guard.running, guard.begun = True, False
        if ranks is not None:
            ranks.begin_step()
        try:
            output = progress(self, dataloader_iter)
        except StopIteration:
            raise  # the end of the data: nothing is half done
        except BaseException as error:
            mistake = is_users_mistake(error)  # the model's or data's: retrying cannot help
            if ranks is not None and not mistake:
                note_peers(error)
            if guard.begun:
                self._drop_in_flight_state()
                index = self._source.rewind()
                guard.failed = FailedStep(index, f"{type(error).__name__}: {error}")
                if not mistake:
                    _explain(error, type(self).__name__, index, guard.work)
                if ranks is not None:
                    what = f"{type(self).__name__}.progress() raised {guard.failed.error}"
                    ranks.failed(what, index)
            raise
        finally:
            guard.running = False
            if ranks is not None:
                ranks.end_step()
        if guard.begun:
            self._source.retire()
            guard.failed = None
            if ranks is not None and ranks.standing:
                ranks.retract()  # this rank's step went through: a past failure is over
        return output

    return step


def guarded_user_step(progress: Callable[[G, Iterator[Any]], P]) -> Callable[[G, Iterator[Any]], P]:
    """A subclass's own ``progress()``, inside the step guard and begun from its first
    line: a user's progress issues work from there, so a failure anywhere in it is
    rolled back (see ``[Note: subclass hooks]``)."""

    @functools.wraps(progress)
    def begun(self: G, dataloader_iter: Iterator[Any]) -> P:
        self._step_guard.begin()
        return progress(self, dataloader_iter)

    return guarded_step(begun)
