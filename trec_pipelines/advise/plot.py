"""The advice as a picture: QPS against pipeline-held memory, one point per variant.

matplotlib is not a dependency of the package (it never replaces a user's
stack); without it :func:`save_plot` says how to get it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

MIB = 2**20


def save_plot(advice: Any, path: str) -> None:
    """Write ``advice`` (an :class:`~trec_pipelines.advise.advice.Advice`, which calls this;
    typed loosely so this module needs nothing of that one) to the PNG ``path``:
    held bytes on x (MiB, or KiB when everything is under one MiB), QPS on y,
    the budget and the plain loop as lines."""
    if importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError(
            "advise: the PNG needs matplotlib, which is not installed; `pip install matplotlib`, "
            "or leave the picture out (--no-plot; the table and the JSON have every number)"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [r for r in advice.variants if r.ran and r.qps is not None and r.held_peak is not None]
    largest = max([r.held_peak for r in points] + [advice.memory_budget or 0])
    unit, scale = ("MiB", MIB) if largest >= MIB else ("KiB", 1024)
    fig, ax = plt.subplots(figsize=(8, 5))
    for row in points:
        picked = row.name == advice.recommended
        ax.scatter(
            [row.held_peak / scale],
            [row.qps],
            s=80 if picked else 40,
            marker="*" if picked else "o",
            color="tab:red" if picked else "tab:blue",
            zorder=3,
        )
        label = row.name.replace("TrainPipeline", "").replace("PipelineSparseDist", "") or row.name
        ax.annotate(
            label,
            (row.held_peak / scale, row.qps),
            textcoords="offset points",
            xytext=(5, 4),
            fontsize=8,
        )
    if advice.plain.qps is not None:
        ax.axhline(advice.plain.qps, color="gray", linestyle=":", label="plain loop")
    if advice.memory_budget is not None:
        ax.axvline(
            advice.memory_budget / scale, color="tab:red", linestyle="--", label="memory budget"
        )
    ax.set_xlabel(f"held by the pipeline (memory ledger peak), {unit}")
    ax.set_ylabel(advice.qps_unit)
    ax.set_title(f"advise: {advice.recommended or 'no recommendation'}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["save_plot"]
