"""The verdict of advise (recommend / keep the plain loop / cannot tell) on hand-written rounds.

Each case gives the timed epoch of every contender in every round, as the
ranks would have measured it, and the verdict the rule must reach on them
([Note: the verdict rule] in trec_pipelines/advise/verdict.py).
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence, Tuple

import pytest

from trec_pipelines.advise.advice import VariantReport
from trec_pipelines.advise.verdict import (
    MAX_ROUNDS_HINT,
    Answer,
    band,
    judge,
    typical_spread,
)

MIB = 2**20
STEPS = 20


def plain(seconds: Sequence[float]) -> VariantReport:
    qps = statistics.median([STEPS / s for s in seconds])
    return VariantReport(
        name="plain loop", ran=True, seconds=tuple(seconds), steps=STEPS, qps=qps, vs_plain=1.0
    )


def measured(
    name: str,
    plain_seconds: Sequence[float],
    seconds: Sequence[float],
    held: int,
    unpipelined: Tuple[Tuple[str, str], ...] = (),
) -> VariantReport:
    """A row as advise makes it: QPS the median over rounds, x plain the ratio of the medians."""
    qps = statistics.median([STEPS / s for s in seconds])
    plain_qps = statistics.median([STEPS / s for s in plain_seconds])
    return VariantReport(
        name=name,
        ran=True,
        seconds=tuple(seconds),
        steps=STEPS,
        qps=qps,
        vs_plain=qps / plain_qps,
        paired=tuple(p / s for p, s in zip(plain_seconds, seconds, strict=True)),
        held_peak=held,
        unpipelined=unpipelined,
    )


def at(ratios: Sequence[float], plain_seconds: Sequence[float]) -> Tuple[float, ...]:
    """The epochs that make these per-round ratios to the plain loop."""
    return tuple(p / r for p, r in zip(plain_seconds, ratios, strict=True))


ONE = (1.0, 1.0, 1.0)


def test_a_clear_win_is_recommended() -> None:
    base = (1.00, 1.02, 0.98)
    rows = [
        measured("Fast", base, at((1.30, 1.31, 1.29), base), 9 * MIB),
        measured("Some", base, at((1.05, 1.06, 1.04), base), 2 * MIB),
    ]
    verdict = judge(plain(base), rows, None)
    assert verdict.answer is Answer.RECOMMEND and verdict.variant == "Fast"
    assert verdict.rerun_steps is None and verdict.rerun_rounds is None
    assert (
        str(verdict)
        == "recommend Fast: 1.30x plain ±0.01 over 3 rounds, +9.0 MiB held; the fastest"
    )


def test_a_clear_loss_keeps_the_plain_loop() -> None:
    rows = [
        measured("Slow", ONE, at((0.80, 0.82, 0.78), ONE), MIB),
        measured("Slower", ONE, at((0.70, 0.69, 0.71), ONE), 2 * MIB),
    ]
    verdict = judge(plain(ONE), rows, None)
    assert verdict.answer is Answer.KEEP_PLAIN_LOOP and verdict.variant is None
    assert str(verdict) == (
        "keep your plain loop: no variant is more than 2% faster than the plain loop beyond the noise "
        "(the fastest, Slow, is 0.80x plain ±0.02 over 3 rounds), so a pipeline buys nothing on this model"
    )


def test_as_fast_as_the_plain_loop_within_the_margin_keeps_it() -> None:
    # 1.00x give or take 0.005: no gain worth a pipeline, and the rounds say so.
    rows = [measured("Even", ONE, at((1.000, 1.005, 0.995), ONE), MIB)]
    assert judge(plain(ONE), rows, None).answer is Answer.KEEP_PLAIN_LOOP


def test_wide_noise_cannot_tell_and_says_how_many_rounds() -> None:
    # Per-round ratios 1.00, 1.10, 1.20: x plain 1.10, sd 0.10, twice the
    # standard error 2 * 0.1 / sqrt(3) = 0.115.  Its lead over the 2% margin,
    # 0.08, is within that.  Rounds for sd / sqrt(n) < 0.08 / 2: n > (2 * 0.1 / 0.08)^2 = 6.25.
    rows = [measured("Maybe", ONE, at((1.00, 1.10, 1.20), ONE), MIB)]
    verdict = judge(plain(ONE), rows, None)
    assert verdict.answer is Answer.CANNOT_TELL
    assert verdict.variant == "Maybe" and verdict.rerun_rounds == 7 and verdict.rerun_steps is None
    assert str(verdict) == (
        "cannot tell: Maybe leads at 1.10x plain ±0.12 over 3 rounds, but the noise leaves open whether "
        "Maybe is more than 2% faster than the plain loop (their difference: +0.10 ±0.12 in x plain); "
        "re-run with 7 rounds"
    )
    # With those 7 rounds at the same spread, the same lead is settled.
    seven = (1.0,) * 7
    ratios = (1.10 + 0.1 * math.sqrt(3) * k for k in (-1, 1, 0, 0, 0, 0, 0))
    settled = [measured("Maybe", seven, at(tuple(ratios), seven), MIB)]
    assert statistics.stdev(settled[0].paired) == pytest.approx(0.1)
    again = judge(plain(seven), settled, None)
    assert again.answer is Answer.RECOMMEND and again.variant == "Maybe"


def test_too_short_an_epoch_cannot_tell_and_says_how_many_steps() -> None:
    # The same clear win as above, timed over epochs of 40-50 ms.
    base = (0.050, 0.051, 0.049)
    rows = [measured("Fast", base, at((1.25, 1.26, 1.24), base), MIB)]
    verdict = judge(plain(base), rows, None)
    assert verdict.answer is Answer.CANNOT_TELL and verdict.variant == "Fast"
    # The shortest epoch (Fast's median, 0.05 / 1.25 = 0.040 s) reaches 0.5 s at 20 * 0.5 / 0.04 = 250 steps.
    assert verdict.rerun_steps == 250 and verdict.rerun_rounds is None
    assert str(verdict).startswith(
        "cannot tell: the shortest timed epoch took 0.040 s, under the 0.5 s it takes to time one; "
        "re-run with 250 steps (your batches are cycled to fill them)"
    )


def test_fewer_than_three_rounds_cannot_tell() -> None:
    two = (1.0, 1.0)
    rows = [measured("Fast", two, at((1.5, 1.5), two), MIB)]
    verdict = judge(plain(two), rows, None)
    assert verdict.answer is Answer.CANNOT_TELL and verdict.rerun_rounds == 3


def test_two_noisy_runs_that_flipped_the_median_rule_both_cannot_tell() -> None:
    # Two runs of the same model on a busy machine.  On the medians alone the
    # first says Lite (1.25x, far ahead of Base) and the second says Base
    # (Lite down to 0.90x): a flip.  Their rounds disagree by as much.
    run1 = [
        measured("Lite", ONE, at((1.45, 0.95, 1.25), ONE), 80 * 1024),
        measured("Base", ONE, at((1.05, 0.90, 1.00), ONE), 65 * 1024),
    ]
    run2 = [
        measured("Lite", ONE, at((0.90, 1.30, 0.70), ONE), 80 * 1024),
        measured("Base", ONE, at((1.05, 1.20, 0.95), ONE), 65 * 1024),
    ]
    assert max(run1, key=lambda r: r.vs_plain or 0).name == "Lite"
    assert max(run2, key=lambda r: r.vs_plain or 0).name == "Base"
    for rows in (run1, run2):
        verdict = judge(plain(ONE), rows, None)
        assert verdict.answer is Answer.CANNOT_TELL, str(verdict)
        assert verdict.rerun_rounds is None or verdict.rerun_rounds > 3
    # The same flip measured over epochs of 40 ms: too short, both times.
    short = (0.04, 0.04, 0.04)
    for ratios in ((1.52, 1.50, 1.55), (0.54, 0.55, 0.53)):
        rows = [
            measured("Lite", short, at(ratios, short), 80 * 1024),
            measured("Base", short, at((0.83, 0.85, 0.82), short), 65 * 1024),
        ]
        verdict = judge(plain(short), rows, None)
        assert verdict.answer is Answer.CANNOT_TELL and verdict.rerun_steps is not None


def test_within_the_margin_of_the_fastest_the_one_holding_less() -> None:
    rows = [
        measured("Big", ONE, at((1.300, 1.305, 1.295), ONE), 20 * MIB),
        measured("Small", ONE, at((1.290, 1.295, 1.285), ONE), 4 * MIB),
    ]
    verdict = judge(plain(ONE), rows, None)
    assert verdict.answer is Answer.RECOMMEND and verdict.variant == "Small"
    assert verdict.reason == (
        "1.29x plain ±0.01 over 3 rounds, +4.0 MiB held; Big is 0.8% faster, within 2% of it, "
        "and holds 16.0 MiB more"
    )


def test_a_lead_about_the_margin_asks_for_the_rounds_that_narrow_it_then_either_will_do() -> None:
    # Big leads Small by exactly the 2% margin: no number of rounds settles
    # whether it leads by more.  Their ± (2 * 0.05 / sqrt(3) = 0.058, the run's
    # typical spread) is wider than the margin: it asks for the rounds that
    # bring it within (sd / sqrt(n) < 0.01: n > 25).
    rows = [
        measured("Big", ONE, at((1.32, 1.37, 1.27), ONE), 20 * MIB),
        measured("Small", ONE, at((1.30, 1.35, 1.25), ONE), 4 * MIB),
    ]
    verdict = judge(plain(ONE), rows, None)
    assert verdict.answer is Answer.CANNOT_TELL and verdict.rerun_rounds == 26
    assert verdict.reason.endswith(
        f"it would take over {MAX_ROUNDS_HINT} rounds to settle: the two are about 2% apart; "
        "re-run with 26 rounds to tell whether either will do"
    )
    # No more rounds to come (the time budget spent): both are clear of the
    # plain loop and even with each other: the one holding less.
    final = judge(plain(ONE), rows, None, exhausted=True)
    assert final.answer is Answer.RECOMMEND and final.variant == "Small"
    assert final.rerun_rounds is None and final.rerun_steps is None
    assert str(final) == (
        "recommend Small: 1.30x plain ±0.06 over 3 rounds, +4.0 MiB held; Big is within the noise "
        "of it: either will do, and Small holds least of them; the fastest on the medians is "
        "Big, 1.32x plain ±0.06 over 3 rounds"
    )
    # With 26 rounds at a spread of 0.05 (± 0.0196, within the margin), the
    # same 2% lead is an answer without the budget being spent.
    n = 26
    base = (1.0,) * n
    wobble = tuple(0.05 * (-1) ** k * math.sqrt((n - 1) / n) for k in range(n))
    narrow = [
        measured("Big", base, at(tuple(1.32 + w for w in wobble), base), 20 * MIB),
        measured("Small", base, at(tuple(1.30 + w for w in wobble), base), 4 * MIB),
    ]
    settled = judge(plain(base), narrow, None)
    assert settled.answer is Answer.RECOMMEND and settled.variant == "Small", str(settled)
    assert "Big is within the noise of it: either will do" in settled.reason


def test_a_variant_about_the_margin_over_the_plain_loop_is_even_with_it() -> None:
    # Even leads the plain loop by the 2% margin exactly, give or take 0.06:
    # wider than the margin, so even with no more rounds to come the plain loop
    # is not yet the answer: the 26 rounds that bring its ± within 2%.
    rows = [measured("Even", ONE, at((1.02, 1.07, 0.97), ONE), MIB)]
    assert judge(plain(ONE), rows, None).rerun_rounds == 26
    wide = judge(plain(ONE), rows, None, exhausted=True)
    assert wide.answer is Answer.CANNOT_TELL and wide.variant == "Even"
    assert wide.rerun_rounds == 26
    # Known to within the margin (26 rounds at a spread of 0.05, ±0.0196): no
    # variant is faster beyond the noise: keep the plain loop.
    n = 26
    base = (1.0,) * n
    wobble = tuple(0.05 * (-1) ** k * math.sqrt((n - 1) / n) for k in range(n))
    narrow = [measured("Even", base, at(tuple(1.02 + w for w in wobble), base), MIB)]
    verdict = judge(plain(base), narrow, None, exhausted=True)
    assert verdict.answer is Answer.KEEP_PLAIN_LOOP and verdict.variant is None
    assert str(verdict) == (
        "keep your plain loop: no variant is more than 2% faster than the plain loop beyond the "
        "noise (the fastest, Even, is 1.02x plain ±0.02 over 26 rounds, within the noise of the "
        "plain loop: either will do), so a pipeline buys nothing measurable on this model"
    )


def test_noise_too_wide_to_narrow_cannot_tell_even_with_no_more_rounds_to_come() -> None:
    # Big and Small about 2% over the plain loop, give or take 0.3: neither the
    # lead nor the noise can be settled in 50 rounds.
    rows = [
        measured("Big", ONE, at((1.04, 1.30, 0.78), ONE), 20 * MIB),
        measured("Small", ONE, at((1.02, 1.28, 0.76), ONE), 4 * MIB),
    ]
    verdict = judge(plain(ONE), rows, None)
    assert verdict.answer is Answer.CANNOT_TELL and verdict.rerun_rounds is None
    assert verdict.reason.endswith("and the noise too wide to tell whether either will do")
    # Once no more rounds come, no variant is faster than the plain loop beyond the
    # noise, but a ± of 0.3 cannot say the plain loop will do either: cannot tell
    # yet, and what would (no number of rounds under 50 at this spread).
    final = judge(plain(ONE), rows, None, exhausted=True)
    assert final.answer is Answer.CANNOT_TELL and final.variant == "Big"
    assert final.rerun_rounds is None
    assert final.reason.endswith(
        "over 50 rounds would be needed at this spread: re-run on a quieter machine (fewer "
        "other jobs), with longer epochs (steps=, --steps)"
    )


def test_a_clear_lead_is_not_made_even_by_a_spent_budget() -> None:
    # Still open and settleable (Maybe over the plain loop, 7 rounds): with no
    # rounds to come, Maybe is not clear of the plain loop, nor known to within
    # the margin of it (±0.12): cannot tell yet, still asking for 7 rounds.
    rows = [measured("Maybe", ONE, at((1.00, 1.10, 1.20), ONE), MIB)]
    assert judge(plain(ONE), rows, None).rerun_rounds == 7
    final = judge(plain(ONE), rows, None, exhausted=True)
    assert final.answer is Answer.CANNOT_TELL and final.rerun_rounds == 7
    # Too-short epochs and too few rounds stay "cannot tell" either way.
    short = (0.05, 0.05, 0.05)
    fast = [measured("Fast", short, at((1.25, 1.26, 1.24), short), MIB)]
    assert judge(plain(short), fast, None, exhausted=True).answer is Answer.CANNOT_TELL


def test_noise_wider_than_the_margin_cannot_tell_yet_whatever_stopped_the_rounds() -> None:
    # Three rounds of a busy machine: Semi at 1.19x give or take 0.34, Sparse at
    # 1.10x give or take 0.20.  Nothing is faster than the plain loop beyond the
    # noise, but a ± of 0.34 cannot say the plain loop will do, whatever stopped
    # the rounds: cannot tell yet, naming the fastest variant seen and the rounds
    # that settle it.
    rows = [
        measured("Semi", ONE, at((0.90, 1.19, 1.49), ONE), MIB),
        measured("Sparse", ONE, at((0.95, 1.10, 1.30), ONE), MIB // 2),
    ]
    # Sparse's lead, +0.10, takes the most: its per-round
    # sd (0.18) is under the run's typical spread (the median of the two sds, 0.24),
    # which it is read with; sd / sqrt(n) < (0.10 - 0.02) / 2 for n > (2 * 0.24 / 0.08)^2 = 34.7.
    sd = typical_spread(rows)
    assert sd == pytest.approx(statistics.median(statistics.stdev(r.paired) for r in rows))
    lead = (rows[1].vs_plain or 0.0) - 1.0
    expected = math.floor((2 * sd / (lead - 0.02)) ** 2) + 1
    assert expected == 35
    verdict = judge(plain(ONE), rows, None, exhausted=True)
    assert verdict.answer is Answer.CANNOT_TELL and verdict.variant == "Semi"
    assert verdict.rerun_rounds == expected and verdict.rerun_steps is None
    assert str(verdict) == (
        "cannot tell: the fastest variant seen, Semi, is 1.19x plain ±0.34 over 3 rounds, and "
        "the noise is wider than the 2% the verdict decides by: these rounds cannot tell "
        f"whether a pipeline is faster than the plain loop or not; re-run with {expected} rounds"
    )
    # A variant known to within the margin (Close: 1.015x ±0.012) is even with the
    # plain loop once no rounds are to come: keep it.
    close = [measured("Close", ONE, at((1.005, 1.015, 1.025), ONE), MIB)]
    assert judge(plain(ONE), close, None).answer is Answer.CANNOT_TELL
    kept = judge(plain(ONE), close, None, exhausted=True)
    assert kept.answer is Answer.KEEP_PLAIN_LOOP and "either will do" in kept.reason
    # A variant clear of the plain loop, even with a faster peer, is still recommended
    # with no rounds to come (whichever of the two is faster, it is faster than the plain loop).
    peers = [
        measured("Big", ONE, at((1.32, 1.37, 1.27), ONE), 20 * MIB),
        measured("Small", ONE, at((1.30, 1.35, 1.25), ONE), 4 * MIB),
    ]
    recommended = judge(plain(ONE), peers, None, exhausted=True)
    assert recommended.answer is Answer.RECOMMEND and recommended.variant == "Small"


def test_the_budget_and_unpipelined_modules_decide_who_competes() -> None:
    rows = [
        measured("Huge", ONE, at((1.60, 1.61, 1.59), ONE), 50 * MIB),
        measured("Partial", ONE, at((1.50, 1.51, 1.49), ONE), MIB, (("ebc", "postproc"),)),
        measured("Fits", ONE, at((1.20, 1.21, 1.19), ONE), 2 * MIB),
    ]
    verdict = judge(plain(ONE), rows, 10 * MIB)
    assert verdict.answer is Answer.RECOMMEND and verdict.variant == "Fits"
    assert "Huge is 33% faster but exceeds the budget by 40.0 MiB" in verdict.reason
    without_huge = judge(plain(ONE), rows[1:], None)
    assert without_huge.variant == "Fits"
    assert "Partial is 25% faster but leaves ebc unpipelined" in without_huge.reason
    nothing_fits = judge(plain(ONE), rows, MIB // 2)
    assert nothing_fits.answer is Answer.KEEP_PLAIN_LOOP
    assert "no variant holds within the budget of 512.0 KiB; the least is Partial" in str(
        nothing_fits
    )


def test_nothing_ran_keeps_the_plain_loop() -> None:
    failed = VariantReport(name="A", error="RuntimeError: boom")
    absent = VariantReport(name="B", applicable=False, reason="an eval pipeline: ...")
    assert judge(plain(ONE), [failed, absent], None).reason.startswith("no variant ran")
    assert judge(plain(ONE), [absent], None).reason == "no variant applies to this model"


def test_the_spread_the_table_shows() -> None:
    rows = [
        measured("A", ONE, at((1.0, 1.1, 1.2), ONE), MIB),  # sd 0.1
        measured(
            "B", ONE, at((1.0, 1.0, 1.0), ONE), MIB
        ),  # sd 0: its band is the run's typical spread
        measured("C", ONE, at((1.0, 1.4, 1.8), ONE), MIB),  # sd 0.4
    ]
    assert typical_spread(rows) == pytest.approx(0.1)
    assert band(rows[0], 0.1) == pytest.approx(2 * 0.1 / math.sqrt(3))
    assert band(rows[1], 0.1) == pytest.approx(2 * 0.1 / math.sqrt(3))
    assert band(rows[2], 0.1) == pytest.approx(2 * 0.4 / math.sqrt(3))
    assert band(measured("D", (1.0,), (0.5,), MIB), 0.1) is None
