"""A step's frame: its start, a rollback when it raises, and the news told to the other ranks.

Every ``progress()`` is wrapped by :func:`guarded_step` and starts with
:func:`start_step` (the core's ``_start_step``): the schedule recorder's new
call, the take-over of a model another pipeline left attached, the switch to
a new iterator (parking the previous one's in-flight batches), the pull of
the host batches the step will copy, and, last, the guard's begin: from
there a failure is rolled back (see below).  Everything a step does before
its own timeline is that one function; where the step is, torchrec's
``_state``, is written by :func:`enter_phase` (the core's ``_enter_phase``).

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
:func:`start_step`; ``StepGuard.begin()`` for a user's own ``progress()``):
failures before that (a detached pipeline, an iterator error while pulling
the host batches) change nothing and need no rollback.

A failure that is the user's mistake
(:func:`~trec_pipelines.core.errors.is_users_mistake`: a forward that does not
return ``(losses, output)``) is rolled back the same way, but its error gets
no note offering a retry, nor one naming a peer that "failed first": every
rank made the same mistake, and only a fix helps.

Several ranks: a rank whose step raised after some of the step's collectives
were issued leaves the other ranks waiting in the matching collective.  It
tells them (see ``[Note: a failed step on one rank]`` below): a rank left waiting exits within
seconds, naming the failed rank and batch (the last resort: its wait is in
the model's collectives, which cannot be interrupted; a data iterator's error
is agreed before any work instead, and raises ``PeerFailedError`` on the other
ranks, see ``[Note: a loader error on one rank]`` in
:mod:`trec_pipelines.data.pull_failure`), and a retry (or skip) on one rank
only raises ``OutOfStepError`` instead of pairing the wrong collectives.

[Note: a failed step on one rank]
A step that raises on one rank only leaves the other ranks in the step's next
collective, waiting for a rank that will not come: gloo and NCCL have no way
to interrupt them before the process group's timeout (30 minutes by
default).  So a rank whose step raised says so in the world's store (the
``torch.distributed`` key-value store every rank already shares): which
pipeline, which batch, what error.  Nothing is written while steps succeed.

* A rank whose step raised for another reason while a peer's failure stands
  (its collective failed: "Connection reset by peer", a timeout) adds a note
  naming the peer, its batch and its error, so the error a user reads says
  where the trouble started.
* Each rank runs a small watcher thread that looks at one counter in the
  store every second.  When a peer's failure stands and this rank's main
  thread has been in the same step since before it, for ``grace`` seconds
  (``TREC_PIPELINES_PEER_FAILURE_GRACE``, 10 by default; 0 turns the watcher
  off), the rank logs the peer's failure and exits with status 1: its step
  cannot complete, and under ``torchrun`` the job ends (or restarts, with
  ``--max-restarts``, from the last checkpoint) within seconds instead of at
  the timeout.  A rank that is not in a step (it caught its own error, it
  evaluates, it saves) is left alone.  Exiting is the last resort: the
  waiting rank is blocked in a collective of the model's process group,
  which torch cannot interrupt short of the group's timeout, so no exception
  can reach its code; and aborting the user's group is not ours to do.  A
  failure seen before a step issues its collectives, a data iterator's error,
  is agreed instead, and raises ``PeerFailedError`` on every other rank (see
  ``[Note: a loader error on one rank]`` in
  :mod:`trec_pipelines.data.pull_failure`).
* A failure stands until every rank retried or skipped that batch, or this
  rank completed a later step (its collectives met the others' again).
* A retry (or ``skip_failed_batch()``) is only safe when every rank failed
  at the same batch: the collectives of the failed step were then abandoned
  alike.  Before retrying, a rank waits a few seconds for every rank's
  report of the same failure; a rank that never failed is waiting in the
  failed step, so a lone retry raises
  :class:`~trec_pipelines.core.errors.OutOfStepError` (and the failure stays
  standing, so the watchers end the waiting ranks).

The watcher is stopped before the interpreter's threads are joined at exit,
so it never outlives ``torch.distributed``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, TypeVar

import torch.distributed as dist

from trec_pipelines.core.errors import OutOfStepError, is_users_mistake
from trec_pipelines.core.notes import add_note

logger: logging.Logger = logging.getLogger(__name__)

_PREFIX = "trec_pipelines/peer_failure"
_STANDING = f"{_PREFIX}/standing"  # how many ranks' failures stand now
_PUBLISHED = f"{_PREFIX}/published"  # how many failures were ever published
_POLL_SECONDS = 1.0
# How long a retry waits for every rank's report of the same failure.
RETRY_WAIT = timedelta(seconds=5)


def grace_seconds() -> float:
    """How long a rank waits in a step behind a peer's failure before it exits."""
    return float(os.environ.get("TREC_PIPELINES_PEER_FAILURE_GRACE", "10"))


