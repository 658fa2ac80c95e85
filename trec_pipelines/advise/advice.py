"""What advise found: one row per variant, the recommendation and its reason.

[Note: the recommendation rule]
Among the variants that ran (on every rank, every round):

1. keep those whose pipeline-held bytes (the memory ledger's peak, the
   largest rank's) are within ``memory_budget``, when one is given;
2. if any of them pipelined every sharded module, drop those that left a
   module unpipelined;
3. the fastest of the rest (QPS / the plain loop's, as the bench's ratio),
   unless another is within the measured noise of it and holds less: then
   the one holding least among those within the noise.

The sentence says what the faster variants left out would cost (over the
budget by how much, which modules they leave unpipelined, how much more they
hold), and says so when even the pick is slower than the plain loop beyond
the noise.

The noise is the median, over variants, of the half-range of each one's
per-round ratio to the plain loop of the same round (each round builds and
trains every contender once, so a ratio within one round shares the
machine's state).  The median, not the largest: one variant hit by a stall
would otherwise make every other one "within the noise".  With one round
there is no noise figure and rule 3 is plain "fastest".
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from trec_pipelines.observe.memory import format_bytes

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_bytes(value: Union[int, float, str, None]) -> Optional[int]:
    """``64MiB``, ``1.5 GiB``, ``500MB`` or a number of bytes; None stays None."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"memory_budget must be >= 0 bytes, got {value}")
        return int(value)
    text = value.strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number) :]
    if unit not in _UNITS or not number:
        raise ValueError(
            f"memory_budget={value!r}: give bytes as a number, or with a unit: "
            "B, KiB, MiB, GiB, KB, MB, GB (e.g. '64MiB')"
        )
    return parse_bytes(float(number) * _UNITS[unit])


# A noise band this wide (a tenth of the plain loop's speed) is flagged in the table.
NOISY = 0.10


@dataclass(frozen=True)
class VariantReport:
    """One variant (or the plain loop) as advise measured it.

    Attributes:
        name: the pipeline class name, or ``"plain loop"``.
        applicable: False when the model lacks what it needs (``reason`` says what).
        ran: it trained every round on every rank.
        reason: why it is not applicable; empty otherwise.
        error: the first failure (rank and message) when it did not run.
        seconds: the timed epoch per round, the slowest rank's.
        steps: steps per timed epoch.
        qps: examples (all ranks) per second, median over rounds; steps/s
            when the batches have no KeyedJaggedTensor to count samples by.
        vs_plain: ``qps`` / the plain loop's ``qps`` (ratio of medians, as the bench).
        paired: per round, its ratio to the plain loop of that round.
        held_peak, held_steady: the memory ledger's peak and steady bytes
            held by the pipeline (model and optimizer excluded), largest rank.
        rss_peak: largest resident memory after a step of its measured
            epochs, largest rank (the whole process, model included).  The
            contenders run one after another in one process and freed memory
            seldom leaves it, so a later contender's figure includes what
            earlier ones left behind: compare variants by ``held_peak``.
        device_peak: the device allocator's max allocated, largest rank (None on CPU).
        hidden_input_dist: 1 - its training-thread input-dist time per steady
            step / the plain loop's (each the median over steps, then over
            rounds), clipped to [0, 1], mean over ranks.
        unpipelined: sharded modules its rewrite left unpipelined, and why.
        within_budget: whether ``held_peak`` fits the budget (None: no budget).
    """

    name: str
    applicable: bool = True
    ran: bool = False
    reason: str = ""
    error: str = ""
    seconds: Tuple[float, ...] = ()
    steps: int = 0
    qps: Optional[float] = None
    vs_plain: Optional[float] = None
    paired: Tuple[float, ...] = ()
    held_peak: Optional[int] = None
    held_steady: Optional[int] = None
    rss_peak: Optional[int] = None
    device_peak: Optional[int] = None
    hidden_input_dist: Optional[float] = None
    unpipelined: Tuple[Tuple[str, str], ...] = ()
    within_budget: Optional[bool] = None

    @property
    def status(self) -> str:
        if not self.applicable:
            return "not applicable"
        return "ok" if self.ran else "failed"


