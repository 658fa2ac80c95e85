"""One rank's failed step, told to the other ranks.

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

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

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


class _News:
    """This process's view of the ranks' failed steps (one per process)."""

    def __init__(self, store: Any, rank: int, world: int, group: Any) -> None:
        self.group = group  # the default group this store belongs to
        self._store = store
        self._rank, self._world = rank, world
        self._failures = 0  # this rank's failed steps so far
        self.standing = False  # this rank's last failure is not retried yet
        self._step: Optional[int] = None  # the step the main thread is in, if any
        self._steps = 0
        self._stop = threading.Event()
        self._watcher: Optional[threading.Thread] = None

    # ------------------------------------------------------------- main thread

    def step_begins(self) -> None:
        self._steps += 1
        self._step = self._steps
        if self._watcher is None:
            self._start_watcher()

    def step_ends(self) -> None:
        self._step = None

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

    def _start_watcher(self) -> None:
        if self._watcher is not None or grace_seconds() <= 0:
            return
        self._watcher = threading.Thread(
            target=self._watch, name="trec_pipelines-peer-failure", daemon=True
        )
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2 * _POLL_SECONDS)

    def _watch(self) -> None:
        store = self._store.clone() if hasattr(self._store, "clone") else self._store
        try:
            seen = store.add(_PUBLISHED, 0)
        except Exception:  # noqa: BLE001  the store went away: the job is ending
            return
        # (step, time): the step the main thread was in when a new failure was published.
        suspect: Optional[Tuple[int, float]] = None
        while not self._stop.wait(_POLL_SECONDS):
            try:
                published = store.add(_PUBLISHED, 0)
                step = self._step
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
