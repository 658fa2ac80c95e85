"""The memory ledger: what a pipeline held after each recorded action.

Turned on with ``pipeline.enable_schedule_recording(memory=True)``; the
schedule recorder then calls :meth:`MemoryLedger.sample` as each verb ends,
which measures (:func:`~trec_pipelines.observe.memory.footprint`) the pipeline object
together with the local variables of its running methods (the batch a step
trains lives in ``progress()``'s frame, not in an attribute).  Off, it costs
nothing: the recorder holds no ledger and spans don't check for one.

``pipeline.memory_ledger()`` summarises the samples (:class:`LedgerSummary`),
``pipeline.print_memory()`` prints them as a table, and the timeline picture
gains a memory track.
"""

from __future__ import annotations

import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set

import torch

from trec_pipelines.observe.memory import (
    KINDS,
    PLACES,
    DeviceMemory,
    Footprint,
    StorageKey,
    device_memory,
    footprint,
    format_bytes,
    owned_storages,
    pipeline_frames,
)


@dataclass(frozen=True)
class MemorySample:
    """The pipeline's holdings right after one action.

    Attributes:
        call: the action's ``progress()`` call (as :attr:`trec_pipelines.Action.call`).
        task: the action's task name.
        batch: the index of the batch it worked on, or None.
        stream: the stream role it was issued to.
        time: ``perf_counter()`` when measured (the action's end).
        held: what the pipeline held.
        device: the device allocator's counters, on a device that has them.
    """

    call: int
    task: str
    batch: Optional[int]
    stream: str
    time: float
    held: Footprint
    device: Optional[DeviceMemory] = None

    def __str__(self) -> str:
        batch = "--" if self.batch is None else f"i{self.batch}"
        return f"P{self.call} {self.task}[{batch}]@{self.stream}"


@dataclass(frozen=True)
class LedgerSummary:
    """Peak and steady state of a ledger's samples.

    Attributes:
        peak_bytes: the largest total held after any action.
        peak_by_kind: the breakdown at that moment.
        peak_at: the action after which it was held, e.g. ``P2 H2D[i4]@memcpy``.
        steady_bytes: the median over ``progress()`` calls of each call's
            largest total, leaving out the first call (the fill) and, with
            three calls or more, the last (a drain, when the data ended).
        steady_by_kind: the breakdown at that moment.
        max_by_kind: each kind's own largest value over all samples.
        max_batches: most batches in flight after any action.
        device_max_allocated: the device allocator's peak of allocated bytes at
            the last sample (None on CPU).
        device_max_reserved: its peak of reserved bytes then (None on CPU).
        samples: how many actions were measured.
        peak_by_place: the breakdown at the peak by place: host batches, device
            batches, then the other kinds (see ``[Note: memory places]``).
        steady_by_place: the same at the steady-state moment.
        max_by_place: each place's own largest value over all samples.
        max_host_batches: most host batches (pulled, not yet copied) after any action.
        max_device_batches: most device batches after any action.
    """

    peak_bytes: int
    peak_by_kind: Dict[str, int]
    peak_at: str
    steady_bytes: int
    steady_by_kind: Dict[str, int]
    max_by_kind: Dict[str, int]
    max_batches: int
    device_max_allocated: Optional[int]
    device_max_reserved: Optional[int]
    samples: int
    peak_by_place: Dict[str, int]
    steady_by_place: Dict[str, int]
    max_by_place: Dict[str, int]
    max_host_batches: int
    max_device_batches: int

    def format(self) -> str:
        lines = [
            f"{'place/kind':<12} {'at peak':>12} {'steady':>12} {'own max':>12}",
            " ".join("-" * 12 for _ in range(4)),
        ]
        for place in PLACES:
            lines.append(
                f"{place:<12} {format_bytes(self.peak_by_place.get(place, 0)):>12} "
                f"{format_bytes(self.steady_by_place.get(place, 0)):>12} "
                f"{format_bytes(self.max_by_place.get(place, 0)):>12}"
            )
        lines.append(
            f"{'total':<12} {format_bytes(self.peak_bytes):>12} {format_bytes(self.steady_bytes):>12}"
        )
        lines.append(
            f"peak after {self.peak_at}; at most {self.max_batches} batch(es) in flight "
            f"(at most {self.max_host_batches} on the host, pulled and not yet copied; "
            f"{self.max_device_batches} on the device); {self.samples} action(s) measured"
        )
        if self.device_max_allocated is not None:
            lines.append(
                f"device allocator: max allocated {format_bytes(self.device_max_allocated)}, "
                f"max reserved {format_bytes(self.device_max_reserved)}"
            )
        return "\n".join(lines)


