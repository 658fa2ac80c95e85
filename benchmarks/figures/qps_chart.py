"""The QPS figure (``qps.png``): ours over the plain loop and over torchrec, with their spread.

Per batch size, one block of panels: a row of panels per mode (train, with
Staged; eval), a column per reference (the plain loop of the same mode;
torchrec's same-named class).  Each variant of ours is one row, drawn as the
median over rounds of its ratio to the reference *within a round* (every
round runs all contenders back to back, so drift of the machine between
rounds cancels) and a bar from the smallest to the largest per-round ratio.
Rows are sorted by the default row's ratio to the plain loop, fastest on top,
with a variant's twin rows (``[shared]``, ``[no agreement]``) under it.  The
training panels also show the any-schedule bound over the plain loop.

:func:`chart_blocks` computes what is drawn (no matplotlib), :func:`draw`
draws it, :func:`write_chart` does both and saves the PNG.
"""

from __future__ import annotations

import statistics
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from benchmarks.tables.report import Measure, Row, ThroughputTable, throughput_tables

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure, SubFigure

# Panel modes, top to bottom; Staged trains (against the plain training loop).
PANEL_MODES: Tuple[str, ...] = ("train", "eval")
# Marker colour of a row, by the suffix that tells a twin row from its default row.
TWIN_COLORS: Dict[str, str] = {
    "": "tab:blue",
    "[shared]": "tab:orange",
    "[no agreement]": "tab:purple",
}
OTHER_TWIN_COLOR = "tab:gray"
BOUND_COLOR = "tab:green"
# What each kind of row is, in the legend.
TWIN_LABELS: Dict[str, str] = {
    "": "ours, default options",
    "[shared]": "ours [shared]: input dist on the model's process group, as torchrec",
    "[no agreement]": "ours [no agreement]: sync_exhaustion=False",
}
# A row's height and a panel's fixed height (title, axis ticks), in inches.
ROW_INCHES = 0.24
PANEL_INCHES = 0.8
BLOCK_TITLE_INCHES = 0.35
FIGURE_WIDTH_INCHES = 13.0  # 1,300 px at DPI: fits a 1366 px laptop screen at 100%
DPI = 100
NOTE_LINE_INCHES = 0.17
NOTE_CHARS = 190  # characters per line of the notes under the figure


@dataclass(frozen=True)
class Spread:
    """Per-round ratios of one contender to another: median, quartiles, smallest and largest.

    The quartiles are ``statistics.quantiles(ratios, n=4, method="inclusive")``'s
    first and third (of 5 rounds: the 2nd and 4th smallest ratio).
    """

    median: float
    q1: float
    q3: float
    low: float
    high: float
    rounds: int


def paired_spread(numerator: Sequence[float], denominator: Sequence[float]) -> Optional[Spread]:
    """Ratio per round (``numerator[i] / denominator[i]``), or None when the rounds don't pair."""
    if not numerator or len(numerator) != len(denominator) or min(denominator) <= 0:
        return None
    ratios = sorted(a / b for a, b in zip(numerator, denominator, strict=True))
    median = statistics.median(ratios)
    q1, _, q3 = (
        statistics.quantiles(ratios, n=4, method="inclusive")
        if len(ratios) > 1
        else (median, median, median)
    )
    return Spread(median, q1, q3, ratios[0], ratios[-1], len(ratios))


def _spread(ours: Measure, reference: Measure) -> Optional[Spread]:
    if ours.median is None or reference.median is None:
        return None
    return paired_spread(ours.samples, reference.samples)


@dataclass(frozen=True)
class ChartRow:
    """One variant row of ours in a panel.

    ``base`` is the class, ``twin`` the suffix of a twin row (``"[shared]"``;
    ``""`` for the default row).  ``torchrec_na`` says why there is no
    ratio to torchrec (``""`` when there is one).
    """

    label: str
    base: str
    twin: str
    vs_plain: Optional[Spread]
    vs_torchrec: Optional[Spread]
    shimmed: bool
    torchrec_na: str


@dataclass(frozen=True)
class Panel:
    """The rows of one mode at one batch size, top to bottom.

    ``bound`` is the any-schedule bound over the plain loop's median
    (training panels, when the stage probe ran); ``has_torchrec`` whether any
    torchrec class ran next to these rows.
    """

    mode: str
    rows: List[ChartRow]
    bound: Optional[float]
    has_torchrec: bool


