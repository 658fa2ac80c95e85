"""Ranks agreeing on each batch they pull: the end of the data, and a malformed batch.

[Note: agreeing on each batch]
A step's collectives pair up only if every rank is at the same batch index.
Two things a rank learns alone, as it pulls a host batch, break that: its
data ended while the others' did not, or its batch is malformed
(``validate_batches``) while the others' are fine.  A rank that stops, or
drops the batch, on its own leaves the others in the step's next collective
until the process group times out; if it then goes on, it trains batch
``k + 1`` against the others' ``k``, and the ranks stay out of step (at the
end of the data one rank runs a step alone, and hangs).

So each pull is agreed before the step issues any work: one all-reduce (MIN)
of one int32 per rank on a gloo group of its own, each rank writing its own
slot (:data:`ENDED`, :data:`MALFORMED` or :data:`FINE`); every rank then
knows every rank's outcome.

* A batch malformed on any rank is dropped on every rank, and every rank
  raises ``MalformedBatchError`` for it, naming the batch and the ranks it was
  malformed on (there the error also says what is wrong).  This goes first,
  so the error is seen even when another rank's data ended at that pull.
* Otherwise, when any rank's data ended, the epoch ends on every rank (a
  rank that had a batch counts it in ``unused_batches``).

When it runs: with ``sync_exhaustion=True``.  torchrec has no such
agreement, and without it a rank whose batch is fine, when another rank's
is malformed, sees nothing until the process group times out (30 minutes by
default).  It is not on by default because it is not free: on the 2-core
machine of the benchmarks the all-reduce's CPU (gloo's threads) comes out of
the ranks' steps, +0.55-0.83 ms on a 6-10 ms step (``make bench-agreement``),
and the default preset's batch-512 rows fell from 1.01-1.08x torchrec to
0.92-1.02x with it on; one more host batch is also held (see below).  A job
for which one rank's bad batch must not cost the others their timeout
passes ``sync_exhaustion=True``; ``validate_batches`` then also agrees.  A
pipeline without it validates alone: the malformed batch is dropped on its
rank only, with the error, as before.

One pull ahead: waiting for the all-reduce where the batch is pulled would
put a gloo round trip (a few hundred microseconds on this 2-core machine) in
every step.  So :meth:`BatchSource.fetch_ahead
<trec_pipelines.data.source.BatchSource.fetch_ahead>`, at the top of each
``progress()``, first takes the batches the call needs, whose agreements
were started by the previous call and have had a whole step to finish, then
pulls one more and starts its all-reduce (``async_op``), left under way for
the next call.  The wait is then normally already over; a malformed batch
still raises before its step issues any work, on every rank; every rank
starts the same pulls in the same order, so the all-reduces pair up.  The
price: one more host batch pulled from the iterator and held (also in a
checkpoint, see ``[Note: exact resume]``).  A pipeline that only calls
:meth:`~trec_pipelines.data.source.BatchSource.next` (an eval loader thread)
agrees on each pull as it makes it, inside its own thread.

The group: gloo, so the flags are CPU tensors (no device synchronisation on
any backend), and a group of its own, so the all-reduce never queues behind
the model's all-to-alls in flight.  It spans the world (every rank that
trains with this one), is made by the pipeline's constructor with
``torch.distributed.new_group`` (so every rank of the world constructs its
pipeline at the same point, as it builds the sharded model), and gets the
timeout of the model's process group, so a peer that never comes fails the
agreement as soon as it would fail the model's own collectives.  Once its
pipeline is collected it is destroyed, by the next pipeline's constructor
(not inside the garbage collector, which may run in the middle of
``torch.distributed``'s own bookkeeping): a program that builds a pipeline
per eval pass would otherwise keep a gloo group (threads, sockets) per pass.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from trec_pipelines.model.rewrite import sharded_modules
from trec_pipelines.sparse.input_dist_group import _timeout_of

# What a rank reports for one pull; MIN over the ranks is slot by slot.
ENDED, MALFORMED, FINE = 0, 1, 2

# Groups whose pipeline was collected, destroyed by the next agreement_group().
_orphaned: List[dist.ProcessGroup] = []


@dataclass(frozen=True)
class Agreed:
    """One pull, as every rank saw it."""

    malformed_on: List[int]  # the (global) ranks whose batch is malformed
    ended: bool  # some rank's data ended


def _model_groups(model: torch.nn.Module) -> List[Optional[dist.ProcessGroup]]:
    """The process group of each of the model's sharded modules (None where a
    module does not say which it runs on)."""
    groups: List[Optional[dist.ProcessGroup]] = []
    for module in sharded_modules(model).values():
        pg = getattr(getattr(module, "_env", None), "process_group", None)
        if pg not in groups:
            groups.append(pg)
    return groups


def agreement_group(
    pipeline: Any, model: torch.nn.Module, sync_exhaustion: bool
) -> Optional[dist.ProcessGroup]:
    """The gloo group ``pipeline``'s :class:`~trec_pipelines.data.source.BatchSource`
    agrees on each pull over, or None when it agrees on nothing (see
    ``[Note: agreeing on each batch]``).  Once ``pipeline`` is collected, the
    next call destroys the group."""
    _destroy_orphans()
    initialized = dist.is_available() and dist.is_initialized()
    if sync_exhaustion and not initialized:
        raise RuntimeError(
            "sync_exhaustion=True agrees on the end of data across ranks and needs "
            "torch.distributed initialised first (dist.init_process_group(...))"
        )
    if not sync_exhaustion:
        return None
    groups = _model_groups(model)
    timeouts = [_timeout_of(pg) for pg in groups if pg is not None]
    group = dist.new_group(backend="gloo", timeout=next(filter(None, timeouts), None))
    assert isinstance(group, dist.ProcessGroup)  # every rank is a member
    # Not at interpreter exit: the process is going away, and torch may be too.
    weakref.finalize(pipeline, _orphaned.append, group).atexit = False
    return group


def _destroy_orphans() -> None:
    """Destroy the groups of the pipelines collected since the last call."""
    while _orphaned:
        orphan = _orphaned.pop()
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(ValueError):  # destroyed already, with its world
                dist.destroy_process_group(orphan)


class Agreement:
    """One pull's agreement, under way: :meth:`result` waits for it."""

    def __init__(self, group: dist.ProcessGroup, ended: bool, malformed: bool) -> None:
        self._group = group
        self._flags = torch.full((group.size(),), FINE, dtype=torch.int32)
        self._flags[group.rank()] = ENDED if ended else MALFORMED if malformed else FINE
        self._work: Optional[dist.Work] = dist.all_reduce(
            self._flags, op=dist.ReduceOp.MIN, group=group, async_op=True
        )

    def result(self) -> Agreed:
        """Every rank's outcome of this pull (waits for the all-reduce)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        outcomes = self._flags.tolist()
        ranks = dist.get_process_group_ranks(self._group)
        return Agreed(
            [r for r, o in zip(ranks, outcomes, strict=True) if o == MALFORMED], ENDED in outcomes
        )
