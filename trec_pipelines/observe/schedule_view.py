"""Views of recorded actions: the schedule table, traces, timelines, exposed time.

All functions take the list of :class:`~trec_pipelines.observe.action_records.Action`
records a pipeline recorded (``pipeline.schedule_actions``); the trace and the
timeline also draw the all-to-alls it put on the link
(:class:`~trec_pipelines.observe.action_records.Transfer`, ``pipeline.schedule_transfers``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

from trec_pipelines.observe.task_names import TASKS

if TYPE_CHECKING:
    from trec_pipelines.observe.action_records import Action, Transfer
    from trec_pipelines.observe.ledger import MemorySample

Cell = Union[int, Tuple[int, ...], None]  # a batch, batches, or none
Row = Tuple[str, str, List[Cell]]

STREAM_ORDER = ("default", "emb_lookup", "data_dist", "prefetch", "memcpy")
# The link lanes, top to bottom (trec_pipelines.observe.all_to_all_watch names the groups).
GROUP_ORDER = ("input-dist group", "model group")


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
    actions: Sequence["Action"],
    path: str,
    memory: Sequence["MemorySample"] = (),
    transfers: Sequence["Transfer"] = (),
) -> None:
    """A Chrome trace (chrome://tracing, ui.perfetto.dev) of the recorded actions.

    Track "CPU thread" shows when the training thread issued (and was blocked
    in) each task; one track per stream shows when the work ran on it; one per
    process group, "link: ...", shows each of ``transfers`` from its issue to
    the completion of its work.  With ``memory`` samples (the memory ledger) a
    counter track "held MiB" shows what the pipeline held after each action, by kind.
    """
    if not actions:
        raise ValueError("nothing recorded: call enable_schedule_recording() before progress()")
    origin = min(a.cpu_start for a in actions)
    events: List[Dict[str, Any]] = []
    lanes = stream_lanes(actions)
    groups = link_lanes(transfers)
    tracks = (
        ["CPU thread", "loader thread"]
        + [f"stream: {s}" for s in lanes]
        + [f"link: {g}" for g in groups]
    )
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

    events.extend(_action_events(actions, lanes, origin))
    events.extend(_transfer_events(transfers, 2 + len(lanes), groups, origin))
    events.extend(_memory_events(memory, origin))
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def _action_events(
    actions: Sequence["Action"], lanes: List[str], origin: float
) -> List[Dict[str, Any]]:
    """Each action as a span on its thread's track and, when it ran there, on its stream's."""
    events: List[Dict[str, Any]] = []

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
    return events


def _transfer_events(
    transfers: Sequence["Transfer"], first_tid: int, groups: List[str], origin: float
) -> List[Dict[str, Any]]:
    """Each completed transfer as an async event on its process group's link track."""
    events: List[Dict[str, Any]] = []
    for index, transfer in enumerate(transfers):
        if transfer.completed is None:
            continue
        # Async events: all-to-alls in flight together overlap without nesting.
        common = {
            "name": _transfer_label(transfer),
            "cat": "link",
            "id": index,
            "pid": 0,
            "tid": first_tid + groups.index(transfer.group),
        }
        begin_args = {"batch": transfer.batch, "progress_call": transfer.call}
        begin_args["bytes"] = transfer.nbytes
        events.append(
            {**common, "ph": "b", "ts": (transfer.issued - origin) * 1e6, "args": begin_args}
        )
        events.append({**common, "ph": "e", "ts": (transfer.completed - origin) * 1e6})
    return events


def _memory_events(memory: Sequence["MemorySample"], origin: float) -> List[Dict[str, Any]]:
    """The memory ledger's samples as a counter track of held MiB by kind."""
    events: List[Dict[str, Any]] = []
    for sample in memory:
        events.append(
            {
                "name": "held MiB",
                "ph": "C",
                "pid": 0,
                "ts": (sample.time - origin) * 1e6,
                "args": {
                    place: nbytes / 2**20 for place, nbytes in sample.held.bytes_by_place.items()
                },
            }
        )
    return events


def link_lanes(transfers: Sequence["Transfer"]) -> List[str]:
    """The process groups that carried ``transfers``: the known ones in their
    usual order (the input-dist group above the model's), then any others."""
    used = list(dict.fromkeys(t.group for t in transfers))
    return [g for g in GROUP_ORDER if g in used] + [g for g in used if g not in GROUP_ORDER]


def _transfer_label(transfer: "Transfer") -> str:
    task = transfer.task or "all-to-all"
    return task if transfer.batch is None else f"{task} i{transfer.batch}"


@dataclass(frozen=True)
class LinkBox:
    """One all-to-all as a link lane draws it.

    Attributes:
        group: the lane (the process group it ran on).
        row: its row in the lane: all-to-alls in flight at once stack in rows, from 0.
        start, end: milliseconds from the timeline's origin, from its issue to
            the completion of its work.
        batch: the batch it was issued for (its colour), or None.
        label: the verb and batch it was issued in.
    """

    group: str
    row: int
    start: float
    end: float
    batch: Optional[int]
    label: str


def link_boxes(
    transfers: Sequence["Transfer"], origin: float, calls: Optional[Tuple[int, int]] = None
) -> List[LinkBox]:
    """The boxes of the link lanes: each completed transfer (of ``progress()``
    calls ``calls``, when given) from issue to completion, in ms from ``origin``.

    In each group a box takes the lowest row free at its start, so boxes in
    flight together never hide one another.  A transfer not completed when
    read has no box.
    """
    chosen = [
        t
        for t in transfers
        if t.completed is not None and (calls is None or calls[0] <= t.call <= calls[1])
    ]
    boxes: List[LinkBox] = []
    row_ends: Dict[str, List[float]] = defaultdict(list)  # per group: each row's last end
    for transfer in sorted(chosen, key=lambda t: t.issued):
        assert transfer.completed is not None
        start = (transfer.issued - origin) * 1e3
        end = (transfer.completed - origin) * 1e3
        rows = row_ends[transfer.group]
        row = next((k for k, busy_until in enumerate(rows) if busy_until <= start), len(rows))
        if row == len(rows):
            rows.append(end)
        else:
            rows[row] = end
        boxes.append(
            LinkBox(transfer.group, row, start, end, transfer.batch, _transfer_label(transfer))
        )
    return boxes


def runs_on_cpu(actions: Sequence["Action"]) -> bool:
    """Whether ``actions`` were recorded on CPU, where a verb's stream time is its
    issuing thread's (no stream runs work of its own)."""
    return all(
        a.device_start == a.cpu_start and a.device_end == a.cpu_end
        for a in actions
        if a.device_start is not None
    )


CPU_NOTE = (
    "On CPU the streams share one thread: a stream lane shows which stream each verb "
    "was issued to, not work running in parallel."
)
LINK_NOTE = (
    "Link lanes: each all-to-all from its issue to the completion of its work (queueing "
    "behind earlier ones on its group included), labelled with the verb that issued it."
)

# Lane height in the figure (inches), and the part of it a box fills.
_LANE_INCHES = 0.62
_BOX = 0.7


@dataclass
class _Canvas:
    """The timeline's axes and what drawing a box on them needs.

    Attributes:
        ax: the lanes' axes.
        colors: a colour map; a batch's colour is ``colors(batch % 10)``.
        total_ms: the width of the time axis, in ms.
        axes_points: the time axis' width, roughly, in points (to fit labels).
    """

    ax: Any
    colors: Any
    total_ms: float
    axes_points: float

    def color_of(self, batch: Optional[int]) -> Any:
        """A batch's colour; light grey for work of no batch."""
        return "lightgrey" if batch is None else self.colors(batch % 10)

    def box(self, y: float, height: float, x: float, width: float, batch: Any, label: str) -> None:
        """A box at lane height ``y``, labelled when its label fits in it."""
        width = max(width, 1e-3)
        self.ax.broken_barh(
            [(x, width)],
            (y - height / 2, height),
            facecolors=self.color_of(batch),
            edgecolors="black",
            linewidth=0.3,
        )
        size = 6 if height > 0.4 else 5
        # Label only a box its label fits in (a character is about 0.6 of the font size wide).
        if width / self.total_ms * self.axes_points > 0.6 * size * (len(label) + 1):
            self.ax.text(
                x + width / 2, y, label, ha="center", va="center", fontsize=size, clip_on=True
            )


def _lane_y(lane: int, lanes: int) -> int:
    """Lane ``lane``'s height on the axes: the first lane on top."""
    return lanes - 1 - lane


def _draw_actions(
    canvas: _Canvas, chosen: Sequence["Action"], streams: List[str], origin: float, lanes: int
) -> None:
    """Each action on the CPU thread's lane and, when it ran there, on its stream's."""
    for action in chosen:
        label = action.task if action.batch is None else f"{action.task} i{action.batch}"
        spans = [(0, action.cpu_start, action.cpu_end)]
        if action.device_start is not None and action.device_end is not None:
            spans.append((1 + streams.index(action.stream), action.device_start, action.device_end))
        for lane, start, end in spans:
            x = (start - origin) * 1e3
            canvas.box(_lane_y(lane, lanes), _BOX, x, (end - start) * 1e3, action.batch, label)


def _draw_links(
    canvas: _Canvas, groups: List[str], boxes: Sequence[Any], first_link: int, lanes: int
) -> None:
    """Each transfer in its process group's link lane, overlapping ones in rows."""
    for group_index, group in enumerate(groups):
        in_lane = [b for b in boxes if b.group == group]
        rows = 1 + max(b.row for b in in_lane)
        height = _BOX / rows
        top = _lane_y(first_link + group_index, lanes) + _BOX / 2
        for box in in_lane:
            y = top - height * (box.row + 0.5)
            canvas.box(y, height * 0.92, box.start, box.end - box.start, box.batch, box.label)


def _draw_legend(canvas: _Canvas, chosen: Sequence["Action"], boxes: Sequence[Any]) -> None:
    """A legend naming each batch's colour, right of the lanes."""
    from matplotlib.patches import Patch

    batches = sorted(
        {a.batch for a in chosen if a.batch is not None}
        | {b.batch for b in boxes if b.batch is not None}
    )
    handles = [
        Patch(facecolor=canvas.color_of(b), edgecolor="black", label=f"i{b}") for b in batches
    ]
    if any(a.batch is None for a in chosen) or any(b.batch is None for b in boxes):
        handles.append(Patch(facecolor=canvas.color_of(None), edgecolor="black", label="none"))
    if handles:
        canvas.ax.legend(
            handles=handles,
            title="batch",
            loc="upper left",
            bbox_to_anchor=(1.005, 1.0),
            fontsize=7,
            title_fontsize=7,
            frameon=False,
        )


def draw_timeline(
    actions: Sequence["Action"],
    path: str,
    calls: Optional[Tuple[int, int]] = None,
    title: str = "",
    memory: Sequence["MemorySample"] = (),
    transfers: Sequence["Transfer"] = (),
    on_cpu: Optional[bool] = None,
) -> None:
    """A PNG timeline: one lane per stream (device time), one for the CPU thread,
    and one per process group for the link.

    Boxes are coloured by batch (a legend names them) and labelled with task
    and batch, in the style of the reference timelines.  The link lanes draw
    each of ``transfers`` (the all-to-alls) from its issue to the completion
    of its work (:func:`link_boxes`).  ``calls=(first, last)`` limits it to a
    window of ``progress()`` calls.  With ``memory`` samples (the memory
    ledger) a track below shows what the pipeline held after each action,
    stacked by kind.  ``on_cpu`` (inferred from the actions when None) adds a
    note that on CPU the stream lanes are not parallel work.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [a for a in actions if calls is None or calls[0] <= a.call <= calls[1]]
    if not chosen:
        raise ValueError("no recorded actions in the requested window")
    if on_cpu is None:
        on_cpu = runs_on_cpu(chosen)
    origin = min(a.cpu_start for a in chosen)
    streams = stream_lanes(chosen)
    boxes = link_boxes(transfers, origin, calls)
    groups = link_lanes([t for t in transfers if t.completed is not None])
    groups = [g for g in groups if any(b.group == g for b in boxes)]
    lanes = ["CPU thread"] + [f"{s} stream" for s in streams] + [f"link: {g}" for g in groups]
    fig_width = 14
    ends = [a.cpu_end for a in chosen] + [origin + b.end / 1e3 for b in boxes]
    total_ms = (max(ends) - origin) * 1e3
    held = [m for m in memory if calls is None or calls[0] <= m.call <= calls[1]]
    lanes_inches = _LANE_INCHES * len(lanes) + 0.9
    if held:
        fig, (ax, mem_ax) = plt.subplots(
            2,
            1,
            sharex=True,
            figsize=(fig_width, lanes_inches + 2.4),
            gridspec_kw={"height_ratios": [lanes_inches, 2.0]},
        )
    else:
        fig, ax = plt.subplots(figsize=(fig_width, lanes_inches))

    canvas = _Canvas(ax, plt.get_cmap("tab10"), total_ms, 0.85 * fig_width * 72)
    _draw_actions(canvas, chosen, streams, origin, len(lanes))
    _draw_links(canvas, groups, boxes, 1 + len(streams), len(lanes))
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(list(reversed(lanes)))
    ax.set_title(title or "pipeline timeline")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    _draw_legend(canvas, chosen, boxes)
    notes = ([CPU_NOTE] if on_cpu else []) + ([LINK_NOTE] if boxes else [])
    if held:
        _draw_memory(mem_ax, held, origin)
        mem_ax.set_xlabel("time (ms)")
    else:
        ax.set_xlabel("time (ms)")
    # The notes, one a line, in a strip kept free below the axes.
    notes_inches = 0.05 + 0.15 * len(notes) if notes else 0.0
    if notes:
        fig.text(0.005, 0.01, "\n".join(notes), fontsize=7, ha="left", va="bottom", color="dimgray")
    fig.tight_layout(rect=(0, notes_inches / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _draw_memory(ax: Any, samples: Sequence["MemorySample"], origin: float) -> None:
    """What the pipeline held after each action, in MiB, stacked by place (host and
    device batches) and kind (a step plot)."""
    from trec_pipelines.observe.memory import PLACES

    xs = [(m.time - origin) * 1e3 for m in samples]
    layers = [[m.held.bytes_by_place.get(place, 0) / 2**20 for m in samples] for place in PLACES]
    ax.stackplot(xs, *layers, labels=list(PLACES), step="post", alpha=0.8)
    ax.set_ylabel("held (MiB)")
    ax.legend(fontsize=6, loc="upper left", ncol=len(PLACES))
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
