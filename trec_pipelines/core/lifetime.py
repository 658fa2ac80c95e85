"""What the package starts, and its release: process groups, threads and executors.

[Note: a clean exit]
A gloo process group runs its collectives on C++ threads of its own (two
workers and one TCP loop per group) that stop only when the last reference to
the group goes: ``torch.distributed.destroy_process_group`` takes a group out
of torch's tables but leaves its threads running while anything still holds
it.  A group still held when the interpreter starts its teardown is freed in
the middle of it, or never.  A worker that then lets go of the last tensor of
a finished collective needs the GIL for it, the finalizing interpreter stops
the thread instead, inside C++ code that cannot be unwound, and the process
aborts with "terminate called without an active exception" after a run that
was correct (torchrun reports the job FAILED).  A daemon thread left blocked
in torch is stopped the same way.

So everything the package starts is registered here and released while the
interpreter is still whole:

* process groups (the dedicated input-dist groups, each pipeline's agreement
  group): :func:`own_group`.  The registry holds the one lasting reference;
  the package's other users of a group hold it weakly or for one call, so
  releasing it (destroyed where torch still knows it, then dropped) joins its
  threads on the spot, torch letting go of the GIL meanwhile.  A group with an
  owner is released once the owner (a pipeline) has been collected, at the
  next :func:`release_orphans` (a new group, or the exit), not inside the
  garbage collector, which may run in the middle of torch.distributed's own
  bookkeeping;
* threads (an eval pipeline's loader, :class:`~trec_pipelines.DataLoadingThread`):
  :func:`own_thread`, stopped and joined;
* executors: :func:`own_executor`, shut down (at once when their owner is
  collected).

:func:`release_all` releases everything; it runs at interpreter exit (an
``atexit`` hook: after the program's non-daemon threads have been joined, before
the teardown).  ``detach()`` releases nothing: a detached pipeline resumes where
it stopped, with its batches in flight and the threads that hold them.

[Note: a group every member has made]
``torch.distributed.new_group`` returns on a rank once that rank's side of
each gloo connection is made, which can be before a peer's side is: the rank
that opened a connection counts it made as soon as it has sent its greeting,
while the peer has yet to read it.  A rank that goes on and destroys the group
(a pipeline whose constructor raised, or one dropped at once, is released at
the next group's making) closes connections a slower member is still making,
and that member's ``new_group`` fails with "Gloo connectFullMesh failed ...
Connection closed by peer" while every other rank carries on.  Seen in the
package's 4-rank tests on two cores: three ranks made a group and destroyed it
within 10 ms, before the fourth had read their greetings.  So :func:`own_group` returns a gloo
group only after a barrier on it, which no member leaves before every member
has finished making the group.

What this cannot reach: the groups the package does not make.  torch's default
group is held by the model's sharded modules and by DDP, so a program whose
model is still alive at exit leaves that group's threads to the teardown, with
the same occasional abort, pipeline or not; dropping the model (and collecting
it) after ``destroy_process_group()`` avoids it.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

logger: logging.Logger = logging.getLogger(__name__)

# How long the exit waits for one of our threads to end before leaving it.
THREAD_JOIN_TIMEOUT_S = 10.0


@dataclass
class _Thread:
    thread: "weakref.ReferenceType[threading.Thread]"
    stop: Callable[[], None]  # asks the thread to end; must not wait


# id(group) -> the group: the package's groups, live.
_groups: Dict[int, dist.ProcessGroup] = {}


class Releases:
    """How many times, in this process, groups left the package's registry
    (released, or found destroyed): a holder of a group that saw the same
    :attr:`count` when it last asked :func:`is_owned` needs no second look."""

    count = 0


# Groups whose owner was collected, released at the next release_orphans();
# weakly, so a group released meanwhile is not kept, nor mistaken for another.
_orphans: List["weakref.ReferenceType[dist.ProcessGroup]"] = []
_threads: List[_Thread] = []
_executors: "weakref.WeakSet[ThreadPoolExecutor]" = weakref.WeakSet()


def own_group(group: dist.ProcessGroup, owner: Optional[object] = None) -> dist.ProcessGroup:
    """Register ``group``, just made by the package, once every member has made it
    (see [Note: a group every member has made]); released at exit, or once
    ``owner`` (if given) has been collected (see [Note: a clean exit]).  Every
    member calls it, in the same order.  Returns ``group``."""
    if dist.get_backend(group) == dist.Backend.GLOO:
        dist.barrier(group=group)
    # Those torch destroyed meanwhile (destroy_process_group() with no argument
    # destroys every group) go now: nothing may use them again.
    for stale in [k for k, g in _groups.items() if not _registered(g)]:
        del _groups[stale]
        Releases.count += 1
    _groups[id(group)] = group
    if owner is not None:
        # Not at exit: release_all() releases it then, in order.
        weakref.finalize(owner, _orphans.append, weakref.ref(group)).atexit = False
    return group


def is_owned(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is one of the package's, not released yet."""
    return _groups.get(id(group)) is group


