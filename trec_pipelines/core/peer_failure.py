"""A failed step told to the other ranks, and the watcher that acts on a peer's failure.

[Note: a failed step on one rank]
A step that raises on one rank only leaves the other ranks in the step's next
collective, waiting for a rank that will not come: gloo and NCCL have no way
to interrupt them before the process group's timeout (30 minutes by
default).  So a rank whose step raised says so in the world's store (the
``torch.distributed`` key-value store every rank already shares): which
pipeline, which batch, what error, and a number telling its publication from
the others.  Nothing is written while steps succeed.

* A rank whose step raised for another reason while a peer's failure stands
  (its collective failed: "Connection reset by peer", a timeout) adds a note
  naming the peer, its batch and its error, so the error a user reads says
  where the trouble started (:func:`note_peers`).
* Each rank runs a small watcher thread that looks at one counter in the
  store every second.  Every peer's failure is pending for this rank until it
  no longer stands, including one published before this rank's watcher
  started (a peer whose first step failed before its first collective, while
  this rank had not begun its own first step); while one is pending,
  every step this rank's main thread is in cannot complete: the failed rank
  left (or will leave) that step's collectives, and its retry would raise
  ``OutOfStepError`` since this rank did not fail.  That holds whatever the
  order of events: the failure may be published while this rank is between
  two ``progress()`` calls, or in an earlier step that still completes (its
  collectives had all met); the failure stays pending and the step this rank
  then enters is the one it waits in.  When this rank has been in one step for
  ``grace`` seconds with a failure pending (``TREC_PIPELINES_PEER_FAILURE_GRACE``,
  10 by default; 0 turns the watcher off), it logs the peer's failure and
  exits with status 1: under ``torchrun`` the job ends (or restarts, with
  ``--max-restarts``, from the last checkpoint) within seconds instead of at
  the timeout.  A rank that is not in a step (it caught its own error, it
  evaluates, it saves), or whose own failure stands, is left alone.  Exiting
  is the last resort: the waiting rank is blocked in a collective of the
  model's process group, which torch cannot interrupt short of the group's
  timeout, so no exception can reach its code; and aborting the user's group
  is not ours to do.  A failure seen before a step issues its collectives, a
  data iterator's error, is agreed instead, and raises ``PeerFailedError`` on
  every other rank (see ``[Note: a loader error on one rank]`` in
  :mod:`trec_pipelines.data.pull_failure`).
* A failure stands until every rank retried or skipped that batch, or its
  rank completed a later step (its collectives met the others' again).  A
  peer's failure no longer holds this rank back either once this rank failed
  after it (this rank's own failure answers it: this rank left the step too)
  or once this rank's retry found every rank failed at the same batch.
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

import itertools
import logging
import os
import re
import threading
import time
from datetime import timedelta
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import torch.distributed as dist

from trec_pipelines.core.errors import OutOfStepError
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


def _publication(number: int) -> str:
    """The key naming the rank and failure of the ``number``-th publication."""
    return f"{_PREFIX}/published{number}"


def _retracted(rank: int, count: int) -> str:
    return f"{_PREFIX}/rank{rank}/retracted{count}"


class FailureNews:
    """This process's view of the ranks' failed steps (one per process; see the module note)."""

    def __init__(self, store: Any, rank: int, world: int, group: Any) -> None:
        self.group = group  # the default group this store belongs to
        self._store = store
        self.rank, self._world = rank, world
        self._failures = 0  # this rank's failed steps so far
        self.standing = False  # this rank's last failure is not retried yet
        self._standing_from = 0  # the first of the failures standing since then
        # The step the main thread is in (None between steps): a new number at
        # each step's start (begin_step), so the watcher tells one step from the next.
        self.step: Optional[int] = None
        self._step_numbers = itertools.count(1)
        # Peers' failures that no longer hold this rank back, written by the main
        # thread: those published before this rank's own last failure (numbered
        # below ``answered_below``), and those its last retry found at the same batch.
        self.answered_below = 0
        self.agreed: FrozenSet[Tuple[int, int]] = frozenset()
        self._stop = threading.Event()
        self._watcher: Optional[threading.Thread] = None

    # ------------------------------------------------------------- main thread

    def begin_step(self) -> None:
        """The main thread starts a step (a ``progress()``, or a forward under watch)."""
        self.step = next(self._step_numbers)

    def end_step(self) -> None:
        """The main thread left its step (it returned or raised)."""
        self.step = None

    def failed(self, description: str, index: Optional[int]) -> None:
        """This rank's step raised: publish it (``description`` names the pipeline and error)."""
        self._failures += 1
        key = f"{_PREFIX}/rank{self.rank}/failure{self._failures}"
        self._store.set(key, f"{index}|{description}")
        self._store.set(f"{_PREFIX}/rank{self.rank}/last", str(self._failures))
        if not self.standing:
            self.standing = True
            self._standing_from = self._failures
            self._store.add(_STANDING, 1)
        number = int(self._store.add(_PUBLISHED, 1))
        self._store.set(_publication(number), f"{self.rank}|{self._failures}")
        self.answered_below = number

    def peers_failed(self) -> Dict[int, str]:
        """The peers whose last failure stands: rank -> "batch b: description"."""
        if self._store.add(_STANDING, 0) <= 0:
            return {}
        found: Dict[int, str] = {}
        for rank in range(self._world):
            last = f"{_PREFIX}/rank{rank}/last"
            if rank == self.rank or not self._store.check([last]):
                continue
            count = self._store.get(last).decode()
            index, description = (
                self._store.get(f"{_PREFIX}/rank{rank}/failure{count}").decode().split("|", 1)
            )
            if self._store.check([_retracted(rank, int(count))]):
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
        # Every rank failed here and retries it: their failures hold none of them back
        # (written before ``standing`` drops, which the watcher reads first).
        self.agreed = frozenset((r, self._failures) for r in range(self._world))
        self.retract()

    def retract(self) -> None:
        """This rank's failure no longer stands: retried or skipped on every rank, or
        a later step of this rank went through (a new pipeline's, say), so the ranks'
        collectives met again.  A later error elsewhere is then not blamed on it."""
        if self.standing:
            self.standing = False
            # Each failure since it began standing (a step that raised again before
            # any went through) is over: a watcher may hold any of them pending.
            for count in range(self._standing_from, self._failures + 1):
                self._store.set(_retracted(self.rank, count), "1")
            self._store.add(_STANDING, -1)

    # ----------------------------------------------------------------- watcher

    def start_watcher(self) -> None:
        if self._watcher is not None or grace_seconds() <= 0:
            return
        # The watch reads every publication from the first: a failure published
        # before this rank's first step (or while the thread starts) still stands
        # and holds the step this rank enters, as one published later would.
        watch = Watch(self, self._store)
        self._watcher = threading.Thread(
            target=self._watch, args=(watch,), name="trec_pipelines-peer-failure", daemon=True
        )
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2 * _POLL_SECONDS)

    def _watch(self, watch: Watch) -> None:
        if hasattr(self._store, "clone"):
            watch.store = self._store.clone()  # the main thread's connection stays its own
        while not self._stop.wait(_POLL_SECONDS):
            try:
                waited = watch.look(time.monotonic())
            except Exception:  # noqa: BLE001  the store went away: the job is ending
                return
            if waited is not None:
                self._end(waited)

    def _end(self, waited: float) -> None:
        try:
            peers = self.peers_failed()
        except Exception:  # noqa: BLE001
            peers = {}
        logger.error("%s", stop_message(self.rank, peers, waited))
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)


