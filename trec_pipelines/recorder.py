"""The schedule recorder: what each ``progress()`` call actually did, as data.

Every pipeline verb opens a :meth:`ScheduleRecorder.span` with its task name,
the index of the batch it works on and the stream it issues to.  Recording is
off by default; a pipeline then hands out one shared no-op context manager, so
the cost is a ``None`` check per verb.

Tests assert the exact list of :class:`Action` records per variant (fill,
steady state and drain), with no GPU and no process group.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import ContextManager, List, Optional

# Task names, one per verb a schedule is built from.
H2D = "H2D"
INPUT_DIST_START = "InputDistStart"
INPUT_DIST_WAIT = "InputDistWait"
EMB_LOOKUP = "EmbLookup"
EMB_PREFETCH = "EmbPrefetch"
ZERO_GRAD = "ZeroGrad"
WAIT_BATCH = "WaitBatch"
FORWARD = "Forward"
BACKWARD = "Backward"
EMB_BACKWARD = "EmbBackward"
OPTIMIZER_STEP = "OptimizerStep"

_NO_SPAN: ContextManager[None] = contextlib.nullcontext()


@dataclass(frozen=True)
class Action:
    """One verb as it ran.

    Attributes:
        call: which ``progress()`` call issued it (0 for the first, fill included).
        task: the task name (``H2D``, ``Forward``, ...).
        batch: the index of the batch it worked on (order of loading, from 0).
        stream: the stream role it was issued to (``default``, ``memcpy``, ...).
    """

    call: int
    task: str
    batch: Optional[int]
    stream: str

    def __str__(self) -> str:
        batch = "--" if self.batch is None else f"i{self.batch}"
        return f"P{self.call} {self.task}[{batch}]@{self.stream}"


@dataclass
class ScheduleRecorder:
    """Collects :class:`Action` records; a pipeline owns at most one."""

    actions: List[Action] = field(default_factory=list)
    call: int = -1

    def begin_call(self) -> None:
        """Mark the start of a ``progress()`` call."""
        self.call += 1

    def span(self, task: str, batch: Optional[int], stream: str) -> ContextManager[None]:
        """Record ``task`` for ``batch`` on ``stream``; usable as ``with``."""
        self.actions.append(Action(max(self.call, 0), task, batch, stream))
        return _NO_SPAN

    def clear(self) -> None:
        self.actions.clear()
        self.call = -1


class Recordable:
    """Gives a pipeline the recording switch and the ``_span`` hook its verbs use."""

    _recorder: Optional[ScheduleRecorder] = None

    def enable_schedule_recording(self) -> ScheduleRecorder:
        """Start recording every verb from the next ``progress()`` call on."""
        if self._recorder is None:
            self._recorder = ScheduleRecorder()
        return self._recorder

    def disable_schedule_recording(self) -> None:
        self._recorder = None

    @property
    def schedule_actions(self) -> List[Action]:
        """The recorded actions, oldest first (empty when recording is off)."""
        return [] if self._recorder is None else list(self._recorder.actions)

    def _begin_call(self) -> None:
        if self._recorder is not None:
            self._recorder.begin_call()

    def _span(self, task: str, batch: Optional[int], stream: str = "default") -> ContextManager[None]:
        recorder = self._recorder
        if recorder is None:
            return _NO_SPAN
        return recorder.span(task, batch, stream)
