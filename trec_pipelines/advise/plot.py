"""The advice as a picture: x plain against pipeline-held memory, one point per variant.

Each variant is a point at its held bytes (the memory ledger's peak) and its
``x plain``, with an error bar of twice its standard error over the rounds
(the table's ``±``); the plain loop is the grey diamond at 1.00x, holding
nothing, and the band just above it is the 2% a variant must beat it by.
The x axis is in KiB or MiB, whichever fits the points (log when they span
more than thirty-fold); the budget is a line when it falls in range, a note
otherwise.  The verdict is the title.

matplotlib is not a dependency of the package (it never replaces a user's
stack); without it :func:`save_plot` says how to get it.
"""

from __future__ import annotations

import importlib.util
import textwrap
from typing import Any, List, Optional, Sequence, Tuple

from trec_pipelines.advise.verdict import MARGIN, Answer
from trec_pipelines.observe.memory import format_bytes

KIB = 2**10
MIB = 2**20


def short_name(name: str) -> str:
    """``TrainPipelineSparseDist`` -> ``SparseDist``; ``StagedTrainPipeline`` -> ``Staged``."""
    return name.replace("TrainPipeline", "") or name


def _title(advice: Any) -> str:
    verdict = advice.verdict
    if verdict.answer is Answer.RECOMMEND:
        row = advice[verdict.variant]
        return f"advise: recommend {verdict.variant} ({row.vs_plain:.2f}x plain)"
    if verdict.answer is Answer.KEEP_PLAIN_LOOP:
        return "advise: keep your plain loop"
    again = []
    if verdict.rerun_steps is not None:
        again.append(f"{verdict.rerun_steps} steps")
    if verdict.rerun_rounds is not None:
        again.append(f"{verdict.rerun_rounds} rounds")
    return "advise: cannot tell" + (f"; re-run with {' and '.join(again)}" if again else "")


def _unit(largest: float) -> Tuple[str, float]:
    return ("MiB", MIB) if largest >= MIB else ("KiB", KIB)


# Where a point's label may go, in points from it: right, left, above, below, then further out.
_SPOTS = [
    (9, 2, "left", "bottom"),
    (9, -2, "left", "top"),
    (-9, 2, "right", "bottom"),
    (-9, -2, "right", "top"),
    (0, 10, "center", "bottom"),
    (0, -10, "center", "top"),
    (9, 16, "left", "bottom"),
    (-9, 16, "right", "bottom"),
    (9, -16, "left", "top"),
    (-9, -16, "right", "top"),
]


def _place_labels(
    fig: Any,
    ax: Any,
    labels: Sequence[Tuple[float, float, str, bool]],
    bars: Sequence[Tuple[float, float, float]],
) -> None:
    """Each label at the first spot around its point that overlaps no label placed before it,
    no point and no error bar (or, failing that, the spot that overlaps least)."""
    from matplotlib.transforms import Bbox

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    to_px = ax.transData.transform
    obstacles = []
    for x, low, high in bars:
        (x0, y0), (x1, y1) = to_px((x, low)), to_px((x, high))
        obstacles.append(Bbox.from_extents(x0 - 6, min(y0, y1), x1 + 6, max(y0, y1)))
    for x, y, _, _ in labels:
        px, py = to_px((x, y))
        obstacles.append(Bbox.from_extents(px - 8, py - 8, px + 8, py + 8))
    placed: List[Any] = []
    for x, y, text, bold in sorted(labels, key=lambda item: -item[1]):
        best: Optional[Tuple[float, Any, Any]] = None
        for dx, dy, ha, va in _SPOTS:
            note = ax.annotate(
                text,
                (x, y),
                textcoords="offset points",
                xytext=(dx, dy),
                ha=ha,
                va=va,
                fontsize=10,
                fontweight="bold" if bold else "normal",
            )
            box = note.get_window_extent(renderer)
            cost = 10.0 * sum(box.overlaps(b) for b in placed)
            cost += sum(box.overlaps(b) for b in obstacles)
            cost += (
                0.0 if frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1) else 5.0
            )
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, note, box)
            else:
                note.remove()
            if cost == 0:
                break
        assert best is not None
        placed.append(best[2])


def _draw_reference(ax: Any, log: bool) -> None:
    """The plain loop's line, the band within the margin of it and, on a linear axis, its point."""
    ax.axhspan(1.0, 1.0 + MARGIN, color="0.85", zorder=0)
    ax.axhline(1.0, color="0.45", linestyle=":", linewidth=1.2, zorder=1)
    ax.text(
        0.995,
        1.0 + MARGIN,
        f"within {MARGIN:.0%} of the plain loop",
        transform=ax.get_yaxis_transform(),
        fontsize=9,
        color="0.35",
        va="bottom",
        ha="right",
    )
    if not log:
        ax.scatter([0], [1.0], marker="D", s=60, color="0.45", zorder=3)
        ax.annotate(
            "plain loop",
            (0, 1.0),
            textcoords="offset points",
            xytext=(9, 3),
            fontsize=10,
            color="0.3",
        )


