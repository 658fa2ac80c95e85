"""The verdict of advise: recommend a variant, keep the plain loop, or cannot tell.

[Note: the verdict rule]
:func:`judge` is a pure function of what was measured: each contender's
timed epoch per round, its ratio to the plain loop (``x plain``, the ratio of
the medians, as the bench's) and its per-round ratios to the plain loop of
the same round, its held bytes, and the modules it left unpipelined.

Which variants compete: those that ran, whose held bytes (the memory
ledger's peak, the largest rank's) fit ``memory_budget``, and -- if any of
them pipelined every sharded module -- only those.  The plain loop competes
too, as the contender that holds nothing, at exactly 1.00x.

When it cannot tell at all:

* an epoch too short to time: the shortest median epoch of a contender
  under ``MIN_EPOCH_SECONDS`` (0.5 s).  The scheduler's time slices and a
  shared machine's stalls are milliseconds: on an epoch of 50 ms one stall
  is several percent, and the pipeline's fill and drain weigh more the fewer
  the steps.  Re-run with the steps that bring that epoch to 0.5 s
  (``rerun_steps``, rounded up to a multiple of ten);
* fewer than ``MIN_ROUNDS`` (3) rounds: no spread to judge by.

Otherwise every difference is read with its noise.  For two contenders
``a`` and ``b``, the difference ``a - b`` of their ``x plain`` is known to
within twice its standard error: the standard deviation over the rounds of
their per-round difference (but never less than the run's typical spread:
the median, over the variants that ran, of the standard deviation of their
per-round ratios, so that a pair whose few rounds happen to agree is not
believed more than the machine allows), divided by the square root of the
rounds.  A difference counts only beyond ``MARGIN`` (0.02, 2% of the plain
loop's speed): a variant is *better* than another when its lead, less the
noise, is over 2%, and *no better* when its lead, plus the noise, is at most
2%.

The pick is the contender, in order of held bytes (least first), that no
contender is better than, and that is better than every contender holding
less.  The plain loop is the pick ("keep your plain loop") when no variant
is better than it; a variant is the pick ("recommend") when it is better
than the plain loop and than every variant holding less, and no variant is
better than it.  When no contender qualifies, the answer is "cannot tell":
the leading contender (the one holding least among those within 2% of the
fastest ``x plain``) is named, with the pair whose difference the noise
leaves unsettled and the rounds it takes to settle it: the rounds ``n`` for
which the standard error, ``sd / sqrt(n)``, falls below half of the
difference's distance from the margin (``rerun_rounds``; none when that
takes over ``MAX_ROUNDS_HINT``: the two are then about 2% apart).

Either will do: when no pick is confident, the contenders the noise leaves
open are even -- and that is an answer -- when more rounds would not
decide it (every pair around the leader settled, or the open one about the
margin apart, ``rerun_rounds`` over ``MAX_ROUNDS_HINT``, with its ``±``
already within the margin), or when no more rounds will be measured
(``judge(..., exhausted=True)``: advise's time budget is spent).  The pick
is then the contender holding least that no other is better than (beyond
the noise), provided it is the plain loop or better than it: "keep your
plain loop" when it is the plain loop (no variant faster beyond the
noise), "recommend" otherwise, the reason naming the variants within the
noise of the pick.  Only when there is no such contender does it stay
"cannot tell".  Every clause of that reason is read off the table: the
peers it calls within the noise are those neither side is better than; it
says the pick holds least of them only when it does; a peer holding less
is named with why it is not the pick (it is not faster than the plain loop
beyond the noise, or another variant is faster than it); and a peer faster
on the medians is named as the fastest.

"Keep your plain loop" needs every variant the noise leaves open against
the plain loop known to within the margin (its ``±`` at most 2%), whatever
stopped the rounds: a wider one is "cannot tell yet", naming the fastest
variant seen and the rounds that would settle its lead (or narrow its
``±`` to the margin), by how its spread shrinks with ``sqrt(n)`` -- or,
when that takes over ``MAX_ROUNDS_HINT`` rounds, saying to re-run on a
quieter machine, with longer epochs.  A variant even with its peers but
clear of the plain loop is still recommended: whichever of them is faster,
it is.  Otherwise a pair about the margin apart whose ``±`` is wider than
the margin asks for the rounds that bring its ``±`` within the margin
(then either will do).  Another run may name another of these peers (the
noise does not separate them): the reason names them.

Why this cannot flip: two runs give different confident answers only if one
of them finds a pair better by over 2% and the other finds it no better
than 2%, so at least one of them reads that difference wrongly by more than
twice its standard error.  A run whose noise is wide says "cannot tell"
instead of following its medians.
"""

