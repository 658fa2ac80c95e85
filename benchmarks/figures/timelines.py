"""The timeline pictures: each variant's recorded epoch, and its memory figure (with the memory track).

:func:`draw_stored` draws a timeline stored as JSON
(:mod:`benchmarks.measuring.timeline_store`); :func:`redraw_timelines` and
:func:`redraw_memory_timelines` draw every timeline and every memory figure a
``results.json`` stores again (``python -m benchmarks replot``).  The epoch itself is recorded by
:mod:`benchmarks.running.recording`.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

from benchmarks.measuring.timeline_store import (
    TIMELINE_CALLS,
    memory_from_json,
    timeline_from_json,
)
from trec_pipelines.observe import schedule_view


def picture_name(variant: str, batch_size: int) -> str:
    """The timeline's file name: ``"X [shared]"`` at batch 512 -> ``X_shared_b512.png``."""
    return f"{variant.replace(' [', '_').replace(']', '')}_b{batch_size}.png"


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
        memory=memory_from_json(stored),
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


def memory_picture_name(variant: str, batch_size: int) -> str:
    """The memory figure's file name: ``memory_<Variant>_b<batch>.png``."""
    return f"memory_{variant}_b{batch_size}.png"


def redraw_memory_timelines(results: Dict[str, Any], out_dir: str) -> List[str]:
    """Draw again every memory figure a ``results.json`` (loaded) stores, into ``out_dir``.

    A memory figure is the ledger epoch of one of ours with its memory track,
    stored by rank 0 under ``"memory_timeline"`` (a run from before they were
    stored has none: its pictures are skipped).
    """
    written: List[str] = []
    for block in (results.get("raw") or {}).get("throughput") or []:
        for entry in (block.get("memory") or {}).values():
            stored = next(
                (
                    r["memory_timeline"]
                    for r in entry.get("ranks") or []
                    if r and r.get("memory_timeline")
                ),
                None,
            )
            if stored is None:
                continue
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(
                out_dir, memory_picture_name(stored["variant"], block["batch_size"])
            )
            draw_stored(stored, path, stored["title"])
            written.append(path)
    return written


def timeline_title(variant: str, batch_size: int) -> str:
    """A timeline's title: the variant and its batch size."""
    return (
        f"{variant}, batch {batch_size}: progress() calls {TIMELINE_CALLS[0]}..{TIMELINE_CALLS[1]}"
    )


__all__ = [
    "memory_picture_name",
    "redraw_memory_timelines",
    "draw_stored",
    "picture_name",
    "redraw_timelines",
    "timeline_title",
]
