"""How long advise measures, without a process group: the epoch's length, the next move,
the spent budget, and the run loop on a fake measurement ([Note: epochs long enough,
within the time budget] in trec_pipelines/advise/budget.py)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest

from trec_pipelines.advise.advice import Advice
from trec_pipelines.advise.budget import (
    EPOCH_AIM,
    EPOCH_FLOOR,
    Cost,
    Move,
    first_epoch,
    floor_epoch,
    next_move,
    round_up,
    spent,
)
from trec_pipelines.advise.measure import PLAIN, RoundResult
from trec_pipelines.advise.variants import resolve
from trec_pipelines.advise.verdict import Answer, Verdict

CANNOT = Answer.CANNOT_TELL


def test_round_up() -> None:
    assert [round_up(n) for n in (1, 10, 11, 20, 21, 139)] == [1, 10, 20, 20, 30, 140]


def test_the_first_epoch_aims_at_a_second_and_a_half_of_the_plain_loop() -> None:
    assert EPOCH_AIM == 1.5 and EPOCH_FLOOR == 1.0
    # 7 ms a step: 215 steps make 1.5 s, rounded up to 220; plenty of budget.
    assert first_epoch(20, 0.007, 5.0, 3, 3, 600.0) == 220
    # Never fewer than asked, however fast the step or however long it would take.
    assert first_epoch(300, 0.007, 5.0, 3, 3, 600.0) == 300
    assert first_epoch(20, 0.2, 5.0, 3, 3, 600.0) == 20
    # The budget affords (60 / 3 - 5) s = 15 s of timed epochs a round, over 3
    # contenders at 7 ms a step: 714 steps; so the aim (220) stands ...
    assert first_epoch(20, 0.007, 5.0, 3, 3, 60.0) == 220
    # ... but with 27 s left: (9 - 5) / (3 * 0.007) = 190 steps.
    assert first_epoch(20, 0.007, 5.0, 3, 3, 27.0) == 190
    # Never under the floor, 1 s of the plain loop (143 steps), whatever the budget.
    assert first_epoch(20, 0.007, 5.0, 3, 3, 21.0) == 143
    assert first_epoch(20, 0.007, 5.0, 3, 3, 0.0) == 143
    # No probe figure: the steps asked for.
    assert first_epoch(20, 0.0, 5.0, 3, 3, 60.0) == 20


def test_after_the_first_round_a_short_epoch_is_brought_to_the_floor() -> None:
    assert floor_epoch(300, 0.75) is None and floor_epoch(300, 2.0) is None
    # 0.3 s at 300 steps: 1000 steps make 1 s.
    assert floor_epoch(300, 0.3) == 1000
    # Rounded up as a reader would, and always longer.
    assert floor_epoch(300, 0.7) == 430 and floor_epoch(1, 0.7) == 2


COST = Cost(fixed=4.0, timed=2.0, steps=100)


def test_a_round_costs_its_fixed_part_and_its_timed_epochs_in_proportion() -> None:
    assert COST.round(100) == 6.0 and COST.round(250) == 9.0


def test_an_answer_needs_no_move() -> None:
    for answer in (Answer.RECOMMEND, Answer.KEEP_PLAIN_LOOP):
        assert next_move(Verdict(answer, None, "x"), 100, 3, 3, 0.8, COST) is None
    # Cannot tell, with no hint (nothing that more measuring would settle): none either.
    assert next_move(Verdict(CANNOT, None, "x"), 100, 3, 3, 0.8, COST) is None


def test_too_short_measures_every_round_again_at_the_epoch_that_brings_it_to_the_aim() -> None:
    short = Verdict(CANNOT, None, "too short", rerun_steps=130)
    # The shortest epoch took 0.4 s at 100 steps: 375 steps bring it to 1.5 s (380).
    assert next_move(short, 100, 3, 3, 0.4, COST) == Move(380, 3, 3 * COST.round(380))
    # The verdict's own figure when larger, and its rounds when it asks for more.
    both = Verdict(CANNOT, None, "x", rerun_steps=400, rerun_rounds=5)
    assert next_move(both, 100, 3, 3, 0.4, COST) == Move(400, 5, 5 * COST.round(400))
    # Always longer than the epoch it had.
    assert next_move(Verdict(CANNOT, None, "x", rerun_steps=1), 100, 3, 3, 5.0, COST) == Move(
        101, 3, 3 * COST.round(101)
    )


def test_noise_adds_one_round_at_a_time_at_the_same_epoch() -> None:
    noisy = Verdict(CANNOT, None, "noise", rerun_rounds=7)
    assert next_move(noisy, 150, 3, 3, 0.8, COST) == Move(150, 4, COST.round(150))
    assert next_move(noisy, 150, 6, 3, 0.8, COST) == Move(150, 7, COST.round(150))
    assert next_move(noisy, 150, 7, 3, 0.8, COST) is None  # measured as asked: nothing more


def test_a_spent_budget_says_what_budget_would_go_on() -> None:
    open_ = Verdict(CANNOT, "A", "A leads, but ...; re-run with 9 rounds", rerun_rounds=9)
    said = spent(open_, 60.0, 83.2)
    assert said.reason == (
        "A leads, but ...; re-run with 9 rounds; the time budget of 60 s is spent; about 90 s "
        "would let it go on (time_budget=, --time-budget)"
    )
    assert said.rerun_time_budget == 90.0 and said.rerun_rounds == 9
    answer = Verdict(Answer.RECOMMEND, "A", "1.3x plain")
    assert spent(answer, 60.0, 83.2) is answer


# The run loop, on a fake measurement: no process group, no model.  The ranks
# are one; "measuring" a round appends hand-written seconds.


class FakeRanks:
    """One rank: gathering returns what it is given."""

    world = 1
    rank = 0

    def barrier(self) -> None:
        pass

    def gather(self, value: Any) -> List[Any]:
        return [value]

    def agree(self, error: Optional[str]) -> None:
        assert error is None


class Machine:
    """A fake clock and a fake measurement.

    ``step``: seconds per step of each contender; ``factor``: per contender,
    its epoch's factor in each round (the last one repeats), the noise.  A
    round of a contender costs 0.5 s of build and its epochs, on the clock.
    """

    def __init__(
        self,
        step: Dict[str, float],
        factor: Optional[Dict[str, Sequence[float]]] = None,
        probe_step: Optional[float] = None,
    ) -> None:
        self.step = step
        self.factor = factor or {}
        self.probe_step = step[PLAIN] if probe_step is None else probe_step
        self.now = 0.0
        self.rounds: Dict[str, int] = {}
        self.calls: List[Tuple[str, int]] = []  # (contender, timed epoch steps)
        self.probed = 0

    def monotonic(self) -> float:
        return self.now

    def measure_round(
        self,
        build: Any,
        variant: Any,
        device: Any,
        warmup: int,
        steps: int,
        detailed: bool,
        barrier: Any,
        agree: Any,
        epoch_steps: Optional[int] = None,
    ) -> RoundResult:
        name = PLAIN if variant is None else variant.name
        epoch = steps if epoch_steps is None else epoch_steps
        k = self.rounds.get(name, 0)
        self.rounds[name] = k + 1
        factors = self.factor.get(name, (1.0,))
        seconds = self.step[name] * epoch * factors[min(k, len(factors) - 1)]
        untimed = (warmup + steps * (2 if detailed else 1)) * self.step[name]
        self.now += 0.5 + seconds + untimed
        self.calls.append((name, epoch))
        held = (0 if variant is None else 1024) if detailed else None
        # 24 batches a pass: cycled whenever warm-up + epoch asks for more.
        return RoundResult(
            seconds=seconds,
            steps=epoch,
            held_peak=held,
            pass_length=24 if warmup + epoch > 24 else None,
        )

    def probe(self, *args: Any) -> float:
        self.probed += 1
        self.now += 1.0
        return self.probe_step


def run(
    monkeypatch: Any,
    machine: Machine,
    names: Sequence[str],
    time_budget: float,
    rounds: int = 3,
) -> Advice:
    """``_advise`` on the fake machine: what the loop decides, with no process group."""
    import types

    import torch

    from trec_pipelines.advise import run as run_module

    monkeypatch.setattr(run_module, "measure_round", machine.measure_round)
    monkeypatch.setattr(run_module, "probe", machine.probe)
    monkeypatch.setattr(run_module, "not_applicable", lambda *args: None)

    def call_build(build: Any) -> Tuple[Any, Any, List[int]]:
        machine.now += 0.5
        return torch.nn.Linear(1, 1), None, [0] * 24

    monkeypatch.setattr(run_module, "call_build", call_build)
    monkeypatch.setattr(run_module, "time", types.SimpleNamespace(monotonic=machine.monotonic))
    return run_module._advise(
        lambda: None,  # type: ignore[arg-type,return-value]
        FakeRanks(),  # type: ignore[arg-type]
        run_module._Epochs(steps=20, warmup=5, rounds=rounds, time_budget=time_budget),
        resolve(list(names)),
        True,
        None,
        False,
        torch.device("cpu"),
        None,
    )


SD, BASE = "TrainPipelineSparseDist", "TrainPipelineBase"


def test_the_probe_sizes_the_epoch_and_the_batches_are_cycled(monkeypatch: Any) -> None:
    # 5 ms a step for the plain loop: 300 steps make the 1.5 s aimed at.
    machine = Machine({PLAIN: 0.005, SD: 0.004, BASE: 0.005})
    advice = run(monkeypatch, machine, [SD, BASE], 600.0)
    assert machine.probed == 1
    assert machine.calls == [(name, 300) for name in (PLAIN, SD, BASE, PLAIN, BASE, SD)] + [
        (name, 300) for name in (BASE, PLAIN, SD)
    ]  # 3 rounds, each in the bench's order
    assert advice.steps == 300 and advice.steps_asked == 20 and advice.rounds == 3
    assert advice.batches_per_pass == 24 and not advice.exhausted
    assert advice.verdict.answer is Answer.RECOMMEND and advice.recommended == SD
    assert advice.cycling() == (
        "timed epochs lengthened from 20 to 300 steps to be long enough to time; your 24 batches "
        "cycled 12.7 times per round (warm-up + timed epoch), in the same order for every "
        f"contender; {advice.elapsed:.0f} s of a 600 s time budget"
    )
    assert advice.cycling() in advice.table().splitlines()


def test_a_variant_far_faster_than_the_probe_starts_the_rounds_again_longer(
    monkeypatch: Any,
) -> None:
    # SparseDist is 5x faster than the plain loop: at 300 steps its first
    # epoch is 0.3 s, under 0.75 s; the rounds start again, at once, at the
    # 1000 steps that make it 1 s (the floor).
    machine = Machine({PLAIN: 0.005, SD: 0.001})
    advice = run(monkeypatch, machine, [SD], 600.0)
    assert [steps for _, steps in machine.calls] == [300] * 2 + [1000] * 6
    assert advice.steps == 1000 and advice.rounds == 3 and len(advice[SD].seconds) == 3
    assert advice.recommended == SD and advice[SD].vs_plain == pytest.approx(5.0)


def test_a_later_round_that_comes_in_short_starts_the_rounds_again_longer(
    monkeypatch: Any,
) -> None:
    # SparseDist's first epoch is long enough (0.9 s), then it halves (a machine
    # that got quieter): its second round's 0.375 s is under 0.75 s, so every
    # round again, at once, at the 800 steps that bring it to 1 s (300 * 1 / 0.375),
    # rather than ending with a median too short to time.
    machine = Machine({PLAIN: 0.005, SD: 0.0025}, {SD: (1.2, 0.5)})
    advice = run(monkeypatch, machine, [SD], 600.0)
    assert [steps for _, steps in machine.calls] == [300] * 4 + [800] * 6
    assert advice.steps == 800 and advice.rounds == 3
    assert advice.recommended == SD and advice[SD].vs_plain == pytest.approx(4.0)


def test_noise_adds_rounds_until_it_settles(monkeypatch: Any) -> None:
    # Per-round ratios 1.0, 1.1, 1.2, then 1.1: cannot tell after 3 (it asks
    # for 7); after 5 the lead over the 2% margin is beyond the noise.
    factor = {SD: (1 / 1.0, 1 / 1.1, 1 / 1.2, 1 / 1.1)}
    machine = Machine({PLAIN: 0.005, SD: 0.005}, factor)
    advice = run(monkeypatch, machine, [SD], 600.0)
    assert advice.rounds == 5 and [steps for _, steps in machine.calls] == [300] * 10
    assert advice[SD].paired == pytest.approx((1.0, 1.1, 1.2, 1.1, 1.1))
    assert advice.verdict.answer is Answer.RECOMMEND and not advice.exhausted


def test_a_spent_budget_with_noise_wider_than_the_margin_cannot_tell_yet(monkeypatch: Any) -> None:
    # The same noise, and a budget that affords the 3 rounds only: SparseDist at
    # 1.10x plain ±0.12 is neither clear of the plain loop nor known to be within
    # 2% of it.  The budget, not the noise, stopped the rounds: cannot tell yet
    # (not "keep your plain loop"), naming SparseDist and the budget that the 7
    # rounds it asks for take: 4 more at a round's cost after the first (1.25 s
    # of builds and untimed epochs + 2.81 s of timed ones, 4.06 s) after 11.6 s,
    # 27.9 s, rounded up to 30 s (the next round alone would have made 20 s).
    factor = {SD: (1 / 1.0, 1 / 1.1, 1 / 1.2, 1 / 1.1)}
    machine = Machine({PLAIN: 0.005, SD: 0.005}, factor)
    advice = run(monkeypatch, machine, [SD], 12.0)
    assert advice.rounds == 3 and advice.exhausted and advice.budget_spent
    verdict = advice.verdict
    assert verdict.answer is Answer.CANNOT_TELL and verdict.variant == SD
    assert verdict.rerun_rounds == 7 and verdict.rerun_time_budget == 30.0
    assert advice.elapsed == pytest.approx(11.62, abs=0.01)
    assert verdict.reason.startswith(f"the fastest variant seen, {SD}, is 1.10x plain ±0.12")
    assert verdict.reason.endswith(
        "re-run with 7 rounds; the time budget of 12 s is spent; about 30 s would let it go on "
        "(time_budget=, --time-budget)"
    )
    assert advice.cycling().endswith("s time budget (spent)")
    # Judged again against a memory budget, the same.
    assert advice.for_budget("1GiB").verdict.reason == verdict.reason


def test_a_budget_too_small_for_long_enough_epochs_cannot_tell_and_says_what_would_do(
    monkeypatch: Any,
) -> None:
    # 1 ms a step: 1500 steps to aim at; 5 s afford less than the floor's 1000
    # (1 s).  SparseDist's first epoch is 1.08 s, then 0.45 s: too short, so the
    # rounds start again, whatever the budget, at the 2230 steps that make it 1 s.
    # Then its epochs shrink again, to 0.40 s: the budget, long spent, affords no
    # second restart, and the median epoch is too short to time.
    machine = Machine({PLAIN: 0.001, SD: 0.0009}, {SD: (1.2, 0.5, 0.5, 0.2)})
    advice = run(monkeypatch, machine, [SD], 5.0)
    assert [steps for name, steps in machine.calls if name == SD] == [1000] * 2 + [2230] * 3
    assert advice.steps == 2230 and advice.exhausted and advice.rounds == 3
    verdict = advice.verdict
    assert verdict.answer is Answer.CANNOT_TELL and verdict.rerun_steps is not None
    assert verdict.rerun_time_budget is not None and verdict.rerun_time_budget > 5.0
    assert verdict.reason.endswith(
        f"the time budget of 5 s is spent; about {verdict.rerun_time_budget:.0f} s would let it "
        "go on (time_budget=, --time-budget)"
    )
    # Judged against another memory budget, it still says so.
    assert advice.for_budget("1GiB").verdict.rerun_time_budget == verdict.rerun_time_budget


def test_no_time_budget_measures_what_was_asked_and_no_more(monkeypatch: Any) -> None:
    machine = Machine({PLAIN: 0.001, SD: 0.001})
    advice = run(monkeypatch, machine, [SD], 0.0)
    assert machine.probed == 0 and [steps for _, steps in machine.calls] == [20] * 6
    assert advice.verdict.answer is Answer.CANNOT_TELL and advice.verdict.rerun_steps
    assert not advice.exhausted and advice.batches_per_pass == 24


def test_noise_no_number_of_rounds_would_narrow_is_judged_with_none_to_come(
    monkeypatch: Any,
) -> None:
    # Per-round ratios 1.04, 1.30, 0.78: about 2% over the plain loop, give or
    # take 0.3, which 50 rounds would not narrow to 2%: no move to make, so no
    # rounds to come, with most of the budget left.  Nothing is faster than the
    # plain loop beyond the noise, but a spread this wide cannot say the plain
    # loop will do: cannot tell yet, and how to re-run.
    factor = {SD: (1 / 1.04, 1 / 1.30, 1 / 0.78)}
    machine = Machine({PLAIN: 0.005, SD: 0.005}, factor)
    advice = run(monkeypatch, machine, [SD], 600.0)
    assert advice.rounds == 3 and advice.exhausted and not advice.budget_spent
    assert advice.verdict.answer is Answer.CANNOT_TELL and advice.verdict.variant == SD
    assert advice.verdict.reason.endswith("with longer epochs (steps=, --steps)")
    assert advice.verdict.rerun_time_budget is None and "time budget" not in advice.reason
    assert advice.cycling().endswith("s of a 600 s time budget")


def test_a_run_longer_than_its_budget_has_spent_it(monkeypatch: Any) -> None:
    # The same noise in 3 rounds that alone take longer than a 10 s budget (the
    # rounds asked for are measured whatever they cost): the budget is spent,
    # and the wide spread is "cannot tell yet", never "keep your plain loop".
    factor = {SD: (1 / 1.04, 1 / 1.30, 1 / 0.78)}
    machine = Machine({PLAIN: 0.005, SD: 0.005}, factor)
    advice = run(monkeypatch, machine, [SD], 10.0)
    assert advice.elapsed is not None and advice.elapsed > 10.0
    assert advice.budget_spent and advice.exhausted
    assert advice.verdict.answer is Answer.CANNOT_TELL
    assert "the time budget of 10 s is spent" in advice.reason
    assert advice.cycling().endswith("s of a 10 s time budget (spent)")
    assert advice.to_dict()["budget_spent"] is True


def test_no_time_budget_is_said_so(monkeypatch: Any) -> None:
    machine = Machine({PLAIN: 0.005, SD: 0.004})
    advice = run(monkeypatch, machine, [SD], 0.0)
    assert not advice.budget_spent
    assert advice.cycling().endswith(
        "s, with no time budget (time_budget=0: the steps and rounds asked for, no more)"
    )
    assert "time budget of 0 s" not in advice.table()