@dataclass(frozen=True)
class Block:
    """One batch size: its panels (modes without rows left out) and what the heading says."""

    batch_size: int
    world: int
    steps: int
    rounds: int
    panels: List[Panel]


def short_name(label: str) -> str:
    """A row label without ``TrainPipeline`` / ``Pipeline``: ``SparseDist [shared]``, ``Staged``."""
    base, sep, rest = label.partition(" ")
    short = base.replace("TrainPipeline", "").replace("Pipeline", "") or base
    return short + sep + rest


def _twin(row: Row, contenders: Dict[str, Dict[str, Any]]) -> Tuple[str, str]:
    """(class, twin suffix) of a row: ``"TrainPipelineSparseDist [shared]"`` -> its class, ``"[shared]"``."""
    entry = contenders.get(f"ours:{row.variant}") or {}
    base = str(entry.get("base_variant") or row.variant.partition(" ")[0])
    suffix = row.variant[len(base) :].strip() if row.variant.startswith(base) else ""
    return base, suffix


def _torchrec_na(row: Row, torchrec_ran: bool) -> str:
    if row.torchrec.median is not None:
        return "" if row.ours.median is not None else "n/a"
    if row.torchrec.reason == "torchrec has no class of this name":
        return "n/a: no such class in torchrec"
    return "n/a: failed (reason in table.txt)" if torchrec_ran else "n/a"


def _sorted_rows(rows: List[ChartRow]) -> List[ChartRow]:
    """Groups of a class's rows, fastest default row (over the plain loop) first, twins under it."""
    groups: Dict[str, List[ChartRow]] = {}
    for row in rows:
        groups.setdefault(row.base, []).append(row)

    def speed(group: List[ChartRow]) -> float:
        default = [r for r in group if not r.twin] or group
        values = [r.vs_plain.median for r in default if r.vs_plain is not None]
        return max(values) if values else float("-inf")

    ordered = sorted(groups.values(), key=speed, reverse=True)  # stable: ties keep run order
    return [r for group in ordered for r in sorted(group, key=lambda r: r.twin != "")]


def _panel_mode(mode: str) -> str:
    return "eval" if mode == "eval" else "train"


def chart_block(
    table: ThroughputTable, contenders: Dict[str, Dict[str, Any]], rounds: int
) -> Block:
    """What the figure draws for one throughput table (``contenders``: its raw block's)."""
    torchrec_ran = any(e["side"] == "torchrec" for e in contenders.values())
    panels = []
    for mode in PANEL_MODES:
        rows = []
        for row in table.rows:
            if _panel_mode(row.mode) != mode:
                continue
            base, twin = _twin(row, contenders)
            rows.append(
                ChartRow(
                    label=row.variant,
                    base=base,
                    twin=twin,
                    vs_plain=_spread(row.ours, row.plain),
                    vs_torchrec=_spread(row.ours, row.torchrec),
                    shimmed=row.torchrec.shimmed and row.torchrec.median is not None,
                    torchrec_na=_torchrec_na(row, torchrec_ran),
                )
            )
        if not rows:
            continue
        bound = None
        plain = table.plain.get("train")
        if mode == "train" and table.bound is not None and plain is not None:
            qps, median = table.bound.bound_qps, plain.median
            bound = qps / median if qps is not None and median else None
        panels.append(Panel(mode, _sorted_rows(rows), bound, torchrec_ran))
    return Block(table.batch_size, table.world, table.steps, rounds, panels)


def chart_blocks(raw: Dict[str, Any]) -> List[Block]:
    """Every batch size's :class:`Block`, from the raw results (``results.json``'s ``"raw"``)."""
    blocks = []
    for table, block in zip(throughput_tables(raw), raw["throughput"], strict=True):
        rounds = block.get("rounds") or max(
            (len(e.get("seconds") or []) for e in block["contenders"].values()), default=0
        )
        chart = chart_block(table, block["contenders"], rounds)
        if chart.panels:
            blocks.append(chart)
    return blocks


# --------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------


def _panel_inches(panel: Panel) -> float:
    return PANEL_INCHES + ROW_INCHES * len(panel.rows)


def _block_inches(block: Block) -> float:
    return BLOCK_TITLE_INCHES + sum(_panel_inches(p) for p in block.panels)