class Watch:
    """What the watcher thread knows between two looks at the store."""

    def __init__(self, news: FailureNews, store: Any) -> None:
        self.news = news
        self.store = store
        self.seen = 0  # publications read so far
        # Peers' failures published since, not yet settled: number -> (rank, count).
        self.pending: Dict[int, Tuple[int, int]] = {}
        # (step, when): the step the main thread was first seen in behind a pending failure.
        self.since: Optional[Tuple[int, float]] = None

    def look(self, now: float) -> Optional[float]:
        """One look at the store: the seconds this rank has waited in one step behind a
        pending failure, once that reaches the grace; else None."""
        news, store = self.news, self.store
        published = int(store.add(_PUBLISHED, 0))
        while self.seen < published:
            key = _publication(self.seen + 1)
            if not store.check([key]):
                break  # its rank is still writing it: read at the next look
            rank, count = (int(part) for part in store.get(key).decode().split("|"))
            self.seen += 1
            if rank != news.rank:
                self.pending[self.seen] = (rank, count)
        # Read before ``standing`` below: the main thread writes them before it drops.
        answered_below, agreed = news.answered_below, news.agreed
        for number, (rank, count) in list(self.pending.items()):
            if (
                number < answered_below
                or (rank, count) in agreed
                or store.check([_retracted(rank, count)])
            ):
                del self.pending[number]
        step = news.step
        if step is None or news.standing or not self.pending:
            self.since = None  # not in a step, failed too, or nothing holds it back
            return None
        if self.since is None or self.since[0] != step:
            self.since = (step, now)  # a step entered behind the failure: its wait starts
        waited = now - self.since[1]
        return waited if waited >= grace_seconds() else None


# What the process group says when a peer's process went away: gloo's reads and
# writes on a socket its peer closed ("Connection closed by peer [10.0.0.2]:43027",
# "Read error [10.0.0.2]:43027: Connection reset by peer", a write's "Broken pipe")
# and NCCL's remote error.  The group cannot take that peer back: a retry fails too.
_GONE = ("connection closed by peer", "connection reset by peer", "ncclremoteerror")
_ADDRESS = re.compile(r"\[([^\]\s]+)\]:(\d+)")


def gone_peer(error: BaseException) -> Optional[str]:
    """The peer whose process is gone, as the error names it ("the peer at
    [10.0.0.2]:43027", or "a peer" when it gives no address), or None when
    ``error`` does not say a peer went away."""
    text = str(error)
    address = _ADDRESS.search(text)
    said = text.lower()
    # A broken pipe only where gloo names the peer it wrote to (a user's own pipe may heal).
    if not any(words in said for words in _GONE) and not ("broken pipe" in said and address):
        return None
    return "a peer" if address is None else f"the peer at {address.group(0)}"


def stop_message(rank: int, peers: Dict[int, str], waited: float) -> str:
    """What a rank that stops behind its peers' failures logs (``peers``: rank ->
    "batch b: description", as :meth:`FailureNews.peers_failed` returns)."""
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


_news: Optional[FailureNews] = None
# The world (its default group, or None: no process group) found last to have a
# single rank: no news there, and each step asks only whether the world changed.
_alone_in: Optional[Tuple[Optional[dist.ProcessGroup]]] = None
_lock = threading.Lock()


def news() -> Optional[FailureNews]:
    """This process's failure news, or None outside a world of several ranks."""
    global _news, _alone_in
    if not dist.is_available():
        return None
    world = dist.group.WORLD
    if _news is not None and _news.group is world:
        return _news  # the steady state: the one made for the current world
    if _alone_in is not None and _alone_in[0] is world:
        return None  # the steady state of a rank on its own
    if world is None or dist.get_world_size() < 2:
        _alone_in = (world,)
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    with _lock:
        if _news is None or _news.group is not world:
            if _news is not None:
                _news.stop()  # of a world destroyed since
            _news = FailureNews(_get_default_store(), dist.get_rank(), dist.get_world_size(), world)
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