class _News:
    """This process's view of the ranks' failed steps (one per process)."""

    def __init__(self, store: Any, rank: int, world: int, group: Any) -> None:
        self.group = group  # the default group this store belongs to
        self._store = store
        self._rank, self._world = rank, world
        self._failures = 0  # this rank's failed steps so far
        self.standing = False  # this rank's last failure is not retried yet
        # The step the main thread is in (None between steps), written by the step
        # guard at each step's start and end: a new number from ``step_numbers``.
        self.step: Optional[int] = None
        self.step_numbers = itertools.count(1)
        self._stop = threading.Event()
        self._watcher: Optional[threading.Thread] = None

    # ------------------------------------------------------------- main thread

    def failed(self, description: str, index: Optional[int]) -> None:
        """This rank's step raised: publish it (``description`` names the pipeline and error)."""
        self._failures += 1
        key = f"{_PREFIX}/rank{self._rank}/failure{self._failures}"
        self._store.set(key, f"{index}|{description}")
        self._store.set(f"{_PREFIX}/rank{self._rank}/last", str(self._failures))
        if not self.standing:
            self.standing = True
            self._store.add(_STANDING, 1)
        self._store.add(_PUBLISHED, 1)

    def peers_failed(self) -> Dict[int, str]:
        """The peers whose last failure stands: rank -> "batch b: description"."""
        if self._store.add(_STANDING, 0) <= 0:
            return {}
        found: Dict[int, str] = {}
        for rank in range(self._world):
            last = f"{_PREFIX}/rank{rank}/last"
            if rank == self._rank or not self._store.check([last]):
                continue
            count = self._store.get(last).decode()
            index, description = (
                self._store.get(f"{_PREFIX}/rank{rank}/failure{count}").decode().split("|", 1)
            )
            if self._store.check([f"{_PREFIX}/rank{rank}/retracted{count}"]):
                continue
            found[rank] = f"{'its step' if index == 'None' else f'batch {index}'}: {description}"
        return found

    def retry_allowed(self, index: Optional[int]) -> None:
        """Raise OutOfStepError unless every rank's last failure was at ``index``."""
        if not self.standing:
            return
        keys = [f"{_PREFIX}/rank{r}/failure{self._failures}" for r in range(self._world)]
        try:
            self._store.wait(keys, RETRY_WAIT)
        except Exception:  # noqa: BLE001  (the store says "timeout" as a RuntimeError)
            missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            raise OutOfStepError.at(
                [index if r not in missing else None for r in range(self._world)],
                list(range(self._world)),
            ) from None
        at = [self._store.get(k).decode().split("|", 1)[0] for k in keys]
        if len(set(at)) > 1:
            pulls = [None if a == "None" else int(a) for a in at]
            raise OutOfStepError.at(pulls, list(range(self._world)))
        self.retract()

    def retract(self) -> None:
        """This rank's failure no longer stands: retried or skipped on every rank, or
        a later step of this rank went through (a new pipeline's, say), so the ranks'
        collectives met again.  A later error elsewhere is then not blamed on it."""
        if self.standing:
            self.standing = False
            self._store.set(f"{_PREFIX}/rank{self._rank}/retracted{self._failures}", "1")
            self._store.add(_STANDING, -1)

    # ----------------------------------------------------------------- watcher

    def start_watcher(self) -> None:
        if self._watcher is not None or grace_seconds() <= 0:
            return
        # The failures published so far, read here and not in the thread: a peer's
        # failure published while the thread is still starting (a busy machine) is
        # then new to it, not mistaken for an old one.
        try:
            seen = self._store.add(_PUBLISHED, 0)
        except Exception:  # noqa: BLE001  the store went away: the job is ending
            return
        self._watcher = threading.Thread(
            target=self._watch, args=(seen,), name="trec_pipelines-peer-failure", daemon=True
        )
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2 * _POLL_SECONDS)

    def _watch(self, seen: int) -> None:
        store = self._store.clone() if hasattr(self._store, "clone") else self._store
        # (step, time): the step the main thread was in when a new failure was published.
        suspect: Optional[Tuple[int, float]] = None
        while not self._stop.wait(_POLL_SECONDS):
            try:
                published = store.add(_PUBLISHED, 0)
                step = self.step
                if published > seen and step is not None and not self.standing:
                    suspect = (step, time.monotonic())
                seen = published
                if suspect is None:
                    continue
                if step != suspect[0] or self.standing:
                    suspect = None  # the step ended after all, or this rank failed too
                    continue
                waited = time.monotonic() - suspect[1]
                if waited >= grace_seconds() and store.add(_STANDING, 0) > 0:
                    self._end(waited)
            except Exception:  # noqa: BLE001  the store went away: the job is ending
                return

    def _end(self, waited: float) -> None:
        try:
            peers = self.peers_failed()
        except Exception:  # noqa: BLE001
            peers = {}
        logger.error("%s", stop_message(self._rank, peers, waited))
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)


