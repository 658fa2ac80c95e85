"""Every clause of advise's verdict is read off its own table.

The verdict's reason names which variant is the fastest, which holds least,
which are within the noise of which, and whether any is faster than the plain
loop.  Here answers are built from made-up tables (a seeded spread of them, and
the table a user met, where "either will do, and TrainPipelineSemiSync holds
least" stood beside SemiSync holding three times what SparseDist held), and
each claim the reason makes is checked against the table by a reference
written here from the rule's words ([Note: the verdict rule] in
trec_pipelines/advise/verdict.py), not by the verdict's own helpers.
"""

from __future__ import annotations

import math
import random
import re
import statistics
from typing import Dict, List, Sequence, Tuple

from trec_pipelines.advise.advice import VariantReport
from trec_pipelines.advise.verdict import Answer, Verdict, judge

MARGIN = 0.02
STEPS = 20
PLAIN = "plain loop"


def table(
    rows: Dict[str, Tuple[Sequence[float], int]],
) -> Tuple[VariantReport, List[VariantReport]]:
    """The plain loop at 1 s a round, and a row per variant from its per-round ratios and held bytes."""
    n = len(next(iter(rows.values()))[0])
    plain = VariantReport(
        name=PLAIN, ran=True, seconds=(1.0,) * n, steps=STEPS, qps=float(STEPS), vs_plain=1.0
    )
    made = []
    for name, (ratios, held) in rows.items():
        seconds = tuple(1.0 / r for r in ratios)
        qps = statistics.median(STEPS / s for s in seconds)
        made.append(
            VariantReport(
                name=name,
                ran=True,
                seconds=seconds,
                steps=STEPS,
                qps=qps,
                vs_plain=qps / STEPS,
                paired=tuple(ratios),
                held_peak=held,
            )
        )
    return plain, made


class Reference:
    """The rule's words on one table: what "beyond the noise" means between two contenders."""

    def __init__(self, plain: VariantReport, rows: Sequence[VariantReport]) -> None:
        self.n = len(plain.seconds)
        spreads = [statistics.stdev(r.paired) for r in rows]
        self.floor = statistics.median(spreads)
        self.ratio = {r.name: r.vs_plain or 0.0 for r in rows}
        self.ratio[PLAIN] = 1.0
        self.rounds = {r.name: r.paired for r in rows}
        self.rounds[PLAIN] = (1.0,) * self.n
        self.held = {r.name: r.held_peak or 0 for r in rows}
        self.held[PLAIN] = -1
        self.variants = [r.name for r in rows]

    def difference(self, a: str, b: str) -> Tuple[float, float]:
        """``a - b`` in x plain, and twice its standard error."""
        per_round = [x - y for x, y in zip(self.rounds[a], self.rounds[b], strict=True)]
        sd = max(statistics.stdev(per_round), self.floor)
        return self.ratio[a] - self.ratio[b], 2 * sd / math.sqrt(self.n)

    def better(self, a: str, b: str) -> bool:
        x, half = self.difference(a, b)
        return x - half > MARGIN

    def no_better(self, a: str, b: str) -> bool:
        x, half = self.difference(a, b)
        return x + half <= MARGIN

    def within_noise(self, a: str, b: str) -> bool:
        return not self.better(a, b) and not self.better(b, a)

    def fastest(self) -> str:
        return max(self.variants, key=lambda v: self.ratio[v])


NAMES = r"((?:\w+, )*\w+)"


