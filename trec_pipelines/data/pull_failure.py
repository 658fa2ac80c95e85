"""A data iterator that raises on one rank: every rank raises in the same step.

[Note: a loader error on one rank]
A rank whose ``next()`` raises (a file gone, a worker crashed) and which
raised at once would leave the other ranks in the step's collectives, waiting
for a rank that is not coming: its program caught the error and does
something else, and gloo and NCCL cannot interrupt the wait before the
process group's timeout (30 minutes by default).  So the error travels with
the pull's agreement (``[Note: agreeing on each batch]`` in
:mod:`trec_pipelines.data.agreement`), as a malformed batch does: the rank
reports the pull as FAILED, writes the error's first line in the job's store,
and goes on with the step it is in (whose batch it already has).  Where the
pull is agreed, before any work on it (the next ``progress()`` when agreeing
one pull ahead, the same one otherwise), every rank raises: the rank whose
iterator raised its own exception, with a note, and the others
:class:`~trec_pipelines.core.errors.PeerFailedError` naming that rank, the
batch and the error.  No rank waits for another.

The retry.  Each rank keeps what it pulled for that pull (the others their
batch; the failed rank nothing) and the pull keeps its number.  The next
``progress()`` first meets the other ranks in the store: when every rank has
called it within the grace (``TREC_PIPELINES_PEER_FAILURE_GRACE`` seconds, 10
by default), the failed rank asks its iterator again, the others reuse their
batch, and the ranks train on in step, nothing lost or trained twice.  A rank
that calls ``progress()`` again while another does not (it sleeps, it saves,
it exits) raises ``PeerFailedError`` again once the grace has passed, having
issued nothing, and can call again later.  The meeting is decided by one
``compare_set`` in the store, so every rank that came reads the same verdict.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, List, Optional, Tuple

import torch.distributed as dist

from trec_pipelines.core.errors import PeerFailedError
from trec_pipelines.core.notes import add_note
from trec_pipelines.core.peer_failure import grace_seconds

logger: logging.Logger = logging.getLogger(__name__)

_PREFIX = "trec_pipelines/pull_failure"
_DEFAULT_GRACE = 10.0
# Pull failures every rank agreed on so far: each rank counts the same ones in
# the same order, so the count names a failure alike on every rank.
_agreed = 0


def _store() -> Any:
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def first_line(error: BaseException) -> str:
    """``"OSError: disk gone"``: the error's type and the first line of its message."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _grace() -> float:
    grace = grace_seconds()
    return grace if grace > 0 else _DEFAULT_GRACE


def publish(error: BaseException) -> None:
    """Write this rank's iterator error in the store, before its code goes out."""
    key = f"{_PREFIX}/{_agreed + 1}/rank{dist.get_rank()}"
    _store().set(key, first_line(error))


def _peer_error_line(number: int, rank: int) -> str:
    try:
        store = _store()
        key = f"{_PREFIX}/{number}/rank{rank}"
        store.wait([key], timedelta(seconds=5))
        return str(store.get(key).decode())
    except Exception:  # noqa: BLE001  the store is gone: say so rather than fail here
        return "its error could not be read from the job's store"


@dataclass
class Retry:
    """A pull that failed on some rank, kept for the next ``progress()``."""

    number: int  # the failure's number, the same on every rank
    index: int  # the batch index the pull takes
    failed_on: List[int]
    batch: Optional[Any]  # this rank's batch for the pull (None: the failed rank)
    errors: List[str] = field(default_factory=list)  # each failed rank's first line

    def meet(self) -> None:
        """Wait for every rank's retry (see the module note); raise
        :class:`PeerFailedError` when one did not come within the grace."""
        store, world, rank = _store(), dist.get_world_size(), dist.get_rank()
        base, generation = f"{_PREFIX}/{self.number}/retry", 0
        while True:
            while store.check([f"{base}/{generation}/verdict"]):
                generation += 1  # a meeting decided before this rank came
            key = f"{base}/{generation}"
            verdict, closed_here = _meet_at(store, key, rank, world, _grace())
            if verdict == b"go":
                return
            if closed_here:
                break
            # Came as another rank gave up: the next meeting, with a whole grace.
        missing = [r for r in range(world) if not store.check([f"{key}/rank{r}"])]
        absent = ", ".join(str(r) for r in missing) or "another rank"
        cause = self.errors[0] if self.errors else "its data iterator raised"
        raise PeerFailedError.naming(
            missing[0] if missing else self.failed_on[0],
            self.index,
            f"{cause}; then rank(s) {absent} did not call progress() again within "
            f"{_grace():.0f} s (TREC_PIPELINES_PEER_FAILURE_GRACE) of this rank",
            "Nothing was issued: this rank would wait for them in the step. Call progress() "
            "again on every rank to retry this batch, or handle the error (checkpoint, exit).",
        )


def _meet_at(store: Any, key: str, rank: int, world: int, grace: float) -> Tuple[bytes, bool]:
    """Come to the meeting ``key``: its verdict (b"go" or b"closed"), and whether
    this rank closed it (it waited the whole grace)."""
    store.set(f"{key}/rank{rank}", "1")
    if store.add(f"{key}/came", 1) >= world:
        return store.compare_set(f"{key}/verdict", "", "go"), False
    try:
        store.wait([f"{key}/verdict"], timedelta(seconds=grace))
        return store.get(f"{key}/verdict"), False
    except Exception:  # noqa: BLE001  the store says "timeout" as a RuntimeError
        verdict = store.compare_set(f"{key}/verdict", "", "closed")
        return verdict, verdict == b"closed"


def agreed_failure(
    error: Optional[BaseException], batch: Optional[Any], failed_on: List[int], index: int
) -> Tuple[BaseException, Retry]:
    """Every rank agreed that pull ``index`` failed on ``failed_on``: the exception
    this rank raises (``error``: its own iterator's, if it failed) and the retry."""
    global _agreed
    _agreed += 1
    rank = dist.get_rank()
    errors = [
        first_line(error) if r == rank and error is not None else _peer_error_line(_agreed, r)
        for r in failed_on
    ]
    retry = Retry(_agreed, index, failed_on, batch, errors)
    grace = _grace()
    again = (
        f"To go on, call progress() again on every rank within {grace:.0f} s of each other "
        "(TREC_PIPELINES_PEER_FAILURE_GRACE): the failed rank asks its iterator for batch "
        f"{index} again, the others reuse theirs, and nothing is lost or trained twice; a rank "
        "that retries alone raises PeerFailedError again after that long."
    )
    if error is not None:
        others = ", ".join(str(r) for r in range(dist.get_world_size()) if r not in failed_on)
        peers = (
            f"rank(s) {others} raised PeerFailedError naming this rank, so none waits for it "
            "whatever this rank does next"
            if others
            else "every rank's iterator raised at this pull"
        )
        add_note(
            error,
            f"trec_pipelines: rank {rank}: the data iterator raised this while pulling batch "
            f"{index}. Every rank raised in this progress() call, before any work on the "
            f"batch: {peers}. {again}",
        )
        return error, retry
    lines = "; ".join(f"rank {r}: {e}" for r, e in zip(failed_on[1:], errors[1:], strict=True))
    also = f" (also {lines})" if lines else ""
    raised = PeerFailedError.naming(
        failed_on[0],
        index,
        errors[0] + also,
        "Its data iterator raised while pulling that batch; every rank raised in this "
        "progress() call, before any work on the batch, and this rank holds its own batch "
        f"{index} for the retry. {again}",
    )
    return raised, retry