from __future__ import annotations

import enum
import math
import statistics
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from trec_pipelines.advise.left_out import left_out, pct
from trec_pipelines.observe.memory import format_bytes

if TYPE_CHECKING:
    from trec_pipelines.advise.report import VariantReport

# An epoch shorter than this is too short to time (see [Note: the verdict rule]).
MIN_EPOCH_SECONDS = 0.5
# Fewer rounds give no spread to judge by.
MIN_ROUNDS = 3
# A lead in x plain counts only beyond this (2% of the plain loop's speed).
MARGIN = 0.02
# A pair that would take more rounds than this to settle is as good as even.
MAX_ROUNDS_HINT = 50

PLAIN_NAME = "plain loop"


class Answer(str, enum.Enum):
    """What advise answers: one of three."""

    RECOMMEND = "recommend"
    KEEP_PLAIN_LOOP = "keep plain loop"
    CANNOT_TELL = "cannot tell"


@dataclass(frozen=True)
class Verdict:
    """The answer of advise, with why, and what to re-run with when it cannot tell.

    Attributes:
        answer: recommend a variant, keep the plain loop, or cannot tell.
        variant: the variant recommended; when it cannot tell, the one
            leading so far (None: the plain loop leads, or nothing ran);
            None when the answer is to keep the plain loop.
        reason: why, in one sentence, with the numbers behind it.
        rerun_steps: when epochs were too short to time: the steps per epoch
            to re-run with (the batches are cycled to fill them).
        rerun_rounds: when the noise left it open: the rounds to re-run with.
        rerun_time_budget: when advise's time budget ran out before the
            steps or rounds above could be measured: the budget, in seconds,
            that would let it go on.
    """

    answer: Answer
    variant: Optional[str]
    reason: str
    rerun_steps: Optional[int] = None
    rerun_rounds: Optional[int] = None
    rerun_time_budget: Optional[float] = None

    def __str__(self) -> str:
        if self.answer is Answer.RECOMMEND:
            head = f"recommend {self.variant}"
        elif self.answer is Answer.KEEP_PLAIN_LOOP:
            head = "keep your plain loop"
        else:
            head = "cannot tell"
        return f"{head}: {self.reason}"


@dataclass(frozen=True)
class _Contender:
    """A variant (or the plain loop) as the rule sees it."""

    name: str
    ratio: float
    per_round: Tuple[float, ...]
    held: int

    @property
    def plain(self) -> bool:
        return self.name == PLAIN_NAME


def typical_spread(rows: Sequence["VariantReport"]) -> float:
    """The median, over the variants that ran, of the standard deviation of their per-round
    ratios (0 with one round)."""
    spreads = [statistics.stdev(r.paired) for r in rows if r.ran and len(r.paired) >= 2]
    return statistics.median(spreads) if spreads else 0.0


def band(row: "VariantReport", noise: float) -> Optional[float]:
    """Twice the standard error of ``row.vs_plain`` (None: fewer than two rounds)."""
    n = len(row.paired)
    if not row.ran or n < 2:
        return None
    return 2 * max(statistics.stdev(row.paired), noise) / math.sqrt(n)


def _difference(a: _Contender, b: _Contender, noise: float) -> Tuple[float, float, float]:
    """``a - b`` in x plain: the difference, its per-round deviation (at least ``noise``), twice its standard error."""
    n = len(a.per_round)
    per_round = [x - y for x, y in zip(a.per_round, b.per_round, strict=True)]
    sd = max(statistics.stdev(per_round) if n >= 2 else 0.0, noise)
    return a.ratio - b.ratio, sd, 2 * sd / math.sqrt(n)


def _better(a: _Contender, b: _Contender, noise: float) -> bool:
    """``a`` leads ``b`` by more than the margin, beyond the noise."""
    x, _, half = _difference(a, b, noise)
    return x - half > MARGIN


