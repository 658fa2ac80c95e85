"""How long advise measures: the timed epoch's length and the rounds, within a time budget.

[Note: epochs long enough, within the time budget]
A timed epoch under ``MIN_EPOCH_SECONDS`` is too short to judge by
([Note: the verdict rule] in :mod:`trec_pipelines.advise.verdict`), and
more rounds are what narrows the noise.  Rather than tell the user to re-run
with more steps or rounds, advise follows its own hints while the time
budget allows:

* before the rounds, the plain loop is timed once on the first build's
  model (:func:`~trec_pipelines.advise.measure.probe`), and the timed epoch
  is lengthened to ``EPOCH_AIM`` of the plain loop (:func:`first_epoch`):
  three times the shortest epoch the verdict accepts, so that a variant up
  to three times as fast as the plain loop still times one, the probe's own
  error (one epoch, on a cold model) included.  It is never shorter than the
  ``steps`` asked for, and no longer than the budget affords for the rounds
  asked for -- but never shorter than ``EPOCH_FLOOR`` (1 s) of the plain loop
  either: an epoch too short to time is wasted, and the floor costs a small
  model at most a second per contender and round (a large one's ``steps``
  take longer anyway).  The probe times the plain loop only: a variant far
  faster than it shows in the first round, and a machine that gets quieter
  shortens the epochs of any later one: after every round whose shortest
  epoch is under 1.5 times the least the verdict accepts, the rounds start
  again with the epoch that brings it to ``EPOCH_FLOOR``
  (:func:`floor_epoch`) -- the first time whatever the budget, later times
  when the rounds asked for fit in what is left of it.  Batches that end
  sooner are cycled (the same batches, in the same order, for every
  contender: :func:`~trec_pipelines.advise.measure.take`);
* after the rounds, while the verdict is "cannot tell" (:func:`next_move`):
  an epoch still too short re-measures every round with the epoch that
  brings the shortest contender's to ``EPOCH_AIM``; noise that more rounds
  would settle adds one round at a time (the verdict is judged again after
  each), as long as the next move fits in what is left of the budget, by the
  cost of the rounds measured so far (:class:`Cost`);
* when the next move does not fit, or "cannot tell" names none, the verdict
  is judged once more with no rounds to come (``judge(..., exhausted=True)``): contenders the noise
  leaves even are then an answer ("either will do") -- but never "keep your
  plain loop" while a variant's ``±`` against the plain loop is wider than
  the margin -- and "cannot tell" says, when the run took longer than the
  budget or the next move would have, that the budget is spent and what
  budget would let it go on (:func:`spent`): for more rounds, all those it
  asks for, by the cost of the rounds measured.

The budget counts the whole run (builds, warm-ups, the untimed epochs);
the rounds asked for are always measured, with epochs at the floor, even
when they alone exceed it.  Every decision here is taken from numbers
all ranks agree on (the slowest rank's), so all ranks take the same one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from trec_pipelines.advise.verdict import MIN_EPOCH_SECONDS, Answer, Verdict

# The plain loop's timed epoch aimed at, within the budget (see the note above).
EPOCH_AIM = 3 * MIN_EPOCH_SECONDS
# The least it is given, whatever the budget: a variant up to twice as fast
# still times 0.5 s, and it costs at most this per contender and round.
EPOCH_FLOOR = 2 * MIN_EPOCH_SECONDS
# The time budget when none is given: about a minute of a small model's run.
DEFAULT_TIME_BUDGET = 60.0


def round_up(steps: int) -> int:
    """Steps as a reader would choose them: a multiple of ten beyond ten."""
    return steps if steps <= 10 else 10 * math.ceil(steps / 10)


def first_epoch(
    steps: int,
    step_seconds: float,
    fixed_round_seconds: float,
    contenders: int,
    rounds: int,
    remaining: float,
) -> int:
    """The timed epoch's steps before any round: ``EPOCH_AIM`` of the plain loop at
    ``step_seconds`` a step, within what ``remaining`` seconds afford for ``rounds`` rounds
    of ``contenders`` (``fixed_round_seconds`` of each round being outside the timed
    epochs), never fewer than ``steps`` nor than ``EPOCH_FLOOR`` of the plain loop takes."""
    if step_seconds <= 0:
        return steps
    want = round_up(math.ceil(EPOCH_AIM / step_seconds))
    floor = math.ceil(EPOCH_FLOOR / step_seconds)
    per_round = remaining / max(rounds, 1) - fixed_round_seconds
    afford = math.floor(per_round / (contenders * step_seconds)) if per_round > 0 else 0
    return max(steps, floor, min(want, afford))


def floor_epoch(epoch_steps: int, shortest: float) -> Optional[int]:
    """After a round: the epoch that brings its shortest contender's (``shortest`` seconds
    at ``epoch_steps``) to ``EPOCH_FLOOR``, when that one was under 1.5 times the least the
    verdict accepts (None: long enough)."""
    if shortest >= 1.5 * MIN_EPOCH_SECONDS:
        return None
    return max(
        round_up(math.ceil(epoch_steps * EPOCH_FLOOR / max(shortest, 1e-9))), epoch_steps + 1
    )


@dataclass(frozen=True)
class Cost:
    """What a round costs, from the rounds measured so far (the slowest rank's clock).

    Attributes:
        fixed: seconds of a round outside its timed epochs (builds, warm-ups,
            the untimed epochs).
        timed: seconds of a round's timed epochs, all contenders.
        steps: the timed epoch's steps they were measured at.
    """

    fixed: float
    timed: float
    steps: int

    def round(self, steps: int) -> float:
        """A round's expected seconds with timed epochs of ``steps``."""
        return self.fixed + self.timed * steps / max(self.steps, 1)


@dataclass(frozen=True)
class Move:
    """What to measure next.

    Attributes:
        epoch_steps: the timed epoch's steps; when it differs from the current
            one, every round is measured again at it.
        rounds: the rounds to have measured after the move.
        seconds: what the move is expected to cost.
    """

    epoch_steps: int
    rounds: int
    seconds: float


def next_move(
    verdict: Verdict,
    epoch_steps: int,
    rounds_done: int,
    rounds_asked: int,
    shortest_epoch: float,
    cost: Cost,
) -> Optional[Move]:
    """The move that follows ``verdict``'s own hint (None: it is an answer, or gives none).

    Too short an epoch: every round again, ``rounds_asked`` of them (or the
    rounds the verdict asks for, if more), with the epoch that brings the
    shortest contender's (``shortest_epoch`` seconds at ``epoch_steps``) to
    ``EPOCH_AIM``.  Otherwise more rounds: one more.
    """
    if verdict.answer is not Answer.CANNOT_TELL:
        return None
    if verdict.rerun_steps is not None:
        scaled = math.ceil(epoch_steps * EPOCH_AIM / max(shortest_epoch, 1e-9))
        steps = max(round_up(scaled), verdict.rerun_steps, epoch_steps + 1)
        rounds = max(rounds_asked, verdict.rerun_rounds or 0)
        return Move(steps, rounds, rounds * cost.round(steps))
    if verdict.rerun_rounds is not None and verdict.rerun_rounds > rounds_done:
        return Move(epoch_steps, rounds_done + 1, cost.round(epoch_steps))
    return None


def spent(verdict: Verdict, time_budget: float, wanted: Optional[float]) -> Verdict:
    """``verdict`` (judged with no rounds to come) saying, when it cannot tell, that the time
    budget is spent and, with ``wanted`` (the whole run's seconds the next move would have
    taken), what budget would let it go on."""
    if verdict.answer is not Answer.CANNOT_TELL:
        return verdict
    more = "" if wanted is None else f"; about {round_up(math.ceil(wanted))} s would let it go on"
    return dataclasses.replace(
        verdict,
        reason=f"{verdict.reason}; the time budget of {time_budget:.0f} s is spent{more} "
        "(time_budget=, --time-budget)",
        rerun_time_budget=None if wanted is None else float(round_up(math.ceil(wanted))),
    )


__all__ = [
    "DEFAULT_TIME_BUDGET",
    "EPOCH_AIM",
    "EPOCH_FLOOR",
    "Cost",
    "Move",
    "first_epoch",
    "floor_epoch",
    "next_move",
    "round_up",
    "spent",
]
