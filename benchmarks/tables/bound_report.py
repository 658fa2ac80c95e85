"""The bound side of the results: the probe's stages, the bound per variant, the hidden input dist.

The model is in :mod:`benchmarks.measuring.schedule_bound` ([Note: the bound model],
[Note: the hidden fraction]); this module applies it to one throughput block
and prints it.  Raw layout it reads (plain JSON types)::

    raw["cores"], raw["link_gbit"]         # cores the ranks share; emulated rate or None
    block["stages"] = [StageRecord, ...]   # one per probe epoch (contenders.combine_stage_times)
    block["recorded"] = {variant: [recorded epoch, one per rank]}  # layout in schedule_bound

Training variants only: an eval step has no backward, so no bound here.
The dependency bound (batches may overlap) is :mod:`benchmarks.tables.dependency_report`'s,
printed and stored with this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from benchmarks.measuring.schedule_bound import (
    LINK_ORDER,
    Bound,
    ScheduleFacts,
    StepCosts,
    any_schedule_bound,
    hidden_fraction,
    schedule_bound,
    schedule_facts,
    step_costs,
)
from benchmarks.tables.dependency_report import (
    DependencyReport,
    dependency_report,
    format_dependency,
    summary as dependency_summary,
)

# (variant, mode, ours examples/s, torchrec examples/s), from the throughput rows.
Achieved = Tuple[str, str, Optional[float], Optional[float]]


def _fraction(value: Optional[float], bound: Optional[float]) -> Optional[float]:
    return None if value is None or not bound else value / bound


@dataclass
class VariantBound:
    """One training variant against the bound of its own schedule."""

    variant: str
    bound: Bound  # the any-schedule terms, plus the link-order term when measured
    bound_qps: Optional[float]
    ours: Optional[float]  # examples/s
    torchrec: Optional[float]
    facts: Optional[ScheduleFacts]  # None: no recorded epoch
    hidden: Optional[float]  # fraction of the probe's input dist the recorded epoch hid

    @property
    def ours_of_bound(self) -> Optional[float]:
        return _fraction(self.ours, self.bound_qps)

    @property
    def torchrec_of_bound(self) -> Optional[float]:
        """torchrec's same-named class, held to the bound of our schedule (the same order of verbs)."""
        return _fraction(self.torchrec, self.bound_qps)


@dataclass
class BoundReport:
    """A throughput block's bound: the probe's costs, the any-schedule bound, each variant's."""

    costs: StepCosts
    examples_per_step: float
    any_schedule: Bound
    plain: Optional[float]  # the plain training loop, examples/s
    variants: List[VariantBound] = field(default_factory=list)
    dependency: Optional[DependencyReport] = None  # None: the probe did not time the pieces

    @property
    def bound_qps(self) -> Optional[float]:
        """Examples/s no schedule can beat."""
        return self.any_schedule.qps(self.examples_per_step)

    @property
    def old_qps(self) -> Optional[float]:
        """1 / max(three stage times): what the benchmark printed as the bound before."""
        slowest = max(self.costs.stage_ms().values())
        return self.examples_per_step * 1e3 / slowest if slowest > 0 else None