def _limits(spreads: Sequence[Spread], bound: Optional[float]) -> Tuple[float, float]:
    """x limits: 1.0, the bound, every median and quartile; the full ranges only as far as
    half that span again on either side (one disturbed round must not squash every other row)."""
    core = [1.0] + ([bound] if bound is not None else [])
    core += [v for s in spreads for v in (s.q1, s.median, s.q3)]
    low, high = min(core), max(core)
    if high - low < 0.04:  # nothing to show but 1.0 (or one value): a narrow window around it
        low, high = (low + high) / 2 - 0.02, (low + high) / 2 + 0.02
    span = high - low
    low = max(min([low] + [s.low for s in spreads]), low - span / 2)
    high = min(max([high] + [s.high for s in spreads]), high + span / 2)
    pad = 0.04 * (high - low)
    return low - pad, high + pad


def _draw_ratios(ax: Axes, rows: Sequence[ChartRow], side: str, bound: Optional[float]) -> None:
    """One panel: per row the median ratio (marker), its quartiles (thick bar), its smallest
    and largest (thin line, an arrow where it runs past the axis), the median's value."""
    spreads = [r.vs_plain if side == "plain" else r.vs_torchrec for r in rows]
    left, right = _limits([s for s in spreads if s is not None], bound)
    ax.set_xlim(left, right)
    ax.axvline(1.0, color="0.35", linewidth=1.0, zorder=1)
    for y, (row, spread) in enumerate(zip(rows, spreads, strict=True)):
        if spread is None:
            na = "n/a" if side == "plain" else row.torchrec_na or "n/a"
            ax.text(left + 0.01 * (right - left), y, na, va="center", fontsize=8, color="0.35")
            continue
        color = TWIN_COLORS.get(row.twin, OTHER_TWIN_COLOR)
        ax.hlines(y, spread.low, spread.high, color=color, linewidth=1.0, zorder=2)
        ax.hlines(y, spread.q1, spread.q3, color=color, linewidth=5.0, alpha=0.45, zorder=2)
        hollow = side == "torchrec" and row.shimmed
        ax.plot(
            [spread.median],
            [y],
            marker="o",
            markersize=6,
            color=color,
            markerfacecolor="white" if hollow else color,
            zorder=3,
        )
        if spread.low < left:
            ax.plot([left], [y], marker="<", color=color, markersize=5, clip_on=False)
        if spread.high > right:
            ax.plot([right], [y], marker=">", color=color, markersize=5, clip_on=False)
        ax.annotate(
            f"{spread.median:.2f}",
            (1.0, y),
            xycoords=ax.get_yaxis_transform(),  # x: the axes' right edge; y: the row
            xytext=(5, 0),
            textcoords="offset points",
            va="center",
            fontsize=8.5,
        )
    if bound is not None:
        ax.axvline(bound, color=BOUND_COLOR, linestyle="--", linewidth=1.2, zorder=2)
        ax.set_title(
            f"bound (any schedule): {bound:.2f}", loc="right", fontsize=9, color=BOUND_COLOR
        )


def _draw_block(sub: SubFigure, block: Block) -> None:
    with_torchrec = any(p.has_torchrec for p in block.panels)
    columns = 2 if with_torchrec else 1
    axes = sub.subplots(
        len(block.panels),
        columns,
        squeeze=False,
        sharey="row",
        gridspec_kw={"height_ratios": [_panel_inches(p) for p in block.panels]},
    )
    sub.suptitle(
        f"batch {block.batch_size}/rank x {block.world} ranks, {block.steps}-step epochs, "
        f"{block.rounds} round{'s' if block.rounds != 1 else ''}",
        fontsize=11,
        fontweight="bold",
    )
    for panel, pair in zip(block.panels, axes, strict=True):
        sides = ["plain", "torchrec"][:columns]
        for ax, side in zip(pair, sides, strict=True):
            # Light bands mark every other class's rows (its default row and its twins).
            group = 0
            for y, row in enumerate(panel.rows):
                group += bool(y) and row.base != panel.rows[y - 1].base
                if group % 2:
                    ax.axhspan(y - 0.5, y + 0.5, color="0.93", linewidth=0, zorder=0)
            _draw_ratios(ax, panel.rows, side, panel.bound if side == "plain" else None)
            reference = "plain loop" if side == "plain" else "torchrec's same-named class"
            ax.set_title(f"{panel.mode}: ours / {reference}", fontsize=10, loc="left")
            ax.tick_params(axis="x", labelsize=8)
            ax.grid(axis="x", color="0.85", linewidth=0.6)
            ax.set_axisbelow(True)
        pair[0].set_yticks(range(len(panel.rows)))
        pair[0].set_yticklabels([short_name(r.label) for r in panel.rows], fontsize=9)
        pair[0].set_ylim(len(panel.rows) - 0.5, -0.5)  # first row on top


