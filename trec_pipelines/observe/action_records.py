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


@dataclass
class Transfer:
    """One all-to-all a recorded pipeline put on the link.

    Attributes:
        call: the ``progress()`` call it was issued in.
        task: the verb it was issued in (``InputDistStart``: the splits;
            ``InputDistWait``: the ids; ``Forward``: the embeddings;
            ``Backward``: their gradients), or None outside every verb.
        batch: the batch of that verb, or None.
        group: ``"input-dist group"`` when it ran on a dedicated input-dist
            process group, else ``"model group"``.
        nbytes: the bytes this rank sent in it.
        issued: seconds (``time.perf_counter``) when it was issued; on CUDA,
            when its stream reached it.
        completed: seconds when its work completed, or None if it had not
            (yet) when read.  Issue to completion includes the time it queued
            behind earlier collectives of the same group.
    """

    call: int
    task: Optional[str]
    batch: Optional[int]
    group: str
    nbytes: int
    issued: float
    completed: Optional[float] = None

    def __str__(self) -> str:
        batch = "--" if self.batch is None else f"i{self.batch}"
        return f"P{self.call} all-to-all[{batch}] in {self.task or '--'} on the {self.group}"
