"""``python -m benchmarks sweep``: the regime map, where pipelining pays.

Short runs of a few of our pipelines against the plain training loop, one run
per point of a grid of embedding dimension x link speed, on the
``dlrm-dcnv2`` preset's model (26 tables, 214 ids per sample; only the
dimension changes).  The ids a step sends stay the same while the embeddings'
all-to-alls grow with the dimension, so the grid runs from the regime where the
ids are a large share of the link's bytes (dim 8: as many bytes as the pooled
embeddings, a quarter of the step's with the gradient all-reduce) to the one
where the model's own collectives fill it (dim 128: the ids are 3%), each at a
slow and a fast link.  Each point also records the any-schedule bound
(``benchmarks/measuring/schedule_bound.py``) and the dependency bound of each
semantics (``benchmarks/measuring/dependency_bound.py``), drawn as curves next
to the variants.

    python -m benchmarks sweep                               # 3 dims x 2 links, ~6-8 min
    python -m benchmarks sweep --dims 8,128 --link-gbits 1   # 2 points
    python -m benchmarks sweep --dry-run                     # print the planned runs only
    python -m benchmarks replot benchmarks/results/sweep     # redraw sweep.png

Writes ``<out-dir>/<name>/``: ``sweep.json`` (the grid, one record per
point), ``sweep.png`` (drawn by :mod:`benchmarks.figures.sweep_chart`) and
``points/<point>/``, each point's own results folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from benchmarks.figures.sweep_chart import POINTS, SWEEP_FIGURE, SWEEP_JSON
from benchmarks.settings.config import DLRM_BATCH, PRESETS

SWEEP_VARIANTS: Tuple[str, ...] = (
    "TrainPipelineSparseDist",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "StagedTrainPipeline",
)
# The modes of the throughput rows the sweep keeps: the training ones (Staged's is its own).
TRAINING_MODES = ("train", "staged")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Rough wall time of one point with the defaults (launch, builds, probe, rounds).
SECONDS_PER_POINT = 60


@dataclass(frozen=True)
class SweepConfig:
    """The grid and how long each point runs.

    Attributes:
        dims: embedding dimensions (every table of the preset takes each in turn).
        link_gbits: emulated link speeds, Gbit/s.
        variants: our pipeline classes at each point (each next to the plain loop).
        preset: the benchmark preset whose model every point runs.
        batch_size: per-rank batch size of every point.
        steps: batches per timed epoch.
        repeats: timed epochs per contender (the point's ratio is of their medians).
        warmup_steps: batches of the untimed warm-up epoch.
        out_dir: where the sweep's folder goes.
        name: the sweep's folder name.
    """

    dims: Tuple[int, ...] = (8, 32, 128)
    link_gbits: Tuple[float, ...] = (1.0, 10.0)
    variants: Tuple[str, ...] = SWEEP_VARIANTS
    preset: str = "dlrm-dcnv2"
    batch_size: int = DLRM_BATCH
    steps: int = 8
    repeats: int = 2
    warmup_steps: int = 2
    out_dir: str = "benchmarks/results"
    name: str = "sweep"

    def __post_init__(self) -> None:
        if not self.dims or min(self.dims) < 1:
            raise ValueError(f"--dims needs positive dimensions, got {self.dims}")
        if not self.link_gbits or min(self.link_gbits) <= 0:
            raise ValueError(f"--link-gbits needs positive speeds, got {self.link_gbits}")
        if not self.variants:
            raise ValueError("--variants needs at least one pipeline class")
        if self.preset not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        if self.batch_size < 1 or self.steps < 2 or self.repeats < 1 or self.warmup_steps < 1:
            raise ValueError(
                "--batch-size, --repeats and --warmup-steps must be >= 1 and --steps >= 2, got "
                f"{self.batch_size}, {self.repeats}, {self.warmup_steps}, {self.steps}"
            )

    def folder(self) -> str:
        """The sweep's results folder (relative paths from the repository)."""
        base = self.out_dir if os.path.isabs(self.out_dir) else os.path.join(REPO, self.out_dir)
        return os.path.join(base, self.name)

    @property
    def tables(self) -> int:
        return len(PRESETS[self.preset]["dims"])


@dataclass(frozen=True)
class SweepPoint:
    """One run of the grid: every table at ``dim``, over a ``link_gbit`` Gbit/s link."""

    dim: int
    link_gbit: float

    @property
    def name(self) -> str:
        return f"dim{self.dim}-{self.link_gbit:g}gbit"


def plan(cfg: SweepConfig) -> List[SweepPoint]:
    """The grid's points, link speed major, dimensions ascending within a speed."""
    return [SweepPoint(d, g) for g in cfg.link_gbits for d in sorted(set(cfg.dims))]


def point_argv(cfg: SweepConfig, point: SweepPoint) -> List[str]:
    """``python -m benchmarks`` options of one point (it writes to ``<folder>/points/<point>``)."""
    return [
        "--preset",
        cfg.preset,
        "--dims",
        ",".join([str(point.dim)] * cfg.tables),
        "--link-gbit",
        f"{point.link_gbit:g}",
        "--variants",
        ",".join(cfg.variants),
        "--no-torchrec",
        "--batch-sizes",
        str(cfg.batch_size),
        "--steps",
        str(cfg.steps),
        "--repeats",
        str(cfg.repeats),
        "--warmup-steps",
        str(cfg.warmup_steps),
        "--no-timelines",
        "--timeline-steps",
        "6",
        "--no-memory",
        "--no-overhead",
        "--no-progress",
        "--out-dir",
        os.path.join(cfg.folder(), POINTS),
        "--name",
        point.name,
    ]


def _median(measure: Optional[Mapping[str, Any]]) -> Optional[float]:
    return None if not measure else measure.get("median")


def point_record(point: SweepPoint, document: Mapping[str, Any]) -> Dict[str, Any]:
    """What the figure and the JSON keep of one point's ``results.json``."""
    record: Dict[str, Any] = {"dim": point.dim, "link_gbit": point.link_gbit, "name": point.name}
    blocks = (document.get("summary") or {}).get("throughput") or []
    if not blocks:
        return dict(record, status="failed", reason="no throughput in the point's results")
    block = blocks[0]
    plain = _median((block.get("plain") or {}).get("train"))
    bound = block.get("bound") or {}
    any_schedule = bound.get("any_schedule") or {}
    costs = bound.get("costs_ms_per_step") or {}
    link_bytes = bound.get("link_bytes_per_step") or {}
    record.update(
        status="ok",
        reason="",
        link_emulated=bool((document.get("link") or {}).get("emulated")),
        plain_qps=plain,
        bound_qps=any_schedule.get("bound_qps"),
        bound_binding=any_schedule.get("binding"),
        bound_vs_plain=_ratio(any_schedule.get("bound_qps"), plain),
        link_ms={"input_dist": costs.get("link_input_dist"), "model": costs.get("link_compute")},
        link_bytes={"input_dist": link_bytes.get("input_dist"), "model": link_bytes.get("compute")},
        compute_ms=(bound.get("stage_ms_per_step") or {}).get("compute"),
        dependency_vs_plain=_dependency_vs_plain(bound.get("dependency") or {}),
        variants={
            row["variant"]: {
                "ours_qps": _median(row.get("ours")),
                "ours_vs_plain": row.get("ours_vs_plain"),
            }
            for row in block.get("variants") or []
            if row.get("mode") in TRAINING_MODES
        },
    )
    return record


def _dependency_vs_plain(dependency: Mapping[str, Any]) -> Dict[str, Optional[float]]:
    """Each semantics' dependency bound over the plain loop (empty for a point without one)."""
    out: Dict[str, Optional[float]] = {}
    for semantics, values in (dependency.get("semantics") or {}).items():
        share = values.get("plain_of_bound")
        out[semantics] = 1.0 / share if share else None
    return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or not b else a / b


def run_point(cfg: SweepConfig, point: SweepPoint) -> Dict[str, Any]:
    """Run one point (its own ``python -m benchmarks``) and read back its record."""
    command = [sys.executable, "-m", "benchmarks", *point_argv(cfg, point)]
    print(f"sweep point {point.name}: {' '.join(command)}", flush=True)
    started = time.time()
    code = subprocess.run(command, cwd=REPO).returncode
    source = os.path.join(cfg.folder(), POINTS, point.name, "results.json")
    if code != 0 or not os.path.isfile(source):
        return {
            "dim": point.dim,
            "link_gbit": point.link_gbit,
            "name": point.name,
            "status": "failed",
            "reason": f"the run exited with {code}"
            + ("" if os.path.isfile(source) else ", no results.json"),
        }
    with open(source) as f:
        record = point_record(point, json.load(f))
    record["wall_seconds"] = round(time.time() - started, 1)
    return record


def sweep_document(cfg: SweepConfig, records: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """The sweep's JSON: its configuration and one record per point."""
    return {
        "kind": "sweep",
        "name": cfg.name,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": asdict(cfg),
        "unit": "global examples/s; ratios are of the medians over repeats",
        "points": [dict(r) for r in records],
    }


def write(document: Mapping[str, Any], folder: str) -> List[str]:
    """``sweep.json`` and ``sweep.png`` into ``folder``; returns the files written."""
    from benchmarks.figures import sweep_chart  # matplotlib only when drawing

    os.makedirs(folder, exist_ok=True)
    source = os.path.join(folder, SWEEP_JSON)
    with open(source, "w") as f:
        json.dump(document, f, indent=1)
    figure = os.path.join(folder, SWEEP_FIGURE)
    sweep_chart.write_chart(document, figure)
    return [source, figure]


def build_parser() -> argparse.ArgumentParser:
    defaults = SweepConfig()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks sweep",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )

    def tuple_of(kind: Any) -> Any:
        return lambda text: tuple(kind(p) for p in text.split(",") if p.strip())

    parser.add_argument(
        "--dims",
        type=tuple_of(int),
        default=defaults.dims,
        help="embedding dimensions (default: 8,32,128)",
    )
    parser.add_argument(
        "--link-gbits",
        type=tuple_of(float),
        default=defaults.link_gbits,
        help="emulated link speeds in Gbit/s (default: 1,10)",
    )
    parser.add_argument(
        "--variants",
        type=tuple_of(str),
        default=defaults.variants,
        help=f"our pipeline classes (default: {','.join(SWEEP_VARIANTS)})",
    )
    parser.add_argument(
        "--preset",
        default=defaults.preset,
        help=f"the model every point runs (default: {defaults.preset})",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=defaults.batch_size,
        help=f"per-rank batch size (default: {defaults.batch_size})",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=defaults.steps,
        help=f"batches per timed epoch (default: {defaults.steps})",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=defaults.repeats,
        help=f"timed epochs per contender (default: {defaults.repeats})",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=defaults.warmup_steps,
        help=f"warm-up batches (default: {defaults.warmup_steps})",
    )
    parser.add_argument(
        "--out-dir",
        default=defaults.out_dir,
        help=f"where the sweep's folder goes (default: {defaults.out_dir})",
    )
    parser.add_argument(
        "--name", default=defaults.name, help=f"the sweep's folder name (default: {defaults.name})"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the planned runs and exit")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> Tuple[SweepConfig, bool]:
    """``(config, dry_run)`` from the sweep's command line (errors exit with usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    values = {k: v for k, v in vars(args).items() if k != "dry_run"}
    try:
        return SweepConfig(**values), bool(args.dry_run)
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits


def main(argv: Optional[Sequence[str]] = None) -> int:
    cfg, dry_run = parse_args(argv)
    points = plan(cfg)
    print(
        f"sweep '{cfg.name}': {len(points)} points x {len(cfg.variants)} variants + the plain loop, "
        f"about {len(points) * SECONDS_PER_POINT / 60:.0f} min on a quiet 2-core machine",
        flush=True,
    )
    if dry_run:
        for point in points:
            print(f"{point.name}: python -m benchmarks {' '.join(point_argv(cfg, point))}")
        return 0
    records = [run_point(cfg, point) for point in points]
    for path in write(sweep_document(cfg, records), cfg.folder()):
        print(f"wrote {os.path.relpath(path, os.getcwd())}", flush=True)
    return 0 if all(r["status"] == "ok" for r in records) else 1


__all__ = [
    "POINTS",
    "SWEEP_FIGURE",
    "SWEEP_JSON",
    "SWEEP_VARIANTS",
    "SweepConfig",
    "SweepPoint",
    "build_parser",
    "main",
    "parse_args",
    "plan",
    "point_argv",
    "point_record",
    "run_point",
    "sweep_document",
    "write",
]
