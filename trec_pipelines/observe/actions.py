"""The record of one verb as it ran: what the recorder writes and the views read.

It lives apart from :mod:`trec_pipelines.observe.recorder` so that
:mod:`trec_pipelines.observe.schedule_view`, which the recorder calls, can name it
without importing the recorder back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class Action:
    """One verb as it ran.

    Attributes:
        call: which ``progress()`` call issued it (0 for the first, fill included).
        task: the task name (``H2D``, ``Forward``, ...).
        batch: the index of the batch it worked on (order of loading, from 0).
        stream: the stream role it was issued to (``default``, ``memcpy``, ...).
        thread: "main", or "loader" for work done by a background loading thread.
        cpu_start: when the issuing thread entered it (``time.perf_counter()`` seconds).
        cpu_end: when the issuing thread left it.
        device_start: when it started on its stream (same clock), or None until
            resolved (CUDA events are read once the work has finished).
        device_end: when it finished on its stream, or None until resolved.
    """

    call: int
    task: str
    batch: Optional[int]
    stream: str
    thread: str = "main"
    cpu_start: float = 0.0
    cpu_end: float = 0.0
    device_start: Optional[float] = None
    device_end: Optional[float] = None

    def __str__(self) -> str:
        batch = "--" if self.batch is None else f"i{self.batch}"
        return f"P{self.call} {self.task}[{batch}]@{self.stream}"
