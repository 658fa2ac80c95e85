"""This process's threads by their OS name, C++ threads included (Linux only)."""

import os
from typing import Set


def thread_ids_named(name: str) -> Set[int]:
    """The ids of this process's threads the OS names ``name`` (``/proc/self/task/*/comm``).

    A thread that ends while it is being read is not listed; one that has been
    joined may still be, for as long as the kernel takes to remove it, so compare
    the ids of the threads a test made, not counts that include what an earlier
    test's groups left ending.  Raises ``OSError`` where the process's threads
    cannot be listed (no ``/proc``: not Linux).
    """
    ids = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().strip() == name:
                    ids.add(int(task))
        except OSError:  # the thread ended meanwhile (ENOENT, or ESRCH mid-exit)
            pass
    return ids


def threads_named(name: str) -> int:
    """How many of this process's threads the OS names ``name`` (see :func:`thread_ids_named`)."""
    return len(thread_ids_named(name))