def check_claims(verdict: Verdict, ref: Reference) -> int:
    """Assert every claim the reason makes against the reference; return how many were checked."""
    reason = verdict.reason
    said = str(verdict)
    checked = 0
    for m in re.finditer(r"the fastest(?: variant seen)?, (\w+), is", reason):
        assert m.group(1) == ref.fastest(), said
        checked += 1
    for m in re.finditer(r"the fastest on the medians is (\w+),", reason):
        assert m.group(1) == ref.fastest() and m.group(1) != verdict.variant, said
        checked += 1
    if re.search(r"; the fastest(?: within the budget)?$", reason):
        assert verdict.variant == ref.fastest(), said
        checked += 1
    for m in re.finditer(r"; (\w+) is [\d.]+% faster, within 2% of it, and holds", reason):
        assert m.group(1) == ref.fastest(), said
        assert verdict.variant is not None and ref.held[m.group(1)] >= ref.held[verdict.variant]
        checked += 1
    # "A, B are within the noise of it" (the pick) or "... of the plain loop".
    target = PLAIN if verdict.answer is Answer.KEEP_PLAIN_LOOP else verdict.variant
    peers: List[str] = []
    for m in re.finditer(NAMES + r" (?:is|are) within the noise of (?:it|the plain loop)", reason):
        peers += m.group(1).split(", ")
    for m in re.finditer(
        r"the fastest, (\w+), is [^;]*?, within the noise of the plain loop", reason
    ):
        peers.append(m.group(1))
    for name in peers:
        assert target is not None and ref.within_noise(name, target), (name, said)
        checked += 1
    if re.search(r"and (\w+) holds least(?: of them)?", reason):
        assert verdict.variant is not None and peers, said
        assert all(ref.held[verdict.variant] < ref.held[p] for p in peers), said
        checked += 1
    for m in re.finditer(
        r"; (\w+) holds less, but (\w+) is faster than it beyond the noise", reason
    ):
        assert verdict.variant is not None, said
        assert ref.held[m.group(1)] < ref.held[verdict.variant], said
        assert ref.better(m.group(2), m.group(1)), said
        checked += 1
    for m in re.finditer(
        r"; (\w+) holds less, but it is not faster than the plain loop beyond the noise", reason
    ):
        assert verdict.variant is not None, said
        assert ref.held[m.group(1)] < ref.held[verdict.variant], said
        assert not ref.better(m.group(1), PLAIN), said
        checked += 1
    if verdict.answer is Answer.RECOMMEND:
        # Faster than the plain loop beyond the noise, and no variant faster than it.
        assert verdict.variant is not None and ref.better(verdict.variant, PLAIN), said
        assert not any(ref.better(v, verdict.variant) for v in ref.variants), said
        checked += 1
    if verdict.answer is Answer.KEEP_PLAIN_LOOP:
        # No variant faster beyond the noise, and every one the noise leaves open
        # known to within the margin (the spread rule).
        for v in ref.variants:
            assert not ref.better(v, PLAIN), said
            assert ref.no_better(v, PLAIN) or ref.difference(v, PLAIN)[1] <= MARGIN, said
        checked += 1
    else:
        # Not "keep your plain loop" while a spread wider than the margin leaves a
        # variant open: there is nothing else to check for the other answers here.
        pass
    m = re.match(r"(\w+) leads at", reason)
    if m:
        top = max(ref.ratio[v] for v in ref.variants)
        close = [c for c in ref.variants + [PLAIN] if ref.ratio[c] >= top - MARGIN]
        assert m.group(1) == min(close, key=lambda c: (ref.held[c], -ref.ratio[c])), said
        checked += 1
    return checked


def wobble(mean: float, sd: float, n: int) -> Tuple[float, ...]:
    """``n`` (odd) per-round ratios with exactly this mean, median and standard deviation."""
    return (mean,) + tuple(mean + sd * (-1) ** k for k in range(n - 1))


def test_the_table_a_user_met_is_told_as_it_is() -> None:
    # SparseDist the fastest on the medians and holding least, but its rounds
    # spread too wide to be clear of the plain loop; SemiSync clear of it
    # beyond the noise, holding most; Fused slower than SemiSync beyond it.
    n = 25
    plain, rows = table(
        {
            "TrainPipelineSparseDist": (wobble(1.28, 0.7, n), 19_400),
            "TrainPipelineFusedSparseDist": (wobble(1.10, 0.3, n), 27_060),
            "TrainPipelineSemiSync": (wobble(1.25, 0.03, n), 57_480),
        }
    )
    ref = Reference(plain, rows)
    verdict = judge(plain, rows, None, exhausted=True)
    assert verdict.answer is Answer.RECOMMEND and verdict.variant == "TrainPipelineSemiSync"
    assert "holds least" not in verdict.reason, str(verdict)
    assert "the fastest on the medians is TrainPipelineSparseDist" in verdict.reason
    assert (
        "TrainPipelineSparseDist holds less, but it is not faster than the plain loop beyond "
        "the noise" in verdict.reason
    )
    assert check_claims(verdict, ref) >= 4


def test_every_claim_of_answers_on_made_up_tables_holds() -> None:
    rng = random.Random(20261201)
    checked = 0
    answers = set()
    for _ in range(600):
        n = rng.choice((3, 5, 9, 25))
        rows = {}
        helds = rng.sample(range(1, 100), rng.randint(1, 4))
        for k, held in enumerate(helds):
            mean = rng.uniform(0.9, 1.45)
            sd = rng.choice((0.0, 0.01, 0.03, 0.1, 0.3))
            rows[f"V{k}"] = (
                tuple(max(mean + rng.gauss(0, sd), 0.2) for _ in range(n)),
                held * 1024,
            )
        plain, made = table(rows)
        ref = Reference(plain, made)
        for exhausted in (False, True):
            verdict = judge(plain, made, None, exhausted=exhausted)
            answers.add(verdict.answer)
            checked += check_claims(verdict, ref)
    # The tables reached every answer, and many claims were checked.
    assert answers == set(Answer) and checked > 600
