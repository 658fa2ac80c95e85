"""The regime map's figure (``sweep.png``): speed-up over the plain loop against embedding dim.

One panel per link speed; in each, a line per variant of ours (its examples/s
over the plain loop's at that point) and the any-schedule bound over the
plain loop (the most any schedule could gain there), against the tables'
embedding dimension on a log axis.  Under each dimension, the input dist's
share of the bytes the step put on the link: where it is small, the link
carries the model's own collectives, which no schedule that keeps the batch
whole can hide.

:func:`panels` computes what is drawn (no matplotlib), :func:`write_chart`
draws it and saves the PNG.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

# The sweep folder's files: what it measured, and the figure drawn from it.
SWEEP_JSON = "sweep.json"
SWEEP_FIGURE = "sweep.png"
# The subfolder holding one run folder per point.
POINTS = "points"

BOUND_COLOR = "tab:green"
# The variants' colours: any but the bound's.
VARIANT_COLORS = (
    "tab:blue",
    "tab:orange",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:olive",
)
BOUND_LABEL = "any-schedule bound"
# The dependency bounds' curves, per semantics: (label, colour, line style).
DEPENDENCY_STYLE = {
    "sync": ("sync dependency bound", "tab:gray", ":"),
    "one-step-stale": ("one-step-stale dependency bound", "tab:cyan", ":"),
}

Series = List[Tuple[int, Optional[float]]]


@dataclass
class Panel:
    """One link speed's curves: ``(dim, ratio over the plain loop)`` per series."""

    link_gbit: float
    dims: List[int] = field(default_factory=list)
    variants: Dict[str, Series] = field(default_factory=dict)
    bound: Series = field(default_factory=list)
    dependency: Dict[str, Series] = field(default_factory=dict)  # semantics -> curve
    input_dist_share: Dict[int, Optional[float]] = field(default_factory=dict)
    failed: List[int] = field(default_factory=list)


def _share(point: Mapping[str, Any]) -> Optional[float]:
    sizes = point.get("link_bytes") or {}
    ids, model = sizes.get("input_dist"), sizes.get("model")
    if ids is None or model is None or ids + model <= 0:
        return None
    return float(ids) / float(ids + model)


def panels(document: Mapping[str, Any]) -> List[Panel]:
    """The figure's panels from a ``sweep.json`` document, slowest link first."""
    by_link: Dict[float, Panel] = {}
    for point in document.get("points") or []:
        link = float(point["link_gbit"])
        panel = by_link.setdefault(link, Panel(link))
        dim = int(point["dim"])
        panel.dims.append(dim)
        if point.get("status") != "ok":
            panel.failed.append(dim)
            continue
        for variant, values in (point.get("variants") or {}).items():
            panel.variants.setdefault(variant, []).append((dim, values.get("ours_vs_plain")))
        panel.bound.append((dim, point.get("bound_vs_plain")))
        for semantics, ratio in (point.get("dependency_vs_plain") or {}).items():
            panel.dependency.setdefault(semantics, []).append((dim, ratio))
        panel.input_dist_share[dim] = _share(point)
    for panel in by_link.values():
        panel.dims.sort()
        panel.bound.sort()
        for series in panel.dependency.values():
            series.sort()
        for series in panel.variants.values():
            series.sort()
    return [by_link[k] for k in sorted(by_link)]


def _tick(dim: int, share: Optional[float]) -> str:
    return f"{dim}" if share is None else f"{dim}\nids {100 * share:.0f}%"


def _draw_panel(ax: Any, panel: Panel) -> None:
    for k, (variant, series) in enumerate(sorted(panel.variants.items())):
        xs = [d for d, r in series if r is not None]
        color = VARIANT_COLORS[k % len(VARIANT_COLORS)]
        ax.plot(xs, [r for _, r in series if r is not None], marker="o", color=color, label=variant)
    xs = [d for d, r in panel.bound if r is not None]
    ax.plot(
        xs,
        [r for _, r in panel.bound if r is not None],
        linestyle="--",
        marker="^",
        color=BOUND_COLOR,
        label=BOUND_LABEL,
    )
    for semantics, series in sorted(panel.dependency.items()):
        label, color, style = DEPENDENCY_STYLE.get(semantics, (semantics, "tab:gray", ":"))
        xs = [d for d, r in series if r is not None]
        ax.plot(
            xs,
            [r for _, r in series if r is not None],
            linestyle=style,
            marker="v",
            color=color,
            label=label,
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(panel.dims)
    ax.set_xticklabels([_tick(d, panel.input_dist_share.get(d)) for d in panel.dims])
    ax.minorticks_off()
    title = f"link {panel.link_gbit:g} Gbit/s"
    if panel.failed:
        title += f" (failed: dim {', '.join(str(d) for d in panel.failed)})"
    ax.set_title(title)
    ax.set_xlabel("embedding dim (ids' share of the link's bytes)")
    ax.grid(True, alpha=0.3)


def write_chart(document: Mapping[str, Any], path: str) -> None:
    """Draw ``document``'s regime map into the PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = panels(document)
    if not drawn:
        raise ValueError("the sweep has no points to draw: run `python -m benchmarks sweep` first")
    fig, axes = plt.subplots(
        1, len(drawn), figsize=(5.5 * len(drawn), 4.5), sharey=True, squeeze=False
    )
    for ax, panel in zip(axes[0], drawn, strict=True):
        _draw_panel(ax, panel)
    axes[0][0].set_ylabel("examples/s over the plain loop")
    axes[0][-1].legend(fontsize="small", loc="best")
    config = document.get("config") or {}
    fig.suptitle(
        f"Where pipelining pays: preset {config.get('preset', '?')}, batch {config.get('batch_size', '?')}/rank,\n"
        f"median of {config.get('repeats', '?')} epochs of {config.get('steps', '?')} steps per point"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["BOUND_LABEL", "Panel", "panels", "write_chart"]
