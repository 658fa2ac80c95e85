"""The advice from what the rounds measured: one row per contender, and the verdict.

Each contender's row takes, per round, the slowest rank's epoch and, for
memory, the largest any rank held in the first round; its ratio to the plain
loop is the ratio of the medians ([Note: fresh models in paired rounds] in
:mod:`trec_pipelines.advise.run`).  A contender not applicable or failed keeps
a row that says why.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

from trec_pipelines.advise.advice import Advice, VariantReport, median
from trec_pipelines.advise.measure import PLAIN, RoundResult
from trec_pipelines.advise.variants import Variant
from trec_pipelines.advise.verdict import band, judge, typical_spread


def _row(
    name: str,
    per_round: List[List[RoundResult]],
    plain_seconds: Sequence[float],
    examples: Optional[int],
) -> VariantReport:
    """A contender's row from every rank's result of every round."""
    seconds = tuple(max(r.seconds for r in ranks) for ranks in per_round)
    steps = per_round[0][0].steps
    first = per_round[0]
    per_epoch = (examples if examples is not None else 1) * steps
    qps = median([per_epoch / s for s in seconds])
    paired = tuple(p / s for p, s in zip(plain_seconds, seconds, strict=True))

    def largest(values: Sequence[Optional[int]]) -> Optional[int]:
        known = [v for v in values if v is not None]
        return max(known) if len(known) == len(values) and known else None

    return VariantReport(
        name=name,
        ran=True,
        seconds=seconds,
        steps=steps,
        qps=qps,
        paired=paired,
        held_peak=largest([r.held_peak for r in first]),
        held_steady=largest([r.held_steady for r in first]),
        held_host=largest([r.held_host for r in first]),
        held_device=largest([r.held_device for r in first]),
        rss_peak=largest([r.rss_peak for r in first]),
        device_peak=largest([r.device_peak for r in first]),
        unpipelined=first[0].unpipelined,
    )


def _exposed(per_round: List[List[RoundResult]]) -> List[Optional[float]]:
    """Per rank: the median over rounds of its exposed input-dist seconds per step."""
    out: List[Optional[float]] = []
    for rank in range(len(per_round[0])):
        values = [ranks[rank].exposed_input_dist for ranks in per_round]
        known = [v for v in values if v is not None]
        out.append(median(known) if known else None)
    return out


def _hidden(exposed: List[Optional[float]], plain: List[Optional[float]]) -> Optional[float]:
    """1 - exposed / the plain loop's, clipped to [0, 1], per rank; the mean over ranks."""
    fractions = [
        min(1.0, max(0.0, 1.0 - e / p))
        for e, p in zip(exposed, plain, strict=True)
        if e is not None and p
    ]
    return sum(fractions) / len(fractions) if fractions and len(fractions) == len(exposed) else None


def compose(
    asked: List[Variant],
    reasons: Dict[str, Optional[str]],
    results: Dict[str, List[List[RoundResult]]],
    failures: Dict[str, str],
    budget: Optional[int],
    rounds: int,
    warmup: int,
    steps: int,
    world: int,
) -> Advice:
    """The advice from every contender's results: the rows, their noise bands and the verdict."""

    plain_runs = results[PLAIN]
    counts = [r.examples_per_step for r in plain_runs[0]]
    examples = (
        sum(c for c in counts if c is not None) if all(c is not None for c in counts) else None
    )
    plain_seconds = [max(r.seconds for r in ranks) for ranks in plain_runs]
    plain = _row(PLAIN, plain_runs, plain_seconds, examples)
    plain = dataclasses.replace(plain, vs_plain=1.0, within_budget=None if budget is None else True)
    plain_exposed = _exposed(plain_runs)
    rows: List[VariantReport] = []
    for variant in asked:
        name = variant.name
        if reasons.get(name) is not None:
            rows.append(VariantReport(name=name, applicable=False, reason=str(reasons[name])))
        elif name in failures:
            rows.append(VariantReport(name=name, error=failures[name]))
        else:
            row = _row(name, results[name], plain_seconds, examples)
            vs_plain = row.qps / plain.qps if row.qps and plain.qps else None
            within = (
                None if budget is None else (row.held_peak is not None and row.held_peak <= budget)
            )
            hidden = _hidden(_exposed(results[name]), plain_exposed)
            rows.append(
                dataclasses.replace(
                    row, vs_plain=vs_plain, within_budget=within, hidden_input_dist=hidden
                )
            )
    noise = typical_spread(rows)
    rows = [dataclasses.replace(r, band=band(r, noise)) for r in rows]
    passes = [
        r.pass_length
        for per_round in results.values()
        for ranks in per_round
        for r in ranks
        if r.pass_length is not None
    ]
    return Advice(
        verdict=judge(plain, rows, budget),
        variants=tuple(rows),
        plain=plain,
        memory_budget=budget,
        noise=noise,
        rounds=rounds,
        warmup=warmup,
        steps=steps,
        world_size=world,
        qps_unit="examples/s" if examples is not None else "steps/s",
        batches_per_pass=min(passes) if passes else None,
    )


__all__ = ["compose"]