def release_group(group: dist.ProcessGroup) -> bool:
    """Destroy ``group`` where torch still knows it and drop the registry's
    reference.  Returns whether it was destroyed here."""
    if _groups.get(id(group)) is group:
        del _groups[id(group)]
        Releases.count += 1
    return _destroy(group)


def _registered(group: dist.ProcessGroup) -> bool:
    """Whether torch still knows ``group`` (it was not destroyed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False  # destroyed with its world
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def _destroy(group: dist.ProcessGroup) -> bool:
    if not _registered(group):
        return False
    dist.destroy_process_group(group)
    return True


def release_orphans() -> int:
    """Release the groups whose owner has been collected; how many were destroyed."""
    destroyed = 0
    while _orphans:
        group = _orphans.pop()()
        if group is not None and is_owned(group):
            destroyed += release_group(group)
        del group  # the last reference: its threads are joined here
    return destroyed


def own_thread(thread: threading.Thread, stop: Callable[[], None]) -> None:
    """Register ``thread``; at exit ``stop()`` is called and the thread joined.

    ``stop`` must only signal, and must not hold what owns the thread (a bound
    method of the pipeline would keep it alive)."""
    _threads[:] = [t for t in _threads if _alive(t)]
    _threads.append(_Thread(weakref.ref(thread), stop))


def _alive(entry: _Thread) -> bool:
    thread = entry.thread()
    return thread is not None and (thread.is_alive() or thread.ident is None)


def own_executor(executor: ThreadPoolExecutor, owner: Optional[object] = None) -> None:
    """Register ``executor``; shut down at exit, or without waiting as soon as
    ``owner`` (if given) is collected."""
    _executors.add(executor)
    if owner is not None:
        weakref.finalize(owner, executor.shutdown, wait=False).atexit = False


def release_all() -> Dict[str, int]:
    """Stop the package's threads, shut down its executors and release its groups.

    Runs at interpreter exit; safe to call earlier (a pipeline still using a
    released group then raises) and more than once.  Returns how many of each
    were released.
    """
    threads = [t for t in _threads if _alive(t)]
    _threads.clear()
    for entry in threads:
        entry.stop()
    joined = 0
    for entry in threads:
        thread = entry.thread()
        if thread is None or thread is threading.current_thread() or thread.ident is None:
            continue
        thread.join(THREAD_JOIN_TIMEOUT_S)
        if thread.is_alive():
            logger.warning(
                "trec_pipelines: thread %s did not end within %.0f s at exit; left running",
                thread.name,
                THREAD_JOIN_TIMEOUT_S,
            )
        else:
            joined += 1
    executors = list(_executors)
    _executors.clear()
    for executor in executors:
        executor.shutdown(wait=True, cancel_futures=True)
    _orphans.clear()
    groups = list(_groups.values())
    _groups.clear()
    Releases.count += 1
    destroyed = 0
    while groups:
        try:
            destroyed += _destroy(groups[-1])
        except Exception as error:  # one failure must not keep the others alive
            logger.warning("trec_pipelines: destroying a process group failed: %s", error)
        groups.pop()  # its last reference: its threads are joined here
    return {"threads": joined, "executors": len(executors), "groups": destroyed}


atexit.register(release_all)
