"""The header lines of a run's results table: what ran, on what link, what the link carries."""

from __future__ import annotations

from typing import List, Sequence

from benchmarks import link_bytes
from benchmarks.config import BenchConfig


def header(
    cfg: BenchConfig,
    world: int,
    backend: str,
    device: str,
    seconds: float,
    link_line: str,
    notes: Sequence[str],
) -> List[str]:
    """The run line, the interconnect line, the link's bytes per batch size, then the notes."""
    lines = [
        f"trec_pipelines benchmark '{cfg.run_name()}': {world} {backend} ranks on {device.upper()}, "
        f"{cfg.sharding_type}, {len(cfg.dims)} tables x {cfg.rows:,} rows, {cfg.pooling_text()}, "
        f"{cfg.interaction} interaction, {cfg.threads} thread(s)/rank; "
        f"wall time {seconds / 60:.1f} min",
        link_line,
    ]
    spec = cfg.model_spec()
    lines += [link_bytes.describe(spec, b, world, cfg.link_gbit) for b in cfg.batch_sizes]
    return lines + [f"note: {n}" for n in notes]


__all__ = ["header"]