def _no_better(a: _Contender, b: _Contender, noise: float) -> bool:
    """``a`` leads ``b`` by at most the margin, beyond the noise."""
    x, _, half = _difference(a, b, noise)
    return x + half <= MARGIN


def _by_memory(contenders: Sequence[_Contender]) -> List[_Contender]:
    return sorted(contenders, key=lambda c: (c.held, -c.ratio))


def _confident_pick(contenders: Sequence[_Contender], noise: float) -> Optional[_Contender]:
    for pick in _by_memory(contenders):
        unbeaten = all(_no_better(c, pick, noise) for c in contenders if c is not pick)
        beats_cheaper = all(_better(pick, c, noise) for c in contenders if c.held < pick.held)
        if unbeaten and beats_cheaper:
            return pick
    return None


def _leading(contenders: Sequence[_Contender]) -> _Contender:
    """On the medians alone: the one holding least among those within the margin of the fastest."""
    fastest = max(c.ratio for c in contenders)
    return _by_memory([c for c in contenders if c.ratio >= fastest - MARGIN])[0]


def _rounds_to_settle(sd: float, gap: float) -> Optional[int]:
    """Rounds for the standard error ``sd / sqrt(n)`` to fall below ``gap / 2`` (None: over MAX_ROUNDS_HINT)."""
    if gap <= 0:
        return None
    n = math.floor((2 * sd / gap) ** 2) + 1
    return n if n <= MAX_ROUNDS_HINT else None


def _unsettled(
    lead: _Contender, contenders: Sequence[_Contender], noise: float
) -> Optional[Tuple[_Contender, _Contender, float, float, Optional[int]]]:
    """The pair, around ``lead``, that takes the most rounds to settle: (a, b, a - b, ± of it, rounds)."""
    pairs: List[Tuple[_Contender, _Contender]] = []
    for c in contenders:
        if c is lead:
            continue
        if not _no_better(c, lead, noise):
            pairs.append((c, lead))
        if c.held < lead.held and not _better(lead, c, noise):
            pairs.append((lead, c))
    worst: Optional[Tuple[_Contender, _Contender, float, float, Optional[int]]] = None
    worst_key = -1.0
    for a, b in pairs:
        x, sd, half = _difference(a, b, noise)
        if abs(x - MARGIN) > half:  # settled, the other way: not what holds the answer
            continue
        rounds = _rounds_to_settle(sd, abs(x - MARGIN))
        key = float("inf") if rounds is None else float(rounds)
        if key > worst_key:
            worst, worst_key = (a, b, x, half, rounds), key
    return worst


def _steps_for(steps: int, shortest: float) -> int:
    """The steps that bring an epoch of ``shortest`` seconds over ``steps`` to MIN_EPOCH_SECONDS."""
    needed = math.ceil(steps * MIN_EPOCH_SECONDS / max(shortest, 1e-9))
    return needed if needed <= 10 else 10 * math.ceil(needed / 10)


def _name(c: _Contender) -> str:
    return "the plain loop" if c.plain else c.name


def _figure(row: "VariantReport", noise: float) -> str:
    """``1.31x plain ±0.04 over 5 rounds``."""
    half = band(row, noise)
    spread = "" if half is None else f" ±{half:.2f} over {len(row.paired)} rounds"
    return f"{row.vs_plain or 0.0:.2f}x plain{spread}"


def _either_will_do(contenders: Sequence[_Contender], noise: float) -> Optional[_Contender]:
    """When no pick is confident and more rounds would not make one: the contender holding
    least that no other is better than, provided it is the plain loop or better than it
    (None: there is none such)."""
    plain = next(c for c in contenders if c.plain)
    for c in _by_memory(contenders):
        unbeaten = not any(_better(o, c, noise) for o in contenders if o is not c)
        if unbeaten and (c.plain or _better(c, plain, noise)):
            return c
    return None


