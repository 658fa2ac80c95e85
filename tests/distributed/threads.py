"""This process's threads by their OS name, C++ threads included (Linux only)."""

import os


def threads_named(name: str) -> int:
    """How many of this process's threads the OS names ``name`` (``/proc/self/task/*/comm``).

    A thread that ends while it is being read is not counted.  Raises ``OSError``
    where the process's threads cannot be listed (no ``/proc``: not Linux).
    """
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().strip() == name
        except OSError:  # the thread ended meanwhile (ENOENT, or ESRCH mid-exit)
            pass
    return count
