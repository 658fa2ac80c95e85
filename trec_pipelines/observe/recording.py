"""A pipeline's recording: the component behind the recording methods every pipeline has.

A pipeline holds one :class:`Recording` (as ``_recording``) and each of its
recording methods (:class:`~trec_pipelines.observe.recorder.Recordable`) hands
the call to it in one line.  The recording holds the
:class:`~trec_pipelines.observe.recorder.ScheduleRecorder` while recording is
on, and nothing else: what it needs of the pipeline (its streams, device and
name, and the pipeline itself for the memory ledger's walk) is passed in, so
the ledger never walks back into the recording.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, List, Optional, Tuple

import torch

from trec_pipelines.core.streams import current_stream
from trec_pipelines.observe import all_to_all_watch as links, schedule_view
from trec_pipelines.observe.action_records import Action, Transfer
from trec_pipelines.observe.ledger import LedgerSummary, MemoryLedger, MemorySample, summarize
from trec_pipelines.observe.recorder import ScheduleRecorder

_NO_SPAN: ContextManager[None] = contextlib.nullcontext()

# The stream roles of a pipeline's StreamSet a recorder times work on.
_ROLES = ("memcpy", "data_dist", "prefetch", "emb_lookup")


class Recording:
    """What a pipeline recorded: off (``recorder`` None, and free) until enabled."""

    def __init__(self) -> None:
        self.recorder: Optional[ScheduleRecorder] = None

    def enable(self, pipeline: object, memory: bool) -> ScheduleRecorder:
        """Record from the next ``progress()`` call on (``memory``: with the ledger).

        Read of ``pipeline``, where it has them: its ``_streams`` and ``_device``,
        the streams the recorder times; with ``memory`` the ledger walks it.
        """
        if self.recorder is None:
            streams = getattr(pipeline, "_streams", None)
            roles: Dict[str, Optional[torch.Stream]] = {}
            if streams is not None:
                for role in _ROLES:
                    roles[role] = getattr(streams, role, None)
            device = getattr(pipeline, "_device", None)
            if device is not None:
                roles["default"] = current_stream(device)
            self.recorder = ScheduleRecorder(streams=roles)
            links.watch(self.recorder)
        if memory and self.recorder.memory is None:
            ledger = MemoryLedger(pipeline, getattr(pipeline, "_device", None))
            ledger.ignore(self.recorder)
            self.recorder.memory = ledger
        return self.recorder

    def disable(self) -> None:
        """Stop recording, and drop what was recorded."""
        if self.recorder is not None:
            links.unwatch(self.recorder)
        self.recorder = None

    def actions(self) -> List[Action]:
        """The recorded actions, oldest first (empty when recording is off)."""
        if self.recorder is None:
            return []
        self.recorder.resolve()
        return list(self.recorder.actions)

    def transfers(self) -> List[Transfer]:
        """The recorded all-to-alls, oldest first (empty when recording is off)."""
        if self.recorder is None:
            return []
        self.recorder.resolve()
        return list(self.recorder.transfers)

    def schedule(self) -> List[Tuple[str, str, List[Any]]]:
        """The schedule table of the recorded actions."""
        return schedule_view.schedule_table(self.actions())

    def print_schedule(self, n: Optional[int]) -> str:
        """Print (and return) the first ``n`` columns of the schedule table."""
        text = schedule_view.format_schedule(self.schedule(), n)
        print(text)
        return text

    def export_trace(self, path: str) -> None:
        """Write the recorded actions as a Chrome/Perfetto trace to ``path``."""
        schedule_view.write_trace(
            self.actions(), path, memory=self.memory_samples(), transfers=self.transfers()
        )

    def save_timeline(self, pipeline: object, path: str, calls: Optional[Tuple[int, int]]) -> None:
        """Draw the recorded timeline of ``pipeline`` to a PNG at ``path`` (its
        class names it; its ``_device``, where it has one, says whether it ran on CPU)."""
        device = getattr(pipeline, "_device", None)
        schedule_view.draw_timeline(
            self.actions(),
            path,
            calls=calls,
            title=type(pipeline).__name__,
            memory=self.memory_samples(),
            transfers=self.transfers(),
            on_cpu=None if device is None else torch.device(device).type == "cpu",
        )

    def memory_samples(self) -> List[MemorySample]:
        """What the pipeline held after each recorded verb (empty unless ``memory=True``)."""
        recorder = self.recorder
        if recorder is None or recorder.memory is None:
            return []
        return list(recorder.memory.samples)

    def memory_ledger(self) -> LedgerSummary:
        """Peak and steady state of what the pipeline held, by kind."""
        return summarize(self.memory_samples())

    def print_memory(self) -> str:
        """Print (and return) the memory ledger as a table."""
        text = self.memory_ledger().format()
        print(text)
        return text

    def exposed_time(self) -> Dict[str, float]:
        """Seconds the training thread spent in each task, plus ``"step"``: the total."""
        recorder = self.recorder
        return schedule_view.exposed_time(
            self.actions(), [] if recorder is None else recorder.call_starts
        )

    def begin_call(self) -> None:
        """Mark the start of a ``progress()`` call."""
        if self.recorder is not None:
            self.recorder.begin_call()

    def span(
        self, task: str, batch: Optional[int], stream: str = "default", thread: str = "main"
    ) -> ContextManager[None]:
        """A span around a verb's work (nothing while recording is off)."""
        recorder = self.recorder
        if recorder is not None:
            return recorder.span(task, batch, stream, thread)
        if torch.autograd.profiler._is_profiler_enabled:  # a profiler labels the work
            return torch.profiler.record_function(f"trec_pipelines::{task}")
        return _NO_SPAN