@dataclass(frozen=True)
class Advice:
    """The result of :func:`trec_pipelines.advise`: every rank gets an equal one.

    Attributes:
        recommended: the variant to use (None: no variant ran within the budget).
        reason: one sentence saying why.
        variants: a row per variant asked for, in the order timed.
        plain: the plain loop's row (the reference of every ratio).
        memory_budget: the budget in bytes of pipeline-held memory (None: none).
        noise: the noise band of the ratios (see [Note: the recommendation rule]).
        rounds, warmup, steps: how it was measured.
        world_size: ranks that trained.
        qps_unit: ``"examples/s"`` or ``"steps/s"``.
    """

    recommended: Optional[str]
    reason: str
    variants: Tuple[VariantReport, ...]
    plain: VariantReport
    memory_budget: Optional[int]
    noise: float
    rounds: int
    warmup: int
    steps: int
    world_size: int
    qps_unit: str = "examples/s"

    def __getitem__(self, name: str) -> VariantReport:
        for row in self.variants + (self.plain,):
            if row.name == name:
                return row
        raise KeyError(
            f"no variant {name!r} in this advice (has {', '.join(r.name for r in self.variants)})"
        )

    def for_budget(self, memory_budget: Union[int, float, str, None]) -> "Advice":
        """The same measurements judged against another budget, without re-measuring.

        ``memory_budget``: bytes, or a string such as ``"64MiB"``; None for no budget.
        """
        memory_budget = parse_bytes(memory_budget)
        rows = tuple(
            replace(
                r,
                within_budget=None
                if memory_budget is None or not r.ran
                else (r.held_peak is not None and r.held_peak <= memory_budget),
            )
            for r in self.variants
        )
        recommended, reason = recommend(rows, memory_budget, self.noise)
        plain = replace(self.plain, within_budget=None if memory_budget is None else True)
        return replace(
            self,
            variants=rows,
            plain=plain,
            memory_budget=memory_budget,
            recommended=recommended,
            reason=reason,
        )

    def to_dict(self) -> Dict[str, Any]:
        """Plain JSON types: what ``write_json`` writes."""
        return asdict(self)

    def write_json(self, path: str, extra: Optional[Dict[str, Any]] = None) -> None:
        with open(path, "w") as f:
            json.dump({**self.to_dict(), **(extra or {})}, f, indent=1)

    def table(self) -> str:
        """The advice as a text table, then the recommendation and the notes of each row."""
        header = (
            "variant",
            self.qps_unit,
            "x plain",
            "held (ledger)",
            "peak RSS",
            "peak device",
            "input dist hidden",
            "unpipelined",
            "status",
        )
        rows: List[Sequence[str]] = []
        for r in (self.plain,) + self.variants:
            mark = "*" if r.name == self.recommended else " "
            rows.append(
                (
                    f"{mark} {r.name}",
                    "-" if r.qps is None else f"{r.qps:,.0f}",
                    "-" if r.vs_plain is None else f"{r.vs_plain:.2f}",
                    format_bytes(r.held_peak) + ("" if r.within_budget is not False else " (over)"),
                    format_bytes(r.rss_peak),
                    format_bytes(r.device_peak),
                    "-" if r.hidden_input_dist is None else f"{100 * r.hidden_input_dist:.0f}%",
                    str(len(r.unpipelined)) if r.ran else "-",
                    r.status,
                )
            )
        widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
        lines.append("  ".join("-" * w for w in widths))
        lines += [
            "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in rows
        ]
        budget = "none" if self.memory_budget is None else format_bytes(self.memory_budget)
        lines.append(
            f"{self.world_size} ranks, {self.rounds} round(s) of warm-up {self.warmup} "
            f"+ {self.steps} timed steps; "
            f"memory budget {budget}; noise band ±{self.noise:.3f}"
            + (" (noisy: more --rounds or --steps narrow it)" if self.noise >= NOISY else "")
        )
        lines.append(f"recommended: {self.reason}")
        for r in self.variants:
            if not r.applicable:
                lines.append(f"  {r.name}: not applicable: {r.reason}")
            elif not r.ran:
                lines.append(f"  {r.name}: failed: {r.error}")
            for module, why in r.unpipelined:
                lines.append(f"  {r.name}: {module} not pipelined: {why}")
        return "\n".join(lines)

    def save_plot(self, path: str) -> None:
        """QPS against pipeline-held memory per variant, the budget as a vertical line (a PNG).

        Needs matplotlib (not a dependency of the package): ``pip install matplotlib``.
        """
        from trec_pipelines.advise.plot import save_plot

        save_plot(self, path)


