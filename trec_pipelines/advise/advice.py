"""What advise found: the rows, the verdict, the table, the JSON and the budget.

A variant's row is :mod:`trec_pipelines.advise.report`'s; the verdict
(recommend a variant, keep the plain loop, or cannot tell) and its rule are
:mod:`trec_pipelines.advise.verdict`'s ([Note: the verdict rule] there).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from trec_pipelines.advise.budget import spent
from trec_pipelines.advise.link import LinkEstimate, describe
from trec_pipelines.advise.report import VariantReport
from trec_pipelines.advise.verdict import Answer, Verdict, judge
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


@dataclass(frozen=True)
class Advice:
    """The result of :func:`trec_pipelines.advise`: every rank gets an equal one.

    Attributes:
        verdict: recommend a variant, keep the plain loop, or cannot tell,
            with the reason and, when it cannot tell, what to re-run with
            (:class:`~trec_pipelines.advise.verdict.Verdict`).
        variants: a row per variant asked for, in the order timed.
        plain: the plain loop's row (the reference of every ratio).
        memory_budget: the budget in bytes of pipeline-held memory (None: none).
        noise: the run's typical spread of the per-round ratios to the plain
            loop (the median over variants of their standard deviation), the
            least the verdict believes of any difference (the *Choosing a
            variant* guide gives the rule).
        rounds: rounds measured.
        warmup: untimed steps before each timed epoch.
        steps: steps per timed epoch.
        world_size: ranks that trained.
        qps_unit: ``"examples/s"`` or ``"steps/s"``.
        steps_asked: the fewest steps per timed epoch asked for (``steps``
            is longer when advise lengthened the epochs to time them; None:
            as ``steps``).
        batches_per_pass: batches in one pass of ``build()``'s, when a pass
            ended before an epoch did and was cycled (the smallest rank's);
            None when no pass ended first.
        time_budget: the seconds the run was given (None: no budget given).
        elapsed: the seconds it took (None: not recorded).
        exhausted: the verdict was judged with no rounds to come: the time
            budget ran out before its hint could be followed, or it gave none.
        budget_spent: the run took longer than its time budget, or what the
            verdict asked to measure next would not fit in what was left
            (False with no time budget, ``time_budget=0``).
        link: the model's link bytes per step by collective, from its shapes
            and the first batch (None: not computed, or no sharded table reads
            the batch); the table says what they imply at 1 and 10 Gbit/s.
    """

    verdict: Verdict
    variants: Tuple[VariantReport, ...]
    plain: VariantReport
    memory_budget: Optional[int]
    noise: float
    rounds: int
    warmup: int
    steps: int
    world_size: int
    qps_unit: str = "examples/s"
    steps_asked: Optional[int] = None
    batches_per_pass: Optional[int] = None
    time_budget: Optional[float] = None
    elapsed: Optional[float] = None
    exhausted: bool = False
    budget_spent: bool = False
    link: Optional[LinkEstimate] = None

    @property
    def recommended(self) -> Optional[str]:
        """The variant to use; None when the verdict is to keep the plain loop, or it cannot tell."""
        return self.verdict.variant if self.verdict.answer is Answer.RECOMMEND else None

    @property
    def reason(self) -> str:
        """The verdict in one sentence, as the table's last line prints it."""
        return str(self.verdict)

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
        plain = replace(self.plain, within_budget=None if memory_budget is None else True)
        verdict = judge(plain, rows, memory_budget, exhausted=self.exhausted)
        if self.budget_spent and self.time_budget is not None:
            verdict = spent(verdict, self.time_budget, self.verdict.rerun_time_budget)
        return replace(
            self,
            variants=rows,
            plain=plain,
            memory_budget=memory_budget,
            verdict=verdict,
        )

    def to_dict(self) -> Dict[str, Any]:
        """Plain JSON types: what ``write_json`` writes (``recommended`` and ``reason`` included)."""
        return {**asdict(self), "recommended": self.recommended, "reason": self.reason}

    def write_json(self, path: str, extra: Optional[Dict[str, Any]] = None) -> None:
        with open(path, "w") as f:
            json.dump({**self.to_dict(), **(extra or {})}, f, indent=1)

    def table(self) -> str:
        """The applicable variants as a text table, then a footer: how it was measured,
        the variants that do not apply (one line), failures, unpipelined modules, the verdict."""
        header = (
            "variant",
            self.qps_unit,
            "x plain",
            "held (ledger)",
            "batches host/device",
            "peak RSS",
            "peak device",
            "input dist hidden",
            "unpipelined",
            "status",
        )
        rows: List[Sequence[str]] = []
        for r in (self.plain,) + tuple(r for r in self.variants if r.applicable):
            mark = "*" if r.name == self.recommended else " "
            ratio = "-" if r.vs_plain is None else f"{r.vs_plain:.2f}"
            if r.band is not None and r is not self.plain:
                ratio += f" ±{r.band:.2f}"
            rows.append(
                (
                    f"{mark} {r.name}",
                    "-" if r.qps is None else f"{r.qps:,.0f}",
                    ratio,
                    format_bytes(r.held_peak) + ("" if r.within_budget is not False else " (over)"),
                    f"{format_bytes(r.held_host)} / {format_bytes(r.held_device)}",
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
        epochs = [statistics.median(r.seconds) for r in (self.plain, *self.variants) if r.seconds]
        shortest = f" (shortest epoch {min(epochs):.3f} s)" if epochs else ""
        lines.append(
            f"{self.world_size} ranks, {self.rounds} round(s) of warm-up {self.warmup} "
            f"+ {self.steps} timed steps{shortest}; memory budget {budget}; "
            "± is twice the standard error of x plain over the rounds"
        )
        cycled = self.cycling()
        if cycled:
            lines.append(cycled)
        if self.link is not None:
            plain = self.plain
            timed = plain.seconds and plain.steps
            step = statistics.median(plain.seconds) / plain.steps if timed else None
            lines += describe(self.link, step)
        skipped = not_applicable_line(self.variants)
        if skipped:
            lines.append(skipped)
        for r in self.variants:
            if r.applicable and not r.ran:
                lines.append(f"  {r.name}: failed: {r.error}")
            for module, why in r.unpipelined:
                lines.append(f"  {r.name}: {module} not pipelined: {why}")
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)

    def cycling(self) -> str:
        """How the timed epochs were made long enough, and the time taken, in one line ("" if
        the steps asked for were used as they were, with no time budget)."""
        parts: List[str] = []
        if self.steps_asked is not None and self.steps_asked != self.steps:
            parts.append(
                f"timed epochs lengthened from {self.steps_asked} to {self.steps} steps to be long "
                "enough to time"
            )
        if self.batches_per_pass is not None:
            passes = (self.warmup + self.steps) / self.batches_per_pass
            parts.append(
                f"your {self.batches_per_pass} batches cycled {passes:.1f} times per round "
                f"(warm-up + timed epoch), in the same order for every contender"
            )
        if self.time_budget is not None and self.elapsed is not None:
            if self.time_budget > 0:
                parts.append(
                    f"{self.elapsed:.0f} s of a {self.time_budget:.0f} s time budget"
                    + (" (spent)" if self.budget_spent else "")
                )
            else:
                parts.append(
                    f"{self.elapsed:.0f} s, with no time budget (time_budget=0: the steps and "
                    "rounds asked for, no more)"
                )
        return "; ".join(parts)

    def save_plot(self, path: str) -> None:
        """x plain against pipeline-held memory per variant, with the rounds' spread (a PNG).

        Needs matplotlib (not a dependency of the package): ``pip install matplotlib``.
        """
        from trec_pipelines.advise.plot import save_plot

        save_plot(self, path)


def not_applicable_line(rows: Sequence[VariantReport]) -> str:
    """The variants that do not apply, in one line, grouped by their reason's words before its colon.

    ``advice[name].reason`` (and the JSON) has each reason in full.
    """
    groups: Dict[str, List[str]] = {}
    for r in rows:
        if not r.applicable:
            groups.setdefault(r.reason.split(":")[0], []).append(r.name)
    if not groups:
        return ""
    return "not applicable: " + "; ".join(
        f"{', '.join(names)} ({why})" for why, names in groups.items()
    )


def median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


__all__ = ["Advice", "VariantReport", "median", "not_applicable_line", "parse_bytes"]