def bound_report(
    block: Mapping[str, Any],
    achieved: Sequence[Achieved],
    plain: Optional[float],
    world: int,
    cores: Optional[int],
    link_gbit: Optional[float],
) -> Optional[BoundReport]:
    """The block's :class:`BoundReport`, or None without probe epochs."""
    costs = step_costs(block.get("stages") or [], block["steps"], cores, link_gbit)
    if costs is None or max(costs.stage_ms().values()) <= 0:
        return None
    examples = float(block["batch_size"] * world)
    recorded = block.get("recorded") or {}
    out = BoundReport(costs, examples, any_schedule_bound(costs), plain)
    out.dependency = dependency_report(
        block,
        achieved,
        plain,
        world,
        cores,
        (costs.link_input_dist_ms, costs.link_compute_ms),
        cpu_per_core_ms=costs.cpu_per_core_ms,
    )
    for variant, mode, ours, torchrec in achieved:
        if mode == "eval":
            continue
        ranks = recorded.get(variant) or []
        facts = schedule_facts(ranks) if ranks else None
        ours_entry = (block.get("contenders") or {}).get(f"ours:{variant}") or {}
        bound = schedule_bound(
            costs,
            facts.gap_ms if facts else None,
            facts.on_chain if facts else False,
            dedicated=ours_entry.get("input_dist_group") == "dedicated",
        )
        out.variants.append(
            VariantBound(
                variant=variant,
                bound=bound,
                bound_qps=bound.qps(examples),
                ours=ours,
                torchrec=torchrec,
                facts=facts,
                hidden=hidden_fraction(facts.exposed_ms if facts else None, costs.input_dist_ms),
            )
        )
    return out


# --------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def _qps(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _terms(bound: Bound) -> str:
    return ", ".join(f"{name} {value:.2f}" for name, value in bound.terms.items())


def _link_detail(c: StepCosts) -> str:
    """The link's time (and bytes, when recorded) of the input dist and of the model's own collectives."""
    text = f"link time input dist {c.link_input_dist_ms:.2f} ms + fwd+bwd+opt {c.link_compute_ms:.2f} ms"
    if c.link_input_dist_bytes is None or c.link_compute_bytes is None:
        return text
    total = c.link_input_dist_bytes + c.link_compute_bytes
    share = c.link_input_dist_bytes / total if total > 0 else None
    return (
        f"{text} (input dist {c.link_input_dist_bytes / 1e6:.2f} MB vs the model's own all-to-alls "
        f"and all-reduce {c.link_compute_bytes / 1e6:.2f} MB: input dist {_pct(share)} of the link's bytes)"
    )


TableLayout = Callable[[Sequence[str], Sequence[Sequence[str]]], List[str]]


def format_bound(report: BoundReport, table: TableLayout) -> str:
    """The bound lines and the per-variant table, laid out by ``table`` (``memory_report.aligned_table``)."""
    c = report.costs
    lines = [
        f"Bound per step (stage probe, each stage alone): H2D {c.h2d_ms:.2f} ms, input dist "
        f"{c.input_dist_ms:.2f} ms, fwd+bwd+opt {c.compute_ms:.2f} ms; 1/max of these = "
        f"{_qps(report.old_qps)} ex/s is the old 'SparseDist bound', not a bound once the stages "
        "share cores or a link",
    ]
    detail = []
    if c.thread_input_dist_ms is not None:
        detail.append(f"input dist on the training thread {c.thread_input_dist_ms:.2f} ms")
    if c.cpu_ms is not None:
        per_core = "" if c.cpu_per_core_ms is None else f" = {c.cpu_per_core_ms:.2f} ms per core"
        detail.append(
            f"CPU of all ranks (every thread, communication's included) {c.cpu_ms:.2f} ms "
            f"on {c.cores} cores{per_core}"
        )
    if c.link_input_dist_ms is not None and c.link_compute_ms is not None:
        detail.append(_link_detail(c))
    else:
        detail.append("no emulated link (loopback taken as memory speed: no link terms)")
    lines.append("  measured per step: " + ", ".join(detail))
    any_schedule = report.any_schedule
    plain = report.plain
    lines.append(
        f"  any schedule: max({_terms(any_schedule)}) = {any_schedule.step_ms:.2f} ms "
        f"({any_schedule.binding}) -> {_qps(report.bound_qps)} ex/s"
        + (
            f"; plain loop {_qps(plain)} ({_pct(_fraction(plain, report.bound_qps))})"
            if plain
            else ""
        )
    )
    if c.link_input_dist_ms is not None:
        lines.append(
            f"  link order, per variant: fwd+bwd+opt + max(0, input-dist link {c.link_input_dist_ms:.2f} ms - gap), "
            "gap = from the input dist's ids all-to-all to the step's next all-to-all (one gloo group: a FIFO link)"
        )
        if c.link_compute_ms is not None:
            lines.append(
                f"  link share, input dist on a dedicated group: fwd+bwd+opt + min(fwd+bwd+opt link "
                f"{c.link_compute_ms:.2f} ms, max(0, input-dist link - gap)) (two groups share the link's rate)"
            )
    body = []
    for v in report.variants:
        facts = v.facts
        body.append(
            [
                v.variant,
                _ms(facts.exposed_ms if facts else None),
                _pct(v.hidden),
                _ms(facts.gap_ms if facts else None),
                f"{v.bound.step_ms:.2f} ({v.bound.binding})",
                _qps(v.bound_qps),
                f"{_qps(v.ours)} ({_pct(v.ours_of_bound)})",
                f"{_qps(v.torchrec)} ({_pct(v.torchrec_of_bound)})"
                if v.torchrec is not None
                else "-",
            ]
        )
    if body:
        lines += table(
            [
                "variant",
                "exposed input dist ms",
                "hidden",
                "gap ms",
                "bound ms/step (binding)",
                "bound ex/s",
                "ours ex/s (% of bound reached)",
                "torchrec ex/s (% of bound reached)",
            ],
            body,
        )
        lines.append(
            "  exposed = the training thread's input-dist time per steady step of the recorded epoch (mean over "
            "ranks); hidden = 1 - exposed / the probe's input dist, clipped to [0, 1]; % of bound "
            "reached = the bound's ms/step / the variant's (its ex/s over the bound's)"
        )
    if report.dependency is not None:
        lines += format_dependency(report.dependency, table)
    return "\n".join(lines)


