"""A recorded timeline as plain JSON: what its picture is drawn from, stored in ``results.json``.

:func:`timeline_json` stores a recorded epoch's actions and transfers (and,
for the memory figures, the memory ledger's samples); :func:`timeline_from_json`
and :func:`memory_from_json` read them back, so a picture can be drawn again
from a results folder (:mod:`benchmarks.figures.timelines`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from trec_pipelines.observe.action_records import Action, Transfer
from trec_pipelines.observe.ledger import MemorySample
from trec_pipelines.observe.memory import DeviceMemory, Footprint

# The progress() calls a timeline draws: past the fill, into the steady state.
TIMELINE_CALLS: Tuple[int, int] = (2, 5)


def timeline_json(
    actions: Sequence[Action],
    transfers: Sequence[Transfer],
    origin: float,
    on_cpu: bool,
    calls: Tuple[int, int] = TIMELINE_CALLS,
    memory: Sequence[MemorySample] = (),
) -> Dict[str, Any]:
    """What a timeline is drawn from, as plain JSON (seconds from ``origin``).

    ``actions``: ``[call, task, batch, stream, thread, cpu_start, cpu_end,
    device_start, device_end]``; ``transfers``: ``[call, task, batch, group,
    bytes, issued, completed]`` (a device time or ``completed`` may be null);
    ``calls``: the window drawn; ``on_cpu``: recorded on CPU; ``memory``: the
    memory ledger's samples, stored under ``"memory"`` when there are any
    (``[call, task, batch, stream, time, bytes_by_kind, storages, batches,
    host_batch_bytes, host_batches, device]``, ``device`` null or
    ``[allocated, max_allocated, max_reserved]``).
    """

    def rel(t: Optional[float]) -> Optional[float]:
        return None if t is None else round(t - origin, 7)  # to 0.1 us: enough to draw

    stored: Dict[str, Any] = {
        "on_cpu": on_cpu,
        "calls": list(calls),
        "actions": [
            [
                a.call,
                a.task,
                a.batch,
                a.stream,
                a.thread,
                rel(a.cpu_start),
                rel(a.cpu_end),
                rel(a.device_start),
                rel(a.device_end),
            ]
            for a in actions
        ],
        "transfers": [
            [t.call, t.task, t.batch, t.group, t.nbytes, rel(t.issued), rel(t.completed)]
            for t in transfers
        ],
    }
    if memory:
        stored["memory"] = [_sample_json(m, rel) for m in memory]
    return stored


def timeline_from_json(stored: Dict[str, Any]) -> Tuple[List[Action], List[Transfer]]:
    """The actions and transfers :func:`timeline_json` stored."""
    actions = [
        Action(call, task, batch, stream, thread, cpu_start, cpu_end, device_start, device_end)
        for call, task, batch, stream, thread, cpu_start, cpu_end, device_start, device_end in stored[
            "actions"
        ]
    ]
    transfers = [Transfer(*row) for row in stored["transfers"]]
    return actions, transfers


def _sample_json(sample: MemorySample, rel: Any) -> List[Any]:
    held, device = sample.held, sample.device
    return [
        sample.call,
        sample.task,
        sample.batch,
        sample.stream,
        rel(sample.time),
        dict(held.bytes_by_kind),
        held.storages,
        held.batches,
        held.host_batch_bytes,
        held.host_batches,
        None if device is None else [device.allocated, device.max_allocated, device.max_reserved],
    ]


def memory_from_json(stored: Dict[str, Any]) -> List[MemorySample]:
    """The memory ledger's samples :func:`timeline_json` stored (none if it stored none)."""
    samples: List[MemorySample] = []
    for row in stored.get("memory") or []:
        call, task, batch, stream, time, by_kind, storages, batches, host_bytes, host_n, dev = row
        held = Footprint(
            bytes_by_kind=dict(by_kind),
            storages=storages,
            batches=batches,
            host_batch_bytes=host_bytes,
            host_batches=host_n,
        )
        device: Optional[DeviceMemory] = None if dev is None else DeviceMemory(*dev)
        samples.append(MemorySample(call, task, batch, stream, time, held, device))
    return samples


__all__ = ["TIMELINE_CALLS", "memory_from_json", "timeline_from_json", "timeline_json"]