def _even_verdict(
    pick: _Contender,
    contenders: Sequence[_Contender],
    pool: Sequence["VariantReport"],
    noise: float,
) -> Verdict:
    """The answer when ``pick`` (from :func:`_either_will_do`) and its peers are within the noise
    of each other: either will do, so the one holding least."""
    # Its peers: those the noise leaves possibly more than the margin faster, and those
    # holding less that it does not beat beyond the noise.
    peers = [
        c
        for c in contenders
        if c is not pick
        and not c.plain
        and (not _no_better(c, pick, noise) or (c.held < pick.held and not _better(pick, c, noise)))
    ]
    names = ", ".join(c.name for c in peers) or "the others"
    are = "is" if len(peers) == 1 else "are"
    by_name = {r.name: r for r in pool}
    if pick.plain:
        best = max(pool, key=lambda r: r.vs_plain or 0.0)
        which = "," if names == best.name else f"; {names} {are}"
        return Verdict(
            Answer.KEEP_PLAIN_LOOP,
            None,
            f"no variant is more than {MARGIN:.0%} faster than the plain loop beyond the noise "
            f"(the fastest, {best.name}, is {_figure(best, noise)}{which} within the noise "
            "of the plain loop: either will do), so a pipeline buys nothing measurable on this model",
        )
    row = by_name[pick.name]
    sentence = (
        f"{_figure(row, noise)}, +{format_bytes(row.held_peak)} held; {names} {are} within the "
        "noise of it: either will do"
    )
    if all(c.held > pick.held for c in peers):
        sentence += f", and {pick.name} holds least of them"
    # A peer holding less is not the pick for a reason of its own: say which.
    for c in (c for c in peers if c.held < pick.held):
        faster = [o for o in contenders if o is not c and _better(o, c, noise)]
        why = (
            f"{max(faster, key=lambda o: o.ratio).name} is faster than it beyond the noise"
            if faster
            else "it is not faster than the plain loop beyond the noise"
        )
        sentence += f"; {c.name} holds less, but {why}"
    fastest = max(pool, key=lambda r: r.vs_plain or 0.0)
    if fastest is not row and (fastest.vs_plain or 0.0) > (row.vs_plain or 0.0):
        sentence += f"; the fastest on the medians is {fastest.name}, {_figure(fastest, noise)}"
    return Verdict(Answer.RECOMMEND, pick.name, sentence)


def _none_to_judge(
    rows: Sequence["VariantReport"],
    ran: Sequence["VariantReport"],
    fits: Sequence["VariantReport"],
    budget: Optional[int],
) -> Optional[Verdict]:
    """Keep the plain loop when no variant ran or none holds within the budget (None: some do)."""
    if not ran:
        if not any(r.applicable for r in rows):
            return Verdict(Answer.KEEP_PLAIN_LOOP, None, "no variant applies to this model")
        return Verdict(
            Answer.KEEP_PLAIN_LOOP, None, "no variant ran; see each one's error or reason"
        )
    if not fits:
        least = min(
            (r for r in ran if r.held_peak is not None),
            key=lambda r: r.held_peak or 0,
            default=None,
        )
        smallest = (
            f"; the least is {least.name} with {format_bytes(least.held_peak)}" if least else ""
        )
        return Verdict(
            Answer.KEEP_PLAIN_LOOP,
            None,
            f"no variant holds within the budget of {format_bytes(budget)}{smallest}: "
            "raise the budget to use one",
        )
    return None


def _too_little(
    plain: "VariantReport",
    ran: Sequence["VariantReport"],
    lead: _Contender,
    leads: str,
) -> Optional[Verdict]:
    """Cannot tell when an epoch is too short or the rounds too few, whatever the medians
    say; the re-run that would tell (None: enough was measured)."""
    rounds = len(plain.seconds)
    shortest = min(statistics.median(r.seconds) for r in [plain, *ran] if r.seconds)
    problems: List[str] = []
    rerun_steps: Optional[int] = None
    rerun_rounds: Optional[int] = None
    if shortest < MIN_EPOCH_SECONDS:
        rerun_steps = _steps_for(plain.steps, shortest)
        problems.append(
            f"the shortest timed epoch took {shortest:.3f} s, under the {MIN_EPOCH_SECONDS} s "
            f"it takes to time one"
        )
    if rounds < MIN_ROUNDS:
        rerun_rounds = MIN_ROUNDS
        problems.append(f"{rounds} round(s) give no spread to judge by (it takes {MIN_ROUNDS})")
    if problems:
        again = []
        if rerun_steps is not None:
            again.append(f"{rerun_steps} steps (your batches are cycled to fill them)")
        if rerun_rounds is not None:
            again.append(f"{rerun_rounds} rounds")
        return Verdict(
            Answer.CANNOT_TELL,
            None if lead.plain else lead.name,
            f"{'; '.join(problems)}; re-run with {' and '.join(again)} ({leads} so far)",
            rerun_steps,
            rerun_rounds,
        )
    return None


