"""The schedule recorder: what each ``progress()`` call actually did, as data.

Every pipeline verb opens a span, ``with self._recording.span(task, batch, stream):``,
naming the task, the index of the batch it works on and the stream role it
issues to.  Recording is off by default; a span then costs one ``None`` check
(plus a ``torch.profiler.record_function`` label while a PyTorch profiler is
running, so profiles show the same task names).

With recording on, each span becomes an :class:`Action` with its ``progress()``
call number and timing:

* ``cpu_start``/``cpu_end``: wall time the training thread spent in the verb
  (the task's *exposed* time: the thread was busy with it or blocked on it);
* ``device_start``/``device_end``: when the work ran on its stream, from
  events on CUDA; on CPU, where work runs as it is issued, the wall times.

It also notes each all-to-all the pipeline puts on the link as a
:class:`Transfer`, from its issue to the completion of its work, under the
verb (and batch) it was issued in (see :mod:`trec_pipelines.observe.all_to_all_watch`).

:mod:`trec_pipelines.observe.schedule_view` turns the actions into the schedule table,
a Chrome/Perfetto trace and a timeline picture.

With ``enable_schedule_recording(memory=True)`` the recorder also keeps a
:class:`~trec_pipelines.observe.ledger.MemoryLedger`: after each verb of the training
thread it measures the tensor storage the pipeline holds (see
:mod:`trec_pipelines.observe.memory`).  That walk takes far longer than the verb's
bookkeeping, so timings recorded with it on are not representative.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol, Tuple, runtime_checkable

import torch

from trec_pipelines.core.streams import current_stream, device_module
from trec_pipelines.observe.action_records import (
    Action as Action,  # also importable from here, its former home
    Transfer,
)
from trec_pipelines.observe.ledger import LedgerSummary, MemoryLedger, MemorySample

# Re-exported: the pipelines name the tasks rec.H2D, rec.FORWARD, ...
from trec_pipelines.observe.task_names import (
    BACKWARD as BACKWARD,
    EMB_BACKWARD as EMB_BACKWARD,
    EMB_LOOKUP as EMB_LOOKUP,
    EMB_PREFETCH as EMB_PREFETCH,
    FORWARD as FORWARD,
    H2D as H2D,
    INPUT_DIST_START as INPUT_DIST_START,
    INPUT_DIST_WAIT as INPUT_DIST_WAIT,
    NOL_GRAD_APPLY as NOL_GRAD_APPLY,
    NOL_GRAD_START as NOL_GRAD_START,
    NOL_LOOKUP as NOL_LOOKUP,
    OL_GRAD_APPLY as OL_GRAD_APPLY,
    OL_GRAD_START as OL_GRAD_START,
    OL_LOOKUP as OL_LOOKUP,
    OPT_STASH as OPT_STASH,
    OPTIMIZER_STEP as OPTIMIZER_STEP,
    OVERLAP_DIST as OVERLAP_DIST,
    STASH_RESTORE as STASH_RESTORE,
    STASH_WAIT as STASH_WAIT,
    TASKS as TASKS,
    WAIT_BATCH as WAIT_BATCH,
    ZERO_GRAD as ZERO_GRAD,
)


@dataclass
class ScheduleRecorder:
    """Collects :class:`Action` records; a pipeline owns at most one.

    ``streams`` maps a stream role to the device stream, so that on CUDA each
    span also records events on the stream its work went to.
    """

    streams: Dict[str, Optional[torch.Stream]] = field(default_factory=dict)
    actions: List[Action] = field(default_factory=list)
    call: int = -1
    call_starts: List[float] = field(default_factory=list)
    _pending: List[Tuple[Action, Any, Any]] = field(default_factory=list, repr=False, init=False)
    _origin: Optional[Tuple[float, Any]] = field(default=None, repr=False, init=False)
    # Measures the pipeline after each training-thread verb; None: not asked for.
    memory: Optional[MemoryLedger] = field(default=None, repr=False)
    # The all-to-alls put on the link (trec_pipelines.observe.all_to_all_watch).
    transfers: List[Transfer] = field(default_factory=list)
    # The spans open now, innermost last, per thread.
    _open: Dict[int, List[Action]] = field(default_factory=dict, repr=False, init=False)
    # A device transfer's [start event, end event or None], until resolved.
    _transfer_events: Dict[int, Tuple[Transfer, List[Any]]] = field(
        default_factory=dict, repr=False, init=False
    )

    def begin_call(self) -> None:
        """Mark the start of a ``progress()`` call."""
        self.call += 1
        self.call_starts.append(time.perf_counter())

    def span(self, task: str, batch: Optional[int], stream: str, thread: str = "main") -> "_Span":
        """Record ``task`` for ``batch`` on ``stream`` around the enclosed work."""
        action = Action(max(self.call, 0), task, batch, stream, thread)
        self.actions.append(action)
        return _Span(self, action, self.streams.get(stream))

    def enclosing(self) -> Optional[Action]:
        """The verb an all-to-all issued now belongs to: the innermost span open
        on this thread, else the latest opened on another (on CUDA, backward's
        all-to-alls are issued by autograd's thread while ``Backward`` is open)."""
        mine = self._open.get(threading.get_ident())
        if mine:
            return mine[-1]
        others = [stack[-1] for stack in list(self._open.values()) if stack]
        return max(others, key=lambda a: a.cpu_start) if others else None

    def note_transfer(
        self, group: str, nbytes: int, issued: float, device: torch.device
    ) -> Transfer:
        """Record an all-to-all being issued now (its completion is stamped later)."""
        verb = self.enclosing()
        transfer = Transfer(
            max(self.call, 0),
            None if verb is None else verb.task,
            None if verb is None else verb.batch,
            group,
            nbytes,
            issued,
        )
        self.transfers.append(transfer)
        if device.type != "cpu":
            start = self._event(current_stream(device))
            if start is not None:
                self._transfer_events[id(transfer)] = (transfer, [start, None])
        return transfer

    def end_transfer_on(self, transfer: Transfer, stream: Optional[torch.Stream]) -> None:
        """Record ``transfer``'s end on ``stream``, which waits for its collective."""
        entry = self._transfer_events.get(id(transfer))
        if entry is not None and stream is not None:
            entry[1][1] = self._event(stream)

    def _event(self, stream: Optional[torch.Stream]) -> Any:
        if stream is None:
            return None
        # Timing events: resolve() reads the time between them.
        event = device_module(stream.device).Event(enable_timing=True)
        event.record(stream)
        if self._origin is None:
            # Device times are measured from this event, placed at "now" on the CPU clock.
            self._origin = (time.perf_counter(), event)
        return event

    def resolve(self) -> None:
        """Turn recorded CUDA events into device times (waits for the work)."""
        if self._origin is None:
            return
        origin_time, origin_event = self._origin

        def time_of(event: Any) -> float:
            event.synchronize()
            return origin_time + float(origin_event.elapsed_time(event)) / 1e3

        for action, start, end in self._pending:
            action.device_start, action.device_end = time_of(start), time_of(end)
        self._pending.clear()
        for key, (transfer, (start, end)) in list(self._transfer_events.items()):
            if end is None:
                continue  # not completed yet: resolved by a later call
            transfer.issued, transfer.completed = time_of(start), time_of(end)
            del self._transfer_events[key]

    def clear(self) -> None:
        """Drop what was recorded; the next ``progress()`` is call 0 again."""
        self.actions.clear()
        self.call_starts.clear()
        self._pending.clear()
        self.transfers.clear()
        self._transfer_events.clear()
        self.call = -1
        if self.memory is not None:
            self.memory.clear()


class _Span:
    """Times one action: wall clock on the issuing thread, events on its stream."""

    __slots__ = ("_recorder", "_action", "_stream", "_start_event", "_label")

    def __init__(
        self, recorder: ScheduleRecorder, action: Action, stream: Optional[torch.Stream]
    ) -> None:
        self._recorder = recorder
        self._action = action
        self._stream = stream
        self._start_event: Any = None
        self._label: Any = None

    def __enter__(self) -> None:
        self._recorder._open.setdefault(threading.get_ident(), []).append(self._action)
        self._start_event = self._recorder._event(self._stream)
        if torch.autograd.profiler._is_profiler_enabled:  # a profiler labels the span
            self._label = torch.profiler.record_function(f"trec_pipelines::{self._action.task}")
            self._label.__enter__()
        self._action.cpu_start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        action = self._action
        action.cpu_end = time.perf_counter()
        open_spans = self._recorder._open.get(threading.get_ident())
        if open_spans and open_spans[-1] is action:
            open_spans.pop()
        if self._label is not None:
            self._label.__exit__(*exc)
        if self._start_event is None:
            action.device_start, action.device_end = action.cpu_start, action.cpu_end
        else:
            self._recorder._pending.append(
                (action, self._start_event, self._recorder._event(self._stream))
            )
        ledger = self._recorder.memory
        # A loader thread's verbs are not measured: walking the pipeline from
        # there would race with the training thread changing it.
        if ledger is not None and action.thread == "main":
            ledger.sample(action.call, action.task, action.batch, action.stream)


@runtime_checkable
class Recordable(Protocol):
    """The recording methods every pipeline has: each verb a ``progress()`` ran,
    on which stream, for which batch, with its timing and, with ``memory=True``,
    what the pipeline held after it.

    Off by default, and free then.  See "Seeing the schedule" in
    :doc:`the variants guide </guides/variants>` and :doc:`the memory guide </guides/memory>`.
    Every pipeline has these methods (``isinstance(pipeline, Recordable)`` is
    True); it holds a :class:`~trec_pipelines.observe.recording.Recording` and
    each method hands the call to it.
    """

    def enable_schedule_recording(self, memory: bool = False) -> ScheduleRecorder:
        """Record every verb, with timing, from the next ``progress()`` call on.

        ``memory=True`` also measures, after each verb, the tensor storage the
        pipeline holds (:meth:`memory_ledger`); it slows every verb down.
        """

    def disable_schedule_recording(self) -> None:
        """Stop recording, and drop what was recorded."""

    @property
    def schedule_actions(self) -> List[Action]:
        """The recorded actions, oldest first (empty when recording is off)."""

    @property
    def schedule_transfers(self) -> List[Transfer]:
        """The all-to-alls the recorded verbs put on the link, oldest first
        (empty when recording is off); ``completed`` is None for one still in flight."""

    def schedule(self) -> List[Tuple[str, str, List[Any]]]:
        """The schedule table: one ``(task, stream, cells)`` row per task.

        ``cells[k]`` is the batch index the task handled in ``progress()`` call
        ``k`` (a tuple when it handled several, as in the fill), or None.
        """

    def print_schedule(self, n: Optional[int] = None) -> str:
        """Print (and return) the first ``n`` columns of :meth:`schedule`."""

    def export_trace(self, path: str) -> None:
        """Write a Chrome/Perfetto trace: one track per stream plus the CPU thread
        (and a counter of what the pipeline held, when the memory ledger is on)."""

    def save_timeline(self, path: str, calls: Optional[Tuple[int, int]] = None) -> None:
        """Draw the recorded timeline (streams x time) to a PNG: a lane per
        stream, one for the CPU thread, one per process group for the link, and
        a memory track when the memory ledger is on."""

    @property
    def memory_samples(self) -> List[MemorySample]:
        """What the pipeline held after each recorded verb (empty unless ``memory=True``)."""

    def memory_ledger(self) -> LedgerSummary:
        """Peak and steady state of what the pipeline held, by kind (see :mod:`trec_pipelines.observe.ledger`)."""

    def print_memory(self) -> str:
        """Print (and return) :meth:`memory_ledger` as a table."""

    def exposed_time(self) -> Dict[str, float]:
        """Seconds the training thread spent in each task, plus ``"step"``: the total."""