class MemoryLedger:
    """Measures a pipeline after each recorded action (see the module docstring)."""

    def __init__(self, pipeline: object, device: Optional[torch.device] = None) -> None:
        # Any object can be measured: footprint() walks it, leaving out its
        # ``_model`` and ``_optimizer`` where it has them.  Weak: the pipeline
        # owns the recorder that owns this ledger.
        self._pipeline = weakref.ref(pipeline)
        self._device = device
        self._skip: Set[StorageKey] = set()
        self._skip_call: Optional[int] = None  # the call the skip set was taken in
        self._skip_objects: List[Any] = [self]
        self.samples: List[MemorySample] = []

    def ignore(self, *objects: Any) -> None:
        """Never walk into ``objects`` (the recorder that holds this ledger)."""
        self._skip_objects += list(objects)

    def measure(self) -> Footprint:
        """What the pipeline holds now, its running methods' locals included."""
        pipeline = self._pipeline()
        if pipeline is None:
            return Footprint({k: 0 for k in KINDS}, 0, 0)
        frames = pipeline_frames(pipeline, sys._getframe(1))
        return footprint(pipeline, self._skip, frames, self._skip_objects)

    def _refresh_skip(self, call: int) -> None:
        # Once per progress() call: optimizers create their state lazily, and the
        # model or optimizer may be swapped (attach) between calls.
        pipeline = self._pipeline()
        if call == self._skip_call or pipeline is None:
            return
        self._skip_call = call
        self._skip = owned_storages(
            getattr(pipeline, "_model", None), getattr(pipeline, "_optimizer", None)
        )

    def sample(self, call: int, task: str, batch: Optional[int], stream: str) -> None:
        """Measure after the action ``task`` of ``batch`` ended."""
        self._refresh_skip(call)
        held = self.measure()
        self.samples.append(
            MemorySample(
                call, task, batch, stream, time.perf_counter(), held, device_memory(self._device)
            )
        )

    def clear(self) -> None:
        self.samples.clear()

    def summary(self) -> LedgerSummary:
        return summarize(self.samples)


def summarize(samples: List[MemorySample]) -> LedgerSummary:
    """Peak and steady state of ``samples`` (see :class:`LedgerSummary`)."""
    if not samples:
        raise ValueError(
            "no memory samples: call enable_schedule_recording(memory=True) before progress()"
        )
    peak = max(samples, key=lambda s: s.held.total)
    per_call: Dict[int, MemorySample] = {}
    for sample in samples:
        top = per_call.get(sample.call)
        if top is None or sample.held.total > top.held.total:
            per_call[sample.call] = sample
    calls = sorted(per_call)
    steady_calls = calls[1:-1] if len(calls) >= 3 else calls[1:] or calls
    tops = sorted((per_call[c] for c in steady_calls), key=lambda s: s.held.total)
    steady = tops[(len(tops) - 1) // 2]  # the lower median: a moment that really happened
    max_by_kind = {kind: max(s.held.bytes_by_kind[kind] for s in samples) for kind in KINDS}
    max_by_place = {p: max(s.held.bytes_by_place[p] for s in samples) for p in PLACES}
    last_device = samples[-1].device
    return LedgerSummary(
        peak_bytes=peak.held.total,
        peak_by_kind=dict(peak.held.bytes_by_kind),
        peak_at=str(peak),
        steady_bytes=steady.held.total,
        steady_by_kind=dict(steady.held.bytes_by_kind),
        max_by_kind=max_by_kind,
        max_batches=max(s.held.batches for s in samples),
        device_max_allocated=None if last_device is None else last_device.max_allocated,
        device_max_reserved=None if last_device is None else last_device.max_reserved,
        samples=len(samples),
        peak_by_place=peak.held.bytes_by_place,
        steady_by_place=steady.held.bytes_by_place,
        max_by_place=max_by_place,
        max_host_batches=max(s.held.host_batches for s in samples),
        max_device_batches=max(s.held.device_batches for s in samples),
    )


__all__ = ["LedgerSummary", "MemoryLedger", "MemorySample", "summarize"]