def _no_confident_pick(
    lead: _Contender,
    leads: str,
    contenders: Sequence[_Contender],
    pool: Sequence["VariantReport"],
    noise: float,
    rounds: int,
    exhausted: bool,
) -> Verdict:
    """The answer when no contender is a confident pick: either will do, or cannot tell
    (and how many rounds would tell)."""
    pair = _unsettled(lead, contenders, noise)
    even = _either_will_do(contenders, noise)
    # More rounds cannot settle it when every pair is settled, or the open one is
    # about the margin apart and already known to within the margin.
    unsettleable = pair is None or (pair[4] is None and pair[3] <= MARGIN)
    if even is not None and (exhausted or unsettleable):
        too_wide = _too_wide_to_keep(contenders, pool, noise, rounds) if even.plain else None
        if too_wide is not None:
            return too_wide
        return _even_verdict(even, contenders, pool, noise)
    variant = None if lead.plain else lead.name
    if pair is None:  # every pair settled, yet no pick: neighbours about the margin apart
        return Verdict(
            Answer.CANNOT_TELL,
            variant,
            f"{leads}, but the contenders are each about {MARGIN:.0%} from the next: "
            "no one of them is clearly the choice; choose by held memory",
        )
    a, b, x, half, needed = pair
    than = "it" if b is lead else _name(b)
    what = (
        f"{leads}, but the noise leaves open whether {_name(a)} is more than {MARGIN:.0%} "
        f"faster than {than} (their difference: {x:+.2f} ±{half:.2f} in x plain)"
    )
    if needed is None:
        # About the margin apart: more rounds can still narrow the noise to the
        # margin, and then either will do.
        needed = _rounds_to_settle(_difference(a, b, noise)[1], MARGIN)
        what += (
            f"; it would take over {MAX_ROUNDS_HINT} rounds to settle: the two are about "
            f"{MARGIN:.0%} apart"
        )
        if needed is not None:
            what += f"; re-run with {max(needed, rounds + 1)} rounds to tell whether either will do"
        else:
            what += ", and the noise too wide to tell whether either will do"
    else:
        what += f"; re-run with {max(needed, rounds + 1)} rounds"
    return Verdict(
        Answer.CANNOT_TELL,
        variant,
        what,
        rerun_rounds=None if needed is None else max(needed, rounds + 1),
    )


def _too_wide_to_keep(
    contenders: Sequence[_Contender],
    pool: Sequence["VariantReport"],
    noise: float,
    rounds: int,
) -> Optional[Verdict]:
    """Cannot tell yet when a variant's difference to the plain loop is known no closer than
    the margin, whatever stopped the rounds: "keep your plain loop" would then say more than
    the rounds measured (None: every variant the noise leaves open is known to within the
    margin, and the plain loop will do)."""
    plain = next(c for c in contenders if c.plain)
    wide: List[Optional[int]] = []
    for c in contenders:
        if c.plain or _no_better(c, plain, noise):
            continue
        x, sd, half = _difference(c, plain, noise)
        if half > MARGIN:
            # The rounds that settle its lead over the margin, or else bring its ± within it.
            wide.append(_rounds_to_settle(sd, abs(x - MARGIN)) or _rounds_to_settle(sd, MARGIN))
    if not wide:
        return None
    fastest = max(pool, key=lambda r: r.vs_plain or 0.0)
    needs = [n for n in wide if n is not None]
    needed = max(*needs, rounds + 1) if len(needs) == len(wide) else None
    sentence = (
        f"the fastest variant seen, {fastest.name}, is {_figure(fastest, noise)}, and the "
        f"noise is wider than the {MARGIN:.0%} the verdict decides by: these rounds cannot "
        "tell whether a pipeline is faster than the plain loop or not"
    )
    if needed is None:
        sentence += (
            f"; over {MAX_ROUNDS_HINT} rounds would be needed at this spread: re-run on a "
            "quieter machine (fewer other jobs), with longer epochs (steps=, --steps)"
        )
    else:
        sentence += f"; re-run with {needed} rounds"
    return Verdict(Answer.CANNOT_TELL, fastest.name, sentence, rerun_rounds=needed)