# --------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------


def summary(report: Optional[BoundReport]) -> Optional[Dict[str, Any]]:
    """The block's bound as plain JSON (None without probe epochs)."""
    if report is None:
        return None
    c = report.costs
    return {
        "model": "see benchmarks/measuring/schedule_bound.py, [Note: the bound model] and [Note: the hidden fraction]",
        "stage_ms_per_step": c.stage_ms(),
        "old_bound_qps": report.old_qps,
        "costs_ms_per_step": {
            "thread_input_dist": c.thread_input_dist_ms,
            "cpu_all_ranks": c.cpu_ms,
            "cores": c.cores,
            "cpu_per_core": c.cpu_per_core_ms,
            "link_input_dist": c.link_input_dist_ms,
            "link_compute": c.link_compute_ms,
        },
        "link_bytes_per_step": {
            "input_dist": c.link_input_dist_bytes,
            "compute": c.link_compute_bytes,
        },
        "any_schedule": {
            "terms_ms": report.any_schedule.terms,
            "binding": report.any_schedule.binding,
            "bound_qps": report.bound_qps,
        },
        "plain_qps": report.plain,
        "plain_of_bound": _fraction(report.plain, report.bound_qps),
        "variants": {
            v.variant: {
                "terms_ms": v.bound.terms,
                "binding": v.bound.binding,
                "bound_qps": v.bound_qps,
                "link_order_ms": v.bound.terms.get(LINK_ORDER),
                "input_dist_on_chain": v.facts.on_chain if v.facts else None,
                "ours_qps": v.ours,
                "torchrec_qps": v.torchrec,
                "ours_of_bound": v.ours_of_bound,
                "torchrec_of_bound": v.torchrec_of_bound,
                "exposed_input_dist_ms": v.facts.exposed_ms if v.facts else None,
                "exposed_input_dist_ms_per_rank": v.facts.exposed_ms_per_rank if v.facts else None,
                "gap_ms": v.facts.gap_ms if v.facts else None,
                "gap_ms_per_rank": v.facts.gap_ms_per_rank if v.facts else None,
                "hidden_input_dist": v.hidden,
            }
            for v in report.variants
        },
        "dependency": dependency_summary(report.dependency),
    }
