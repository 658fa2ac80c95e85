"""What the ranks' agreement on each batch costs: each pipeline with and without it, paired.

Read from a throughput table holding ``[no agreement]`` twins (``--agreement-off``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import List, Optional

from benchmarks.tables.memory_report import aligned_table
from benchmarks.tables.report import NO_AGREEMENT, ThroughputTable


@dataclass
class AgreementCost:
    """One pipeline with and without the ranks' agreement (``--agreement-off``), paired.

    ``paired`` is the median over rounds of (with / without) examples/s within a
    round (the two run back to back); ``low``/``high`` the smallest and largest
    of those per-round ratios: within noise when they straddle 1.
    """

    variant: str
    paired: float
    low: float
    high: float
    rounds: int


def agreement_costs(table: "ThroughputTable") -> List[AgreementCost]:
    """Each row that has a ``[no agreement]`` twin in ``table``, paired with it."""
    rows = {r.variant: r for r in table.rows}
    costs = []
    for row in table.rows:
        twin = rows.get(f"{row.variant} {NO_AGREEMENT}")
        on, off = row.ours.samples, twin.ours.samples if twin is not None else []
        if twin is None or row.ours.median is None or twin.ours.median is None:
            continue
        if len(on) != len(off) or not on:
            continue
        ratios = sorted(a / b for a, b in zip(on, off, strict=True))
        costs.append(
            AgreementCost(row.variant, statistics.median(ratios), ratios[0], ratios[-1], len(on))
        )
    return costs


def format_agreement(table: "ThroughputTable") -> Optional[str]:
    """The agreement's cost per pipeline at this batch size, or None without twins."""
    costs = agreement_costs(table)
    if not costs:
        return None
    body = [
        [c.variant, f"{c.paired:.3f}", f"{c.low:.3f}..{c.high:.3f}", str(c.rounds)] for c in costs
    ]
    head = (
        f"The ranks' agreement on each batch at batch {table.batch_size}/rank: examples/s with "
        "it (the default) / without it (sync_exhaustion=False), paired within each round"
    )
    lines = [head] + aligned_table(["variant", "paired", "per-round range", "rounds"], body)
    lines.append("  within noise where the per-round range straddles 1.000")
    return "\n".join(lines)