def _picked(
    pick: _Contender,
    ran: Sequence["VariantReport"],
    pool: Sequence["VariantReport"],
    budget: Optional[int],
    noise: float,
) -> Verdict:
    """The answer for a confident pick: the plain loop, or the variant and what it holds."""
    by_name = {r.name: r for r in pool}
    if pick.plain:
        best = max(pool, key=lambda r: r.vs_plain or 0.0)
        return Verdict(
            Answer.KEEP_PLAIN_LOOP,
            None,
            f"no variant is more than {MARGIN:.0%} faster than the plain loop beyond the noise "
            f"(the fastest, {best.name}, is {_figure(best, noise)}), so a pipeline buys nothing "
            f"on this model" + left_out(ran, pool, budget, best.vs_plain or 0.0),
        )
    row = by_name[pick.name]
    sentence = f"{_figure(row, noise)}, +{format_bytes(row.held_peak)} held"
    fastest = max(pool, key=lambda r: r.vs_plain or 0.0)
    dropped = left_out(ran, pool, budget, row.vs_plain or 0.0)
    if dropped:
        sentence += dropped
    elif fastest is not row and (fastest.vs_plain or 0.0) > (row.vs_plain or 0.0):
        more = (fastest.held_peak or 0) - (row.held_peak or 0)
        sentence += (
            f"; {fastest.name} is {pct(fastest.vs_plain or 0.0, row.vs_plain or 0.0)} faster, "
            f"within {MARGIN:.0%} of it, and holds {format_bytes(more)} more"
        )
    else:
        sentence += "; the fastest" + (" within the budget" if budget is not None else "")
    return Verdict(Answer.RECOMMEND, pick.name, sentence)


def judge(
    plain: "VariantReport",
    rows: Sequence["VariantReport"],
    budget: Optional[int],
    exhausted: bool = False,
) -> Verdict:
    """The verdict on the measurements ([Note: the verdict rule]).

    ``plain``: the plain loop's row (its ``seconds`` per round); ``rows``: a
    row per variant asked for (``seconds``, ``paired``, ``vs_plain``,
    ``held_peak``, ``unpipelined``); ``budget``: bytes a pipeline may hold;
    ``exhausted``: no more rounds will be measured (the time budget is
    spent, or the verdict names none to measure), so contenders the noise
    leaves even are an answer ("either will do") rather than a reason to
    re-run -- but never "keep your plain loop" while a variant the noise
    leaves open against it has a ``±`` wider than the margin.
    """
    ran = [r for r in rows if r.ran and r.vs_plain is not None]
    fits = [r for r in ran if budget is None or (r.held_peak is not None and r.held_peak <= budget)]
    nothing = _none_to_judge(rows, ran, fits, budget)
    if nothing is not None:
        return nothing
    clean = [r for r in fits if not r.unpipelined]
    pool = clean or fits
    rounds = len(plain.seconds)
    noise = typical_spread(ran)
    # The plain loop holds least of all; a variant without a ledger figure, most.
    contenders = [_Contender(PLAIN_NAME, 1.0, (1.0,) * rounds, -1)] + [
        _Contender(
            r.name, r.vs_plain or 0.0, r.paired, sys.maxsize if r.held_peak is None else r.held_peak
        )
        for r in pool
    ]
    by_name = {r.name: r for r in pool}
    lead = _leading(contenders)
    leads = (
        "the plain loop leads"
        if lead.plain
        else f"{lead.name} leads at {_figure(by_name[lead.name], noise)}"
    )

    too_little = _too_little(plain, ran, lead, leads)
    if too_little is not None:
        return too_little
    pick = _confident_pick(contenders, noise)
    if pick is None:
        return _no_confident_pick(lead, leads, contenders, pool, noise, rounds, exhausted)
    return _picked(pick, ran, pool, budget, noise)


__all__ = [
    "MARGIN",
    "MAX_ROUNDS_HINT",
    "MIN_EPOCH_SECONDS",
    "MIN_ROUNDS",
    "Answer",
    "Verdict",
    "band",
    "judge",
    "typical_spread",
]
