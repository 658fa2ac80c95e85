"""Views of recorded actions: the schedule table, traces, timelines, exposed time.

All functions take the list of :class:`~trec_pipelines.observe.actions.Action`
records a pipeline recorded (``pipeline.schedule_actions``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

from trec_pipelines.observe.tasks import TASKS

if TYPE_CHECKING:
    from trec_pipelines.observe.actions import Action
    from trec_pipelines.observe.ledger import MemorySample

Cell = Union[int, Tuple[int, ...], None]  # a batch, batches, or none
Row = Tuple[str, str, List[Cell]]

STREAM_ORDER = ("default", "emb_lookup", "data_dist", "prefetch", "memcpy")


def stream_lanes(actions: Sequence["Action"]) -> List[str]:
    """The stream roles used, known roles in their usual order, then any others
    (a staged pipeline names its streams after its stages) in order of use."""
    used: List[str] = []
    for action in actions:
        if action.stream not in used:
            used.append(action.stream)
    known = [s for s in STREAM_ORDER if s in used]
    return known + [s for s in used if s not in STREAM_ORDER]


def schedule_table(actions: Sequence["Action"]) -> List[Row]:
    """One ``(task, stream, cells)`` row per task, ``cells`` per ``progress()`` call."""
    if not actions:
        return []
    n_calls = max(a.call for a in actions) + 1
    handled: Dict[Tuple[str, str], List[List[int]]] = {}
    for action in actions:
        per_call = handled.setdefault((action.task, action.stream), [[] for _ in range(n_calls)])
        if action.batch is not None:
            per_call[action.call].append(action.batch)

    def order(key: Tuple[str, str]) -> Tuple[int, int]:
        task, stream = key
        rank = TASKS.index(task) if task in TASKS else len(TASKS)
        return (STREAM_ORDER.index(stream) if stream in STREAM_ORDER else len(STREAM_ORDER), rank)

    rows: List[Row] = []
    for key in sorted(handled, key=order):
        cells: List[Cell] = []
        for batches in handled[key]:
            cells.append(
                None if not batches else batches[0] if len(batches) == 1 else tuple(batches)
            )
        rows.append((key[0], key[1], cells))
    return rows


def _cell_text(cell: Cell) -> str:
    if cell is None:
        return "--"
    if isinstance(cell, tuple):
        return "+".join(f"i{b}" for b in cell)
    return f"i{cell}"


def format_schedule(rows: Sequence[Row], n: Optional[int] = None) -> str:
    """The table as text, first ``n`` ``progress()`` calls (all when None)."""
    if not rows:
        return "(nothing recorded: call enable_schedule_recording() before progress())"
    n_calls = len(rows[0][2]) if n is None else min(n, len(rows[0][2]))
    width = max(5, *(len(_cell_text(c)) for _, _, cells in rows for c in cells[:n_calls]))
    header = f"{'#':>3}  {'Task':<16} {'Stream':<11} | " + " ".join(
        f"{'P' + str(k):<{width}}" for k in range(n_calls)
    )
    lines = [
        header,
        f"{'--':>3}  {'-' * 16} {'-' * 11} + " + " ".join("-" * width for _ in range(n_calls)),
    ]
    for index, (task, stream, cells) in enumerate(rows):
        body = " ".join(f"{_cell_text(c):<{width}}" for c in cells[:n_calls])
        lines.append(f"{index:>3}  {task:<16} {stream:<11} | {body}")
    return "\n".join(lines)


def exposed_time(actions: Sequence["Action"], call_starts: Sequence[float]) -> Dict[str, float]:
    """Seconds the training thread spent in each task (its exposed time).

    ``"step"`` is the wall time from the first to the last recorded call's end;
    what it does not account for is Python glue between verbs.
    """
    exposed: Dict[str, float] = defaultdict(float)
    for action in actions:
        if action.thread == "main":
            exposed[action.task] += action.cpu_end - action.cpu_start
    if actions and call_starts:
        exposed["step"] = max(a.cpu_end for a in actions) - call_starts[0]
    return dict(exposed)


def write_trace(
    actions: Sequence["Action"], path: str, memory: Sequence["MemorySample"] = ()
) -> None:
    """A Chrome trace (chrome://tracing, ui.perfetto.dev) of the recorded actions.

    Track "CPU thread" shows when the training thread issued (and was blocked
    in) each task; one track per stream shows when the work ran on it.  With
    ``memory`` samples (the memory ledger) a counter track "held MiB" shows
    what the pipeline held after each action, by kind.
    """
    if not actions:
        raise ValueError("nothing recorded: call enable_schedule_recording() before progress()")
    origin = min(a.cpu_start for a in actions)
    events: List[Dict[str, Any]] = []
    lanes = stream_lanes(actions)
    tracks = ["CPU thread", "loader thread"] + [f"stream: {s}" for s in lanes]
    for tid, name in enumerate(tracks):
        events.append(
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": name}}
        )
        events.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": 0,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )

    def span(name: str, tid: int, start: float, end: float, action: "Action") -> Dict[str, Any]:
        return {
            "name": name,
            "ph": "X",
            "pid": 0,
            "tid": tid,
            "ts": (start - origin) * 1e6,
            "dur": max(end - start, 0.0) * 1e6,
            "args": {"batch": action.batch, "progress_call": action.call, "stream": action.stream},
        }

    for action in actions:
        label = f"{action.task} i{action.batch}" if action.batch is not None else action.task
        thread_tid = 0 if action.thread == "main" else 1
        events.append(span(label, thread_tid, action.cpu_start, action.cpu_end, action))
        if action.device_start is not None and action.device_end is not None:
            stream_tid = 2 + lanes.index(action.stream)
            events.append(span(label, stream_tid, action.device_start, action.device_end, action))
    for sample in memory:
        events.append(
            {
                "name": "held MiB",
                "ph": "C",
                "pid": 0,
                "ts": (sample.time - origin) * 1e6,
                "args": {
                    kind: nbytes / 2**20 for kind, nbytes in sample.held.bytes_by_kind.items()
                },
            }
        )
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def draw_timeline(
    actions: Sequence["Action"],
    path: str,
    calls: Optional[Tuple[int, int]] = None,
    title: str = "",
    memory: Sequence["MemorySample"] = (),
) -> None:
    """A PNG timeline: one lane per stream (device time), one for the CPU thread.

    Boxes are coloured by batch and labelled with task and batch, in the style
    of the reference timelines.  ``calls=(first, last)`` limits it to a window
    of ``progress()`` calls.  With ``memory`` samples (the memory ledger) a
    track below shows what the pipeline held after each action, stacked by kind.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [a for a in actions if calls is None or calls[0] <= a.call <= calls[1]]
    if not chosen:
        raise ValueError("no recorded actions in the requested window")
    origin = min(a.cpu_start for a in chosen)
    streams = stream_lanes(chosen)
    lanes = ["CPU thread"] + [f"{s} stream" for s in streams]
    colors = plt.get_cmap("tab10")
    fig_width = 14
    total_ms = (max(a.cpu_end for a in chosen) - origin) * 1e3
    held = [m for m in memory if calls is None or calls[0] <= m.call <= calls[1]]
    if held:
        fig, (ax, mem_ax) = plt.subplots(
            2,
            1,
            sharex=True,
            figsize=(fig_width, 0.7 * len(lanes) + 3.2),
            gridspec_kw={"height_ratios": [0.7 * len(lanes) + 0.6, 2.0]},
        )
    else:
        fig, ax = plt.subplots(figsize=(fig_width, 0.7 * len(lanes) + 1.2))
    for action in chosen:
        color = colors((action.batch or 0) % 10)
        label = action.task if action.batch is None else f"{action.task} i{action.batch}"
        boxes = [(0, action.cpu_start, action.cpu_end)]
        if action.device_start is not None and action.device_end is not None:
            boxes.append((1 + streams.index(action.stream), action.device_start, action.device_end))
        for lane, start, end in boxes:
            x, width = (start - origin) * 1e3, max((end - start) * 1e3, 1e-3)
            y = len(lanes) - 1 - lane
            ax.broken_barh(
                [(x, width)], (y - 0.35, 0.7), facecolors=color, edgecolors="black", linewidth=0.3
            )
            if width > total_ms * 0.045:  # label only boxes wide enough to read
                ax.text(x + width / 2, y, label, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(list(reversed(lanes)))
    ax.set_title(title or "pipeline timeline")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    if held:
        _draw_memory(mem_ax, held, origin)
        mem_ax.set_xlabel("time (ms)")
    else:
        ax.set_xlabel("time (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _draw_memory(ax: Any, samples: Sequence["MemorySample"], origin: float) -> None:
    """What the pipeline held after each action, in MiB, stacked by kind (a step plot)."""
    from trec_pipelines.observe.memory import KINDS

    xs = [(m.time - origin) * 1e3 for m in samples]
    layers = [[m.held.bytes_by_kind.get(kind, 0) / 2**20 for m in samples] for kind in KINDS]
    ax.stackplot(xs, *layers, labels=list(KINDS), step="post", alpha=0.8)
    ax.set_ylabel("held (MiB)")
    ax.legend(fontsize=6, loc="upper left", ncol=len(KINDS))
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