def stop_message(rank: int, peers: Dict[int, str], waited: float) -> str:
    """What a rank that stops behind its peers' failures logs (``peers``: rank ->
    "batch b: description", as :meth:`_News.peers_failed` returns)."""
    what = "; ".join(f"rank {r} failed at {d}" for r, d in sorted(peers.items()))
    failed = ", ".join(f"rank {r}" for r in sorted(peers)) or "the failed rank"
    return (
        f"trec_pipelines: rank {rank} stops: {what or 'another rank failed in its step'}. "
        f"{failed}'s error is above in this job's output: this rank is not the root "
        "cause, even if torchrun names it (it names the first rank to exit, which may be "
        f"this one). This rank has waited {waited:.0f} s in a step whose collectives the "
        "failed rank will not join (TREC_PIPELINES_PEER_FAILURE_GRACE sets how long, "
        "in seconds; 0 turns this off). Ending the process is the last resort: the wait "
        "is in a collective of the model's process group, which torch cannot interrupt "
        "short of that group's timeout, so no exception can reach this rank's code (a "
        "failure seen before a step's collectives, as a data iterator's error, raises "
        "PeerFailedError instead). Fix the failed rank's error, then restart from the "
        "last checkpoint (torchrun --max-restarts does)."
    )


_news: Optional[_News] = None
_lock = threading.Lock()


def news() -> Optional[_News]:
    """This process's failure news, or None outside a world of several ranks."""
    global _news
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    world = dist.group.WORLD
    if _news is not None and _news.group is world:
        return _news
    from torch.distributed.distributed_c10d import _get_default_store

    with _lock:
        if _news is None or _news.group is not world:
            if _news is not None:
                _news.stop()  # of a world destroyed since
            _news = _News(_get_default_store(), dist.get_rank(), dist.get_world_size(), world)
            threading._register_atexit(_news.stop)  # type: ignore[attr-defined]
            _news.start_watcher()
    return _news


def note_peers(error: BaseException) -> None:
    """Add a note naming the peers whose failure stands, if any (see the module note)."""
    current = news()
    if current is None:
        return
    try:
        peers = current.peers_failed()
    except Exception:  # noqa: BLE001  the store is gone too: nothing to add
        return
    lines: List[str] = [f"rank {r} failed first, at {d}" for r, d in sorted(peers.items())]
    if lines:
        add_note(error, "trec_pipelines: " + "; ".join(lines))


P = TypeVar("P")


@dataclass(frozen=True)
class FailedStep:
    """The last ``progress()`` that raised after issuing work."""

    index: Optional[int]  # the batch it was training; retried by the next progress()
    error: str  # the exception's type and message, for logs


class StepGuard:
    """Whether a step is running, whether it issued work, and the last failure."""

    def __init__(self) -> None:
        self.running = False
        self.begun = False
        self.failed: Optional[FailedStep] = None
        self.steps = 0  # steps begun so far: tells state saved in this step from older

    def begin(self) -> None:
        """The step starts issuing work: from here a failure is rolled back (once per call)."""
        if not self.begun:
            self.begun = True
            self.steps += 1


def _where() -> str:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f"rank {dist.get_rank()}: "
    return ""