def _notes(blocks: Sequence[Block]) -> List[str]:
    rounds = sorted({b.rounds for b in blocks})
    lines = [
        "Each row: ours / the reference in each round (every round runs all contenders back to "
        f"back; {' or '.join(str(r) for r in rounds)} rounds). Marker and number: the median over "
        "the rounds (table.txt's 'paired' for torchrec; its ours/plain is a ratio of medians); "
        "thick bar: the middle half of the rounds (quartiles); thin line: smallest to largest "
        "(an arrow: it goes on past the axis). Right of 1: ours is faster. Fastest over the plain "
        "loop on top.",
    ]
    panels = [p for b in blocks for p in b.panels]
    if any(p.bound is not None for p in panels):
        lines.append(
            "bound (any schedule): examples/s no training schedule can beat here (from the stage "
            "probe: see table.txt), over the plain loop's; eval has none."
        )
    if any(r.shimmed for p in panels for r in p.rows):
        lines.append(
            "Open marker: torchrec's class calls CUDA stream functions even on CPU, so it ran with "
            "those calls stubbed out for CPU (trec_pipelines/testing/torchrec_cpu.py); ours never does."
        )
    return lines


def _legend_handles(blocks: Sequence[Block]) -> List[Any]:
    from matplotlib.lines import Line2D

    rows = [r for b in blocks for p in b.panels for r in p.rows]
    twins = list(dict.fromkeys(r.twin for r in rows))
    handles: List[Any] = [
        Line2D(
            [],
            [],
            marker="o",
            linestyle="none",
            color=TWIN_COLORS.get(twin, OTHER_TWIN_COLOR),
            label=TWIN_LABELS.get(twin, f"ours {twin}"),
        )
        for twin in twins
    ]
    if any(r.shimmed for r in rows):
        handles.append(
            Line2D(
                [],
                [],
                marker="o",
                linestyle="none",
                color="0.3",
                markerfacecolor="white",
                label="against torchrec's class run with the CPU shim",
            )
        )
    if any(p.bound is not None for b in blocks for p in b.panels):
        handles.append(
            Line2D([], [], color=BOUND_COLOR, linestyle="--", label="bound (any schedule)")
        )
    return handles


def draw(blocks: Sequence[Block]) -> Figure:
    """The figure of ``blocks``: a block per batch size, then the legend and the notes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    handles = _legend_handles(blocks)
    notes = [
        wrapped
        for line in _notes(blocks)
        for wrapped in textwrap.wrap(line, NOTE_CHARS, subsequent_indent="  ")
    ]
    legend_inches = 0.12 + 0.24 * ((len(handles) + 1) // 2)
    foot_inches = legend_inches + NOTE_LINE_INCHES * len(notes) + 0.15
    heights = [_block_inches(b) for b in blocks] + [foot_inches]
    fig = plt.figure(figsize=(FIGURE_WIDTH_INCHES, sum(heights)), dpi=DPI, layout="constrained")
    subs = fig.subfigures(len(heights), 1, height_ratios=heights, squeeze=False)[:, 0]
    for sub, block in zip(subs, blocks, strict=False):
        _draw_block(sub, block)
    foot = subs[-1]
    foot.legend(handles=handles, loc="upper left", ncols=2, fontsize=9, frameon=False)
    foot.text(
        0.01,
        1 - legend_inches / foot_inches,
        "\n".join(notes),
        ha="left",
        va="top",
        fontsize=9,
        linespacing=1.35,
        transform=foot.transSubfigure,
    )
    return fig


def write_chart(raw: Dict[str, Any], path: str) -> None:
    """Draw the figure of ``raw`` (``results.json``'s ``"raw"``) to the PNG at ``path``."""
    import matplotlib.pyplot as plt

    blocks = chart_blocks(raw)
    if not blocks:
        return
    fig = draw(blocks)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


__all__ = [
    "Block",
    "ChartRow",
    "Panel",
    "Spread",
    "chart_block",
    "chart_blocks",
    "draw",
    "paired_spread",
    "short_name",
    "write_chart",
]
