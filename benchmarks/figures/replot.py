"""``python -m benchmarks replot DIR``: redraw a results folder's figures from its ``results.json``.

Nothing is run or measured: the figures are drawn from the raw measurements
the folder already holds (the QPS figure, and each timeline the run stored
with its recorded epoch), so the figures of a committed run can follow
changes to how they are drawn.  ``results.json`` and ``table.txt`` are
left as they are.  A run from before timelines were stored keeps its
timeline pictures as they are, and a run from before the memory figures
were stored (``memory_<Variant>_b<batch>.png``, drawn with ``--memory
--timelines``) keeps those.  A sweep's folder (``python -m benchmarks
sweep``: it holds ``sweep.json``) gets its ``sweep.png`` redrawn, and each of
its points' run folders its figures.

    python -m benchmarks replot benchmarks/results/<run>               # <run>/qps.png, <run>/timelines/
    python -m benchmarks replot benchmarks/results/<run> --out /tmp/x  # /tmp/x/qps.png, /tmp/x/timelines/
    python -m benchmarks replot benchmarks/results/sweep               # sweep/sweep.png
"""

from __future__ import annotations

import argparse
import json
import os
from typing import List, Optional, Sequence

from benchmarks.figures import qps_chart, sweep_chart, timelines

CHART = "qps.png"
TIMELINES = "timelines"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks replot",
        description="Redraw the QPS figure, the stored timelines and memory figures of a results folder "
        "from its results.json, or a sweep folder's sweep.png from its sweep.json "
        "(nothing is run; results.json and table.txt are left as they are).",
    )
    parser.add_argument("folder", help="a results folder (holds results.json)")
    parser.add_argument(
        "--out", default=None, help="folder to write the figure to (default: the results folder)"
    )
    return parser


def replot(folder: str, out: Optional[str] = None) -> List[str]:
    """Redraw ``folder``'s figures into ``out`` (default ``folder``); returns the files written."""
    if os.path.isfile(os.path.join(folder, sweep_chart.SWEEP_JSON)):
        return _replot_sweep(folder, out if out is not None else folder)
    source = os.path.join(folder, "results.json")
    if not os.path.isfile(source):
        raise FileNotFoundError(
            f"{source} not found: replot takes a results folder of the benchmark "
            f"(or of a sweep, holding {sweep_chart.SWEEP_JSON})"
        )
    with open(source) as f:
        document = json.load(f)
    target = out if out is not None else folder
    os.makedirs(target, exist_ok=True)
    path = os.path.join(target, CHART)
    qps_chart.write_chart(document["raw"], path)
    written = [path] if os.path.exists(path) else []
    pictures = os.path.join(target, TIMELINES)
    written += timelines.redraw_timelines(document, pictures)
    return written + timelines.redraw_memory_timelines(document, pictures)


def _replot_sweep(folder: str, target: str) -> List[str]:
    """A sweep folder's ``sweep.png`` from its ``sweep.json``, and each point's run figures."""
    with open(os.path.join(folder, sweep_chart.SWEEP_JSON)) as f:
        document = json.load(f)
    os.makedirs(target, exist_ok=True)
    path = os.path.join(target, sweep_chart.SWEEP_FIGURE)
    sweep_chart.write_chart(document, path)
    written = [path]
    points = os.path.join(folder, sweep_chart.POINTS)
    for name in sorted(os.listdir(points)) if os.path.isdir(points) else []:
        if os.path.isfile(os.path.join(points, name, "results.json")):
            written += replot(
                os.path.join(points, name), os.path.join(target, sweep_chart.POINTS, name)
            )
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        written = replot(args.folder, args.out)
    except FileNotFoundError as error:
        print(error)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


__all__ = ["CHART", "TIMELINES", "build_parser", "main", "replot"]