def _pct(a: float, b: float) -> str:
    """How much faster ``a`` is than ``b``: whole percent, one decimal under 1%."""
    percent = 100 * (a / b - 1)
    return f"{percent:.1f}%" if abs(percent) < 1 else f"{percent:.0f}%"


def recommend(
    rows: Sequence[VariantReport], budget: Optional[int], noise: float
) -> Tuple[Optional[str], str]:
    """The recommended variant and the sentence saying why ([Note: the recommendation rule])."""
    ran = [r for r in rows if r.ran and r.vs_plain is not None]
    if not ran:
        return None, "no variant ran; see each row's error or reason"
    fits = [r for r in ran if budget is None or (r.held_peak is not None and r.held_peak <= budget)]
    if not fits:
        least = min(
            (r for r in ran if r.held_peak is not None),
            key=lambda r: r.held_peak or 0,
            default=None,
        )
        smallest = (
            f"; the least is {least.name} with {format_bytes(least.held_peak)}" if least else ""
        )
        return None, (
            f"no variant holds within the budget of {format_bytes(budget)}{smallest}: "
            "raise the budget or train without a pipeline"
        )
    clean = [r for r in fits if not r.unpipelined]
    pool = clean or fits
    fastest = max(pool, key=lambda r: r.vs_plain or 0.0)
    near = [r for r in pool if (r.vs_plain or 0.0) >= (fastest.vs_plain or 0.0) - noise]
    pick = min(
        near,
        key=lambda r: (
            r.held_peak if r.held_peak is not None else float("inf"),
            -(r.vs_plain or 0.0),
        ),
    )
    assert pick.vs_plain is not None
    sentence = f"{pick.name}: {pick.vs_plain:.2f}x plain, +{format_bytes(pick.held_peak)} held"
    faster = [r for r in ran if (r.vs_plain or 0.0) > pick.vs_plain]
    over = [r for r in faster if r not in fits]
    blocked = [r for r in faster if r in fits and r not in pool]
    if over:
        top = max(over, key=lambda r: r.vs_plain or 0.0)
        excess = (top.held_peak or 0) - (budget or 0)
        faster_by = _pct(top.vs_plain or 0.0, pick.vs_plain)
        sentence += (
            f"; {top.name} is {faster_by} faster but exceeds the budget by {format_bytes(excess)}"
        )
    elif blocked:
        top = max(blocked, key=lambda r: r.vs_plain or 0.0)
        names = ", ".join(m for m, _ in top.unpipelined)
        sentence += f"; {top.name} is {_pct(top.vs_plain or 0.0, pick.vs_plain)} faster but leaves {names} unpipelined"
    elif pick is not fastest:
        more = (fastest.held_peak or 0) - (pick.held_peak or 0)
        sentence += (
            f"; {fastest.name} is {_pct(fastest.vs_plain or 0.0, pick.vs_plain)} faster, within the noise "
            f"(±{noise:.2f}), and holds {format_bytes(more)} more"
        )
    elif len(pool) > 1:
        sentence += "; the fastest" + (" within the budget" if budget is not None else "")
    if pick.vs_plain < 1.0 - noise:
        sentence += "; no variant beat the plain loop here beyond the noise, so a pipeline buys nothing on this model"
    return pick.name, sentence + "."


def noise_band(rows: Sequence[VariantReport]) -> float:
    """The median over variants of the half-range of their per-round ratios to the plain loop (0 with one round)."""
    spreads = [(max(r.paired) - min(r.paired)) / 2 for r in rows if r.ran and len(r.paired) >= 2]
    return statistics.median(spreads) if spreads else 0.0


def median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


__all__ = ["Advice", "VariantReport", "median", "noise_band", "parse_bytes", "recommend"]
