"""Time limits for a block of a test that could hang, shared by the tiers.

* :func:`time_limit` raises ``TimeoutError`` in the main thread when the block
  overruns: for a block that comes back to Python now and then (a loop of
  steps, each collective of which has its process group's timeout).
* :func:`exit_after` dumps every thread's stack and ends the process: for a
  block that may wait where no Python code runs, so no exception could reach
  it (a loader thread that never hands over a batch, a wait in C).

Size a limit for a loaded machine (two busy cores): it is a hang guard, never
a speed check.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
from typing import Any, Iterator


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Fail the test (TimeoutError) if the block takes longer than ``seconds``."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"over the test's time limit of {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def exit_after(seconds: int) -> Iterator[None]:
    """End the process, its threads' stacks dumped, if the block takes longer than
    ``seconds``."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
