"""The dependency bound of a throughput block: per semantics, and each training variant against its own.

The model is in :mod:`benchmarks.measuring.dependency_bound` ([Note: the
dependency bound]); this module applies it to one block's stage probe and
prints it next to the any-schedule bound (:mod:`benchmarks.tables.bound_report`).
It reads the probe's epochs (``block["stages"]``, with the training stage's
pieces: ``lookup``, ``out_a2a``, ``forward``, ``backward``, ``opt``,
``emb_update``); a block from before the probe timed them has no dependency
bound, and its text and JSON leave it out (None).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from benchmarks.measuring.dependency_bound import (
    CORES,
    CORES_CPU,
    CORES_OPS,
    LABEL,
    LINK,
    OPS,
    SEMANTICS,
    STALE,
    SYNC,
    DependencyBound,
    OpTimes,
    dependency_bound,
    op_times,
    semantics_of,
)
from benchmarks.measuring.schedule_bound import ms_per_step, timed_cpu_per_core_ms

# (variant, mode, ours examples/s, torchrec examples/s), as bound_report.Achieved.
Achieved = Tuple[str, str, Optional[float], Optional[float]]
TableLayout = Callable[[Sequence[str], Sequence[Sequence[str]]], List[str]]


def _fraction(value: Optional[float], bound: Optional[float]) -> Optional[float]:
    return None if value is None or not bound else value / bound


@dataclass
class VariantDependency:
    """One training variant against the dependency bound of its semantics (its floor)."""

    variant: str
    semantics: str
    bound: DependencyBound
    bound_qps: Optional[float]
    ours: Optional[float]  # examples/s
    torchrec: Optional[float]
    examples_per_step: float
    # The ranks' CPU per core per step in the timed epochs, ms (None: not measured).
    ours_cpu_ms: Optional[float] = None
    torchrec_cpu_ms: Optional[float] = None

    @property
    def ours_ms(self) -> Optional[float]:
        return ms_per_step(self.ours, self.examples_per_step)

    @property
    def torchrec_ms(self) -> Optional[float]:
        return ms_per_step(self.torchrec, self.examples_per_step)

    @property
    def ours_of_bound(self) -> Optional[float]:
        """The share of the floor ours reaches: floor ms / ours' step ms."""
        return self.bound.reached(self.ours_ms)

    @property
    def torchrec_of_bound(self) -> Optional[float]:
        return self.bound.reached(self.torchrec_ms)


@dataclass
class DependencyReport:
    """A block's operation times, its bound per semantics, and each training variant's."""

    times: OpTimes
    cores: Optional[float]  # the cores' worth one rank's compute gets
    examples_per_step: float
    bounds: Dict[str, DependencyBound]  # semantics -> bound
    plain: Optional[float]  # the plain training loop, examples/s
    variants: List[VariantDependency] = field(default_factory=list)
    # The ranks' measured CPU per core per step, ms (None: not measured).
    cpu_per_core_ms: Optional[float] = None

    def qps(self, semantics: str) -> Optional[float]:
        return self.bounds[semantics].qps(self.examples_per_step)


def dependency_report(
    block: Mapping[str, Any],
    achieved: Sequence[Achieved],
    plain: Optional[float],
    world: int,
    cores: Optional[int],
    link_ms: Tuple[Optional[float], Optional[float]],
    cpu_per_core_ms: Optional[float] = None,
) -> Optional[DependencyReport]:
    """The block's :class:`DependencyReport`, or None when its probe did not time the pieces.

    ``cores``: the machine's cores the ranks share (one rank gets ``cores / world``);
    ``link_ms``: the link time per step of the input dist and of the model's
    own collectives (None, None without an emulated link);
    ``cpu_per_core_ms``: the ranks' measured CPU per core per step (the
    measured cores term; None for results without it).
    """
    times = op_times(
        block.get("stages") or [],
        block["steps"],
        link_compute_ms=link_ms[1],
        link_input_dist_ms=link_ms[0],
    )
    if times is None:
        return None
    per_rank = cores / world if cores and world else None
    examples = float(block["batch_size"] * world)
    bounds = {
        s: dependency_bound(times, s, per_rank, cpu_per_core_ms=cpu_per_core_ms) for s in SEMANTICS
    }
    out = DependencyReport(
        times, per_rank, examples, bounds, plain, cpu_per_core_ms=cpu_per_core_ms
    )
    contenders = block.get("contenders") or {}
    for variant, mode, ours, torchrec in achieved:
        if mode == "eval":
            continue
        entry = contenders.get(f"ours:{variant}") or {}
        theirs = contenders.get(f"torchrec:{variant}") or {}
        semantics = semantics_of(str(entry.get("base_variant") or variant))
        bound = bounds[semantics]
        steps = block["steps"]
        out.variants.append(
            VariantDependency(
                variant,
                semantics,
                bound,
                bound.qps(examples),
                ours,
                torchrec,
                examples,
                ours_cpu_ms=timed_cpu_per_core_ms(entry.get("cpu_seconds") or [], steps, cores),
                torchrec_cpu_ms=timed_cpu_per_core_ms(
                    theirs.get("cpu_seconds") or [], steps, cores
                ),
            )
        )
    return out


# --------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------


