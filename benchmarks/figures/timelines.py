"""The timeline pictures: what a recorded epoch's timeline is drawn from, stored as JSON, and its drawing.

:func:`timeline_json` turns a recorded epoch's actions and transfers into plain
JSON (stored in ``results.json``), :func:`draw_stored` draws it, and
:func:`redraw_timelines` draws every timeline a ``results.json`` stores again
(``python -m benchmarks replot``).  The epoch itself is recorded by
:mod:`benchmarks.running.recording`.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from trec_pipelines.observe import schedule_view
from trec_pipelines.observe.action_records import Action, Transfer

# The progress() calls a timeline draws: past the fill, into the steady state.
TIMELINE_CALLS: Tuple[int, int] = (2, 5)


def picture_name(variant: str, batch_size: int) -> str:
    """The timeline's file name: ``"X [shared]"`` at batch 512 -> ``X_shared_b512.png``."""
    return f"{variant.replace(' [', '_').replace(']', '')}_b{batch_size}.png"


def timeline_json(
    actions: Sequence[Action],
    transfers: Sequence[Transfer],
    origin: float,
    on_cpu: bool,
    calls: Tuple[int, int] = TIMELINE_CALLS,
) -> Dict[str, Any]:
    """What a timeline is drawn from, as plain JSON (seconds from ``origin``).

    ``actions``: ``[call, task, batch, stream, thread, cpu_start, cpu_end,
    device_start, device_end]``; ``transfers``: ``[call, task, batch, group,
    bytes, issued, completed]`` (a device time or ``completed`` may be null);
    ``calls``: the window drawn; ``on_cpu``: recorded on CPU.
    """

    def rel(t: Optional[float]) -> Optional[float]:
        return None if t is None else round(t - origin, 7)  # to 0.1 us: enough to draw

    return {
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


def draw_stored(stored: Dict[str, Any], path: str, title: str) -> None:
    """Draw the timeline :func:`timeline_json` stored to the PNG ``path``."""
    actions, transfers = timeline_from_json(stored)
    first, last = stored["calls"]
    schedule_view.draw_timeline(
        actions,
        path,
        calls=(first, last),
        title=title,
        transfers=transfers,
        on_cpu=stored["on_cpu"],
    )


def redraw_timelines(results: Dict[str, Any], out_dir: str) -> List[str]:
    """Draw again every timeline a ``results.json`` (loaded) stores, into ``out_dir``.

    Returns the paths written, named as the run named them; a recorded epoch
    stored without its timeline (a run from before timelines were stored) is
    skipped.
    """
    written: List[str] = []
    blocks = (results.get("raw") or {}).get("throughput") or []
    for block in blocks:
        for variant, ranks in (block.get("recorded") or {}).items():
            stored = next((r["timeline"] for r in ranks if r and r.get("timeline")), None)
            if stored is None:
                continue
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, picture_name(variant, block["batch_size"]))
            draw_stored(stored, path, timeline_title(variant, block["batch_size"]))
            written.append(path)
    return written


def timeline_title(variant: str, batch_size: int) -> str:
    """A timeline's title: the variant and its batch size."""
    return (
        f"{variant}, batch {batch_size}: progress() calls {TIMELINE_CALLS[0]}..{TIMELINE_CALLS[1]}"
    )


__all__ = [
    "TIMELINE_CALLS",
    "draw_stored",
    "picture_name",
    "redraw_timelines",
    "timeline_from_json",
    "timeline_json",
    "timeline_title",
]