def _explain(error: BaseException, pipeline: Any, index: Optional[int]) -> None:
    name = type(pipeline).__name__
    batch = "its batch" if index is None else f"batch {index}"
    note = (
        f"trec_pipelines: {_where()}{name}.progress() raised while training "
        f"{batch}; the pipeline rolled back, and the next progress() retries {batch} "
        "from its host copy (call pipeline.skip_failed_batch() first to drop it instead)."
    )
    if _where():
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
            + f" A retry goes on only where every rank raised at {batch}: call progress() "
            "(or skip_failed_batch()) on every rank within "
            f"{RETRY_WAIT.total_seconds():.0f} s of each other; a rank that "
            "retries while another did not fail there raises OutOfStepError."
        )
    add_note(error, note)


def start_step(self: Any, dataloader_iter: Iterator[Any]) -> None:
    """What every step does before its timeline, in one place (the core's
    ``_start_step``; see the module note)."""
    recorder = self._recording.recorder
    if recorder is not None:
        recorder.begin_call()
    if self._pipelined.looked_at != self._pipelined.changes.count:  # a wrapper changed since
        self._take_over_model()
    if dataloader_iter is not self._source.iterator:
        self._switch_iterator(dataloader_iter)
    # Pull the host batches this call copies before any work: an iterator error
    # then reaches the caller with the pipeline untouched.  A user's _next_batch
    # pulls in the copy stage instead, where torchrec calls it.
    ahead = 0 if self._traits.pulls_when_copied else self._batches_to_fetch()
    self._source.fetch_ahead(dataloader_iter, ahead)
    guard: StepGuard = self._step_guard
    if not guard.begun:  # from here a failure is rolled back and retried (as guard.begin())
        guard.begun, guard.steps = True, guard.steps + 1


def enter_phase(self: Any, phase: Any) -> None:
    """Set ``_state`` to ``phase`` (torchrec's ``PipelineState``: ``IDLE`` at a step's
    start, ``CALL_FWD``, ``CALL_BWD``) where torchrec's class does (``tracks_state``)."""
    if self._traits.tracks_state:
        self._state = phase


def guarded_step(progress: Callable[[Any, Iterator[Any]], P]) -> Callable[[Any, Iterator[Any]], P]:
    """Make ``progress`` roll the pipeline back when it raises (see the module note)."""

    @functools.wraps(progress)
    def step(self: Any, dataloader_iter: Iterator[Any]) -> P:
        guard: StepGuard = self._step_guard
        if guard.running:  # a nested call from the same step
            return progress(self, dataloader_iter)
        # This process's failure news: the one made for the current world, as news()
        # finds it (read here first, the steady state, without the calls to find out).
        ranks = _news if _news is not None and _news.group is dist.group.WORLD else news()
        if ranks is not None and guard.failed is not None:
            ranks.retry_allowed(guard.failed.index)  # every rank failed there, or none goes on
        guard.running, guard.begun = True, False
        if ranks is not None:
            ranks.step = next(ranks.step_numbers)  # the watcher tells this step from the next
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
                    _explain(error, self, index)
                if ranks is not None:
                    what = f"{type(self).__name__}.progress() raised {guard.failed.error}"
                    ranks.failed(what, index)
            raise
        finally:
            guard.running = False
            if ranks is not None:
                ranks.step = None
        if guard.begun:
            self._source.retire()
            guard.failed = None
            if ranks is not None and ranks.standing:
                ranks.retract()  # this rank's step went through: a past failure is over
        return output

    return step


def skip_failed_batch(pipeline: Any) -> int:
    """Drop the batch the last, failed ``progress()`` was training; return its index."""
    guard: StepGuard = pipeline._step_guard
    failed = guard.failed
    name = type(pipeline).__name__
    if failed is None or failed.index is None:
        raise RuntimeError(
            f"{name}.skip_failed_batch(): the last progress() did not fail while "
            "training a batch, so there is nothing to skip. Call it right after the "
            "progress() that raised, before calling progress() again."
        )
    ranks = news()
    if ranks is not None:
        ranks.retry_allowed(failed.index)  # every rank failed there, or none goes on
    skipped: int = pipeline._source.skip_rewound()
    assert skipped == failed.index, (skipped, failed.index)
    guard.failed = None
    logger.warning(
        "%s: batch %d skipped after its step failed (%s); it is not trained",
        name,
        skipped,
        failed.error,
    )
    return skipped