def _qps(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def _cores_detail(report: DependencyReport) -> str:
    """The cores per rank, and the cores' two terms side by side: the operations' sum and
    the measured CPU (what communication costs the cores is the difference)."""
    if report.cores is None:
        return "cores per rank -"
    ops = report.times.load(CORES) / report.cores
    text = f"cores per rank {report.cores:g}, {CORES_OPS} {ops:.2f} ms per core"
    if report.cpu_per_core_ms is None:
        return text + " (no measured CPU in this result)"
    return (
        f"{text} vs {CORES_CPU} {report.cpu_per_core_ms:.2f} ms per core (every thread of "
        "every rank, communication's CPU included)"
    )


def _semantics_line(report: DependencyReport, semantics: str) -> List[str]:
    bound = report.bounds[semantics]
    qps = report.qps(semantics)
    plain = report.plain
    line = (
        f"  {semantics} dependency bound: {bound.step_ms:.2f} ms/step (binding: {bound.binding}) "
        f"-> {_qps(qps)} ex/s"
    )
    if plain:
        line += f", plain loop {_qps(plain)} ({_pct(_fraction(plain, qps))})"
    terms = ", ".join(f"{name} {value:.2f}" for name, value in bound.terms.items())
    return [line, f"    terms (ms/step): {terms}"]


def format_dependency(report: DependencyReport, table: TableLayout) -> List[str]:
    """The dependency bound's lines and its per-variant table."""
    t = report.times
    derived = t.derived
    ops = ", ".join(f"{LABEL[op]}{'*' if op in derived else ''} {t.ms[op]:.2f}" for op in OPS)
    busy = f"link busy {t.load(LINK):.2f} ms"
    cores = _cores_detail(report)
    start = (
        ""
        if t.allreduce_from is None
        else f", all-reduce issued {100 * t.allreduce_from:.0f}% into the dense bwd"
    )
    if t.grad_from is not None:
        start += f", the embeddings' gradient ready {100 * t.grad_from:.0f}% into it"
    lines = [
        "Dependency bound per step (batches may overlap; each operation's time from the stage "
        f"probe, ms): {ops}; {busy}, {cores}{start}",
    ]
    lines += _semantics_line(report, SYNC)
    lines += _semantics_line(report, STALE)
    lines.append(
        "  * derived, not timed on its own: "
        + "; ".join(f"{LABEL[op]} = {how}" for op, how in derived.items())
    )
    timed = (
        "  timed on the training thread: lookup (the sharded module's compute), out a2a "
        "(its output dist, waited), forward, backward, opt (zero_grad + step), emb update (the "
        "lookup's backward with its fused optimizer, replayed alone after the step)"
    )
    if t.allreduce_from is not None:
        timed += (
            "; and, in a replay of the backward after the step, as SemiSync runs it: dense bwd "
            "(the lookup's output detached, DDP's all-reduce not waited), all-reduce (first "
            "bucket issued to last one done, waited alone), the lookup's backward after it"
        )
    lines.append(
        "  window: under sync semantics batch i's all-reduce and grad a2a and batch i+1's out a2a "
        "all cross the link between batch i's first collective and batch i+1's dense fwd, one "
        "after the other"
    )
    lines.append(timed)
    body = [
        [
            v.variant,
            v.semantics,
            f"{v.bound.step_ms:.2f} ({v.bound.binding})",
            _qps(v.bound_qps),
            f"{_ms(v.ours_ms)} ({_pct(v.ours_of_bound)})",
            _ms(v.ours_cpu_ms),
            f"{_ms(v.torchrec_ms)} ({_pct(v.torchrec_of_bound)})"
            if v.torchrec is not None
            else "-",
            _ms(v.torchrec_cpu_ms) if v.torchrec is not None else "-",
        ]
        for v in report.variants
    ]
    if body:
        lines += table(
            [
                "variant",
                "semantics",
                "floor ms/step (binding term)",
                "floor ex/s",
                "ours ms/step (% of floor reached)",
                "ours CPU ms/core/step",
                "torchrec ms/step (% of floor reached)",
                "torchrec CPU ms/core/step",
            ],
            body,
        )
        lines.append(
            "  floor = the dependency bound of the variant's semantics (SemiSync: one step "
            "stale, every other variant: sync); % of floor reached = floor ms/step / the "
            "variant's measured ms/step (100% = at the floor); CPU ms/core/step = what every "
            "rank process was charged in the variant's timed epochs (every thread), per step, "
            "over the cores (- in results from before it was measured)"
        )
    return lines


# --------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------


def summary(report: Optional[DependencyReport]) -> Optional[Dict[str, Any]]:
    """The block's dependency bound as plain JSON (None when the probe did not time the pieces)."""
    if report is None:
        return None
    t = report.times
    return {
        "model": "see benchmarks/measuring/dependency_bound.py, [Note: the dependency bound]",
        "op_ms_per_step": dict(t.ms),
        "busy_ms_per_step": {op: t.busy(op) for op in OPS},
        "derived": dict(t.derived),
        "allreduce_from": t.allreduce_from,
        "grad_from": t.grad_from,
        "cores_per_rank": report.cores,
        "cpu_per_core_ms": report.cpu_per_core_ms,
        "semantics": {
            s: {
                "terms_ms": bound.terms,
                "binding": bound.binding,
                "bound_ms": bound.step_ms,
                "bound_qps": report.qps(s),
                "plain_of_bound": _fraction(report.plain, report.qps(s)),
            }
            for s, bound in report.bounds.items()
        },
        "variants": {
            v.variant: {
                "semantics": v.semantics,
                "bound_ms": v.bound.step_ms,
                "binding": v.bound.binding,
                "ours_ms": v.ours_ms,
                "torchrec_ms": v.torchrec_ms,
                "ours_cpu_ms_per_core": v.ours_cpu_ms,
                "torchrec_cpu_ms_per_core": v.torchrec_cpu_ms,
                "bound_qps": v.bound_qps,
                "ours_qps": v.ours,
                "torchrec_qps": v.torchrec,
                "ours_of_bound": v.ours_of_bound,
                "torchrec_of_bound": v.torchrec_of_bound,
            }
            for v in report.variants
        },
    }
