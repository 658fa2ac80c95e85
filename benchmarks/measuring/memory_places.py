"""Held memory by place (host batches, device batches) against torchrec's same class.

Reads the per-rank entries ``benchmarks/measuring/memory.py`` writes (``held_epoch``:
``max_host_batches``, ``max_device_batches``, ``place_peaks``,
``agree_ahead``) and says, per variant, whether ours holds more than
torchrec's class in either place.  One host batch more is expected, and
allowed, where ours pulls a batch ahead for the ranks' agreement on each batch
(``agree_ahead=True``, the default; see the memory guide): the row says so.
Results written before places were measured give no figures (``-``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from trec_pipelines.observe.memory import DEVICE_BATCH, HOST_BATCH

# The host batches ours may hold above torchrec's class when it agrees a pull ahead.
AGREEMENT_HOST_BATCHES = 1
# Byte figures may differ this much with equal batch counts: the batches' sizes
# vary (jagged ids), and the two libraries' largest steps need not be the same one.
BYTES_TOLERANCE = 0.02


@dataclass(frozen=True)
class PlaceFigures:
    """One contender's held memory by place, the largest over its ranks.

    Attributes:
        host_batches: most host batches (pulled, not yet copied) held after a step.
        device_batches: most device batches held after a step.
        host_bytes: the largest bytes held in host batches after a step.
        device_bytes: the largest bytes held in device batches after a step.
        agree_ahead: ours pulls a batch ahead for the ranks' agreement (any rank).
    """

    host_batches: int
    device_batches: int
    host_bytes: int
    device_bytes: int
    agree_ahead: bool

    @property
    def one_host_batch(self) -> float:
        """The bytes of one host batch, on average (0 without host batches)."""
        return self.host_bytes / self.host_batches if self.host_batches else 0.0


def _ok_ranks(entry: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
    if not entry or entry.get("status") != "ok":
        return []
    return [r for r in entry.get("ranks") or [] if r]


def figures(entry: Optional[Dict[str, Any]]) -> Optional[PlaceFigures]:
    """``entry``'s figures by place; None when it was not measured by place."""
    ranks = _ok_ranks(entry)
    if not ranks or any("max_host_batches" not in r for r in ranks):
        return None
    return PlaceFigures(
        host_batches=max(r["max_host_batches"] for r in ranks),
        device_batches=max(r["max_device_batches"] for r in ranks),
        host_bytes=max(r["place_peaks"].get(HOST_BATCH, 0) for r in ranks),
        device_bytes=max(r["place_peaks"].get(DEVICE_BATCH, 0) for r in ranks),
        agree_ahead=any(r.get("agree_ahead") for r in ranks),
    )


def _more(ours: float, theirs: float, allowed: float = 0.0) -> bool:
    return ours > (theirs + allowed) * (1 + BYTES_TOLERANCE)


def excess(ours: PlaceFigures, theirs: PlaceFigures) -> List[str]:
    """What ``ours`` holds above ``theirs``, per place (empty: nothing)."""
    out = []
    if ours.device_batches > theirs.device_batches:
        out.append(f"device batches {ours.device_batches} > {theirs.device_batches}")
    elif _more(ours.device_bytes, theirs.device_bytes):
        out.append(f"device batch bytes {ours.device_bytes} > {theirs.device_bytes}")
    allowed = AGREEMENT_HOST_BATCHES if ours.agree_ahead else 0
    if ours.host_batches > theirs.host_batches + allowed:
        out.append(f"host batches {ours.host_batches} > {theirs.host_batches} + {allowed}")
    elif _more(ours.host_bytes, theirs.host_bytes, allowed * ours.one_host_batch):
        out.append(f"host batch bytes {ours.host_bytes} > {theirs.host_bytes} + {allowed} batch")
    return out


def above_torchrec(memory: Dict[str, Any], variants: Sequence[str]) -> Dict[str, List[str]]:
    """Per variant measured by place on both sides: what ours holds above torchrec's
    class (only variants with something above are listed)."""
    out: Dict[str, List[str]] = {}
    for variant in variants:
        ours = figures(memory.get(f"ours:{variant}"))
        theirs = figures(memory.get(f"torchrec:{variant}"))
        if ours is None or theirs is None:
            continue
        found = excess(ours, theirs)
        if found:
            out[variant] = found
    return out


def verdict(ours: Optional[PlaceFigures], theirs: Optional[PlaceFigures]) -> str:
    """The table's cell: ``<=`` (nothing above torchrec's), ``+1 host (agreement)``,
    ``ABOVE: ...``, or ``-`` (a side not measured by place)."""
    if ours is None or theirs is None:
        return "-"
    found = excess(ours, theirs)
    if found:
        return "ABOVE: " + "; ".join(found)
    if ours.agree_ahead and ours.host_batches > theirs.host_batches:
        return f"+{ours.host_batches - theirs.host_batches} host (agreement)"
    return "<="


def agreement_note(memory: Dict[str, Any], variants: Sequence[str]) -> Optional[str]:
    """A line naming the agreement's host batch and its bytes (None: no row has one)."""
    sizes = []
    for variant in variants:
        ours = figures(memory.get(f"ours:{variant}"))
        theirs = figures(memory.get(f"torchrec:{variant}"))
        if ours is None or not ours.agree_ahead or not ours.host_batches:
            continue
        if theirs is None or ours.host_batches > theirs.host_batches:
            sizes.append(ours.one_host_batch)
    if not sizes:
        return None
    return (
        f"  +1 host (agreement): ours pulls one host batch ahead so the ranks' agreement on it rides "
        f"the current step's exchange (agree_ahead=True, the default): {max(sizes) / 2**20:,.2f} MiB "
        "here, host memory on a GPU; agree_ahead=False drops it (each pull agreed as it is made, "
        "with a blocking round trip)"
    )


__all__ = [
    "AGREEMENT_HOST_BATCHES",
    "BYTES_TOLERANCE",
    "PlaceFigures",
    "above_torchrec",
    "agreement_note",
    "excess",
    "figures",
    "verdict",
]
