"""The header lines of a run's results table: what ran, on what link, what the link carries."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from benchmarks.measuring import link_bytes
from benchmarks.settings.config import BenchConfig


def header(
    cfg: BenchConfig,
    world: int,
    backend: str,
    device: str,
    seconds: float,
    link: Dict[str, Any],
    notes: Sequence[str],
) -> List[str]:
    """The run line, the interconnect line, the link's bytes per batch size (table_wise
    sharding only), then the notes.

    ``link``: the runner's link facts (``runner.link_facts``).
    """
    lines = [
        f"trec_pipelines benchmark '{cfg.run_name()}': {world} {backend} ranks on {device.upper()}, "
        f"{cfg.sharding_type}, {len(cfg.dims)} tables x {cfg.rows:,} rows, {cfg.pooling_text()}, "
        f"{cfg.interaction} interaction, {cfg.threads} thread(s)/rank; "
        f"wall time {seconds / 60:.1f} min",
        link_line(link),
    ]
    if cfg.sharding_type == "table_wise":  # what benchmarks/measuring/link_bytes.py assumes
        spec = cfg.model_spec()
        lines += [link_bytes.describe(spec, b, world, cfg.link_gbit) for b in cfg.batch_sizes]
    return lines + [f"note: {n}" for n in notes]


def link_line(link: Dict[str, Any]) -> str:
    """The interconnect line, from the runner's link facts (``runner.link_facts``)."""
    if link["requested_gbit"] is None:
        return "interconnect: none emulated (loopback at memory speed)"
    if link["emulated"]:
        return (
            f"interconnect: emulated {link['requested_gbit']:g} Gbit/s ({link['qdisc']}, "
            "private network namespace)"
        )
    return (
        f"interconnect: {link['requested_gbit']:g} Gbit/s requested but NOT emulated: "
        f"{link['not_emulated_because']}"
    )


__all__ = ["header", "link_line"]