def _draw_variants(
    ax: Any, advice: Any, points: List[Any], scale: float
) -> Tuple[List[Tuple[float, float, str, bool]], List[Tuple[float, float, float]]]:
    """Each variant that ran at (held, x plain) with its noise band; their labels and bars."""
    # The pick in red; when it cannot tell, the one leading so far in orange.
    picked = advice.verdict.variant
    labels: List[Tuple[float, float, str, bool]] = []
    bars: List[Tuple[float, float, float]] = []
    for row in points:
        x, y = row.held_peak / scale, row.vs_plain
        over = row.within_budget is False
        chosen = row.name == picked
        if not chosen:
            color = "tab:blue"
        else:
            color = "tab:red" if advice.recommended else "tab:orange"
        # The band is symmetric (twice the standard error); a ratio is never below 0.
        low, high = min(row.band or 0.0, y), row.band or 0.0
        bars.append((x, y - low, y + high))
        ax.errorbar(
            [x],
            [y],
            yerr=[[low], [high]],
            fmt="*" if chosen else "o",
            markersize=14 if chosen else 8,
            color=color,
            markerfacecolor="white" if over else color,
            ecolor=color,
            elinewidth=1.5,
            capsize=5,
            zorder=4,
        )
        label = short_name(row.name) + (" (over budget)" if over else "")
        if chosen and not advice.recommended:
            label += " (leads)"
        if row.unpipelined:
            label += f" ({len(row.unpipelined)} unpipelined)"
        labels.append((x, y, label, chosen))
    return labels, bars


def _draw_memory_axis(ax: Any, advice: Any, held: List[int], scale: float, log: bool) -> List[str]:
    """The held-memory axis and the budget's line; the notes on what the picture leaves out."""
    notes: List[str] = []
    if log:
        ax.set_xscale("log")
        notes.append("plain loop: 1.00x, holds nothing (off a log axis)")
    budget = advice.memory_budget
    if not log:
        largest = max((h / scale for h in held), default=1.0) or 1.0
        right = largest * 1.25
        if budget is not None and budget / scale <= 2 * largest:
            right = max(right, budget / scale * 1.08)  # near enough to draw
        ax.set_xlim(-0.04 * right, right)
    if budget is not None:
        low, high = ax.get_xlim()
        if low <= budget / scale <= high:
            ax.axvline(budget / scale, color="tab:red", linestyle="--", linewidth=1.2)
            ax.text(
                budget / scale,
                0.98,
                " memory budget",
                transform=ax.get_xaxis_transform(),
                color="tab:red",
                fontsize=9,
                va="top",
            )
        else:
            side = "right" if budget / scale > high else "left"
            notes.append(f"memory budget {format_bytes(budget)}: off the {side} of the axis")
    failed = [short_name(r.name) for r in advice.variants if r.applicable and not r.ran]
    if failed:
        notes.append(f"failed (see the table): {', '.join(failed)}")
    absent = sum(not r.applicable for r in advice.variants)
    if absent:
        notes.append(f"{absent} variant(s) not applicable to this model")
    return notes


def _write_text(fig: Any, ax: Any, advice: Any, unit: str, notes: List[str]) -> None:
    """The axes' labels, the throughput axis, the title and the verdict under the picture."""
    ax.set_xlabel(f"held by the pipeline (memory ledger peak), {unit}", fontsize=11)
    ax.set_ylabel(
        f"x plain loop (± twice the standard error over {advice.rounds} rounds)", fontsize=11
    )
    ax.tick_params(labelsize=10)
    plain_qps = advice.plain.qps
    if plain_qps:
        right_axis = ax.secondary_yaxis(
            "right", functions=(lambda r: r * plain_qps, lambda q: q / plain_qps)
        )
        right_axis.set_ylabel(advice.qps_unit, fontsize=11)
        right_axis.tick_params(labelsize=10)
    ax.grid(True, alpha=0.3)
    ax.set_title(_title(advice), fontsize=12, loc="left")
    reason = textwrap.fill(str(advice.verdict), 120)
    if notes:
        reason += "\n" + "; ".join(notes)
    fig.text(0.01, 0.01, reason, fontsize=9, va="bottom", ha="left", color="0.2")
    lines = reason.count("\n") + 1
    fig.tight_layout(rect=(0, 0.01 + 0.03 * lines, 1, 1))


def save_plot(advice: Any, path: str) -> None:
    """Write ``advice`` (an :class:`~trec_pipelines.advise.advice.Advice`, which calls this;
    typed loosely so this module needs nothing of that one) to the PNG ``path``."""
    if importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError(
            "advise: the PNG needs matplotlib, which is not installed; `pip install matplotlib`, "
            "or leave the picture out (--no-plot; the table and the JSON have every number)"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [
        r for r in advice.variants if r.ran and r.vs_plain is not None and r.held_peak is not None
    ]
    held = [r.held_peak for r in points]
    unit, scale = _unit(max(held, default=0))
    nonzero = [h for h in held if h > 0]
    log = len(nonzero) >= 2 and max(nonzero) > 30 * min(nonzero)

    fig, ax = plt.subplots(figsize=(9, 5.6))
    _draw_reference(ax, log)
    labels, bars = _draw_variants(ax, advice, points, scale)
    notes = _draw_memory_axis(ax, advice, held, scale, log)
    _write_text(fig, ax, advice, unit, notes)
    _place_labels(fig, ax, labels, bars)
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["save_plot", "short_name"]
