"""The verdict's words for the faster variants it left out, and why (its budget, or the
modules they leave unpipelined): a part of :mod:`trec_pipelines.advise.verdict`'s reasons."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from trec_pipelines.observe.memory import format_bytes

if TYPE_CHECKING:
    from trec_pipelines.advise.report import VariantReport


def pct(a: float, b: float) -> str:
    """How much faster ``a`` is than ``b``: whole percent, one decimal under 1%."""
    percent = 100 * (a / b - 1)
    return f"{percent:.1f}%" if abs(percent) < 1 else f"{percent:.0f}%"


def left_out(
    ran: Sequence["VariantReport"],
    pool: Sequence["VariantReport"],
    budget: Optional[int],
    than: float,
) -> str:
    """``; Y is 5% faster but exceeds the budget by ...``: the fastest variant left out for its
    memory, or else for the modules it left unpipelined ("" when none left out is faster)."""
    faster = [r for r in ran if r not in pool and (r.vs_plain or 0.0) > than]
    over = [
        r for r in faster if budget is not None and (r.held_peak is None or r.held_peak > budget)
    ]
    if over:
        top = max(over, key=lambda r: r.vs_plain or 0.0)
        excess = (top.held_peak or 0) - (budget or 0)
        by = pct(top.vs_plain or 0.0, than)
        return f"; {top.name} is {by} faster but exceeds the budget by {format_bytes(excess)}"
    if faster:
        top = max(faster, key=lambda r: r.vs_plain or 0.0)
        names = ", ".join(m for m, _ in top.unpipelined)
        return f"; {top.name} is {pct(top.vs_plain or 0.0, than)} faster but leaves {names} unpipelined"
    return ""


__all__ = ["left_out", "pct"]
