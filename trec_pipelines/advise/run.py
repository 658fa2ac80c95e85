"""``advise(build, ...)``: time a user's own model under every applicable variant.

[Note: fresh models in paired rounds]
The bench keeps every contender alive and interleaves their epochs (A B C,
A B C, ...), so the drift of a shared machine hits all alike.  advise may not
keep two models alive (a user's model may fill the device alone), so a
*round* here builds each contender in turn from ``build()`` -- the plain loop
first, then each variant -- trains ``warmup`` batches untimed, times one
epoch of ``steps`` batches, and frees it before the next is built.  Rounds
repeat (the order rotated each round, as the bench's), and each contender's
result is its median over rounds; its ratio to the plain loop is the ratio of
the medians, the bench's ``x plain``.  The per-round ratio to the plain loop
of the same round measures the noise ([Note: the verdict rule] in
:mod:`trec_pipelines.advise.verdict`).  Building costs time between epochs
but is never timed; the price against the bench is that a round's
contenders are minutes apart rather than seconds on a large model, so
``rounds`` should grow with the noise of the machine.

The input dist is tapped in an untimed epoch after every timed one, memory
in one more in the first round only (:mod:`trec_pipelines.advise.measure`).

Every rank runs the same contenders in the same order; after each one the
ranks exchange what they measured (an ``all_gather_object`` on a gloo group
of advise's own), so all agree on which failed and all compute the same
advice.  A variant that raises on every rank is reported and the others are
still measured; one that raises on some ranks only can leave the others in a
collective of the model's process group, which then ends at that group's
timeout.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from trec_pipelines.advise.advice import Advice, parse_bytes
from trec_pipelines.advise.budget import (
    DEFAULT_TIME_BUDGET,
    Cost,
    Move,
    first_epoch,
    floor_epoch,
    next_move,
    spent,
)
from trec_pipelines.advise.compose import compose
from trec_pipelines.advise.link import LinkEstimate, estimate
from trec_pipelines.advise.measure import (
    PLAIN,
    Build,
    BuildError,
    RoundResult,
    call_build,
    measure_round,
    probe,
)
from trec_pipelines.advise.variants import Variant, VariantSpec, not_applicable, resolve
from trec_pipelines.advise.verdict import Answer, judge

# Progress callback: (what just finished, contenders done, contenders in all).
Progress = Callable[[str, int, int], None]


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


class _Ranks:
    """advise's own gloo group: the ranks agree on every outcome through it."""

    def __init__(self, timeout: Optional[datetime.timedelta]) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "advise() runs inside an initialized process group, called by every rank: "
                "torch.distributed.init_process_group(...) first, under torchrun "
                "(or use `python -m trec_pipelines.advise --build module:function`, which launches the ranks)"
            )
        group = dist.new_group(backend="gloo", timeout=timeout)
        assert isinstance(group, dist.ProcessGroup)  # every rank is a member
        self.group = group
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def gather(self, value: Any) -> List[Any]:
        out: List[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def agree(self, error: Optional[str]) -> None:
        """Raise :class:`BuildError` on every rank when ``build()`` failed on any."""
        for rank, err in enumerate(self.gather(error)):
            if err is not None:
                raise BuildError(err if err.startswith("on rank") else f"on rank {rank}: {err}")

    def close(self) -> None:
        dist.destroy_process_group(self.group)


def _first_error(
    gathered: Sequence[Tuple[Optional[Tuple[str, str, bool]], Any]],
) -> Optional[Tuple[int, str, str, bool]]:
    for rank, (err, _) in enumerate(gathered):
        if err is not None:
            return (rank, *err)
    return None


def _round_order(names: Sequence[str], round_index: int) -> List[str]:
    """Each round starts one contender further on and alternates direction, as the bench's."""
    shift = round_index % max(len(names), 1)
    order = list(names[shift:]) + list(names[:shift])
    return order if round_index % 2 == 0 else order[::-1]


def advise(
    build: Build,
    *,
    steps: int = 20,
    warmup: int = 5,
    rounds: int = 3,
    memory_budget: Union[int, float, str, None] = None,
    variants: Optional[Sequence[VariantSpec]] = None,
    include_compiled: bool = False,
    device: Optional[torch.device] = None,
    timeout: Optional[datetime.timedelta] = None,
    progress: Optional[Progress] = None,
    time_budget: float = DEFAULT_TIME_BUDGET,
) -> Advice:
    """Measure the model ``build()`` makes under every applicable variant, and judge.

    The verdict (``advice.verdict``) is one of three: recommend a variant,
    keep your plain loop, or cannot tell (the note "the verdict rule" in the
    source of ``trec_pipelines.advise.verdict``).  Within ``time_budget``
    seconds it lengthens the timed epochs (cycling the batches when they end
    first) until they are long enough to time, and adds rounds while the noise
    leaves the answer open (the note "epochs long enough, within the time
    budget" in ``trec_pipelines.advise.budget``); it cannot tell when the
    budget is spent first, and then says what budget would let it go on, or
    when a variant's spread against the plain loop is wider than 2%.

    Call it on every rank of an initialized process group.  ``build()``
    returns ``(model, optimizer, batches)`` as you build them to train: a
    DMP-sharded model whose forward returns ``(loss, output)``, its
    optimizer, and an iterable of this rank's batches that restarts on each
    ``iter()`` (a list, a DataLoader) and gives the same batches each time;
    fewer than the epoch needs are cycled.  It is called once per contender and round, and only one model
    is alive at a time (the note "fresh models in paired rounds" in the source of ``trec_pipelines.advise.run``).

    Args:
        steps: the fewest batches in each timed epoch; advise lengthens it
            to time one (an epoch under 0.5 s is too short to judge by).
        warmup: batches trained untimed before it, on the same model.
        rounds: how many times every contender is built and timed at least
            (>= 1; a verdict other than "cannot tell" needs 3); advise adds
            rounds while the noise leaves the answer open.
        memory_budget: most bytes a pipeline may hold (its memory ledger's
            peak, model and optimizer excluded): an int, or ``"64MiB"``.
        variants: class names of the package or pipeline classes (your own
            subclass too); default every variant, with those that do not
            apply listed with the reason.
        include_compiled: also time PT2 and CompAutograd.
        device: where the model trains; default its first parameter's device.
        timeout: of advise's own gloo group (default the process group's).
        progress: called after each contender's round as ``(label, done, total)``.
        time_budget: seconds the whole run may take (about a minute by
            default); 0 measures the ``steps`` and ``rounds`` asked for and no
            more.  The rounds asked for are measured even when they alone take
            longer.

    Returns:
        an :class:`~trec_pipelines.advise.advice.Advice`, equal on every rank.

    Raises:
        RuntimeError: on every rank, when ``build()`` raised or returned
            something unusable on any rank -- not a 3-tuple, not a module,
            batches that are an iterator, a one-shot iterable or empty -- or
            the plain loop failed; or when there is
            no process group.
        ValueError: bad arguments (steps, rounds, budget, variant names).
    """
    epochs = _Epochs.checked(steps, warmup, rounds, time_budget)
    budget, asked, named = parse_bytes(memory_budget), resolve(variants), variants is not None
    ranks = _Ranks(timeout)
    try:
        return _advise(
            build, ranks, epochs, asked, named, budget, include_compiled, device, progress
        )
    finally:
        ranks.close()


@dataclass(frozen=True)
class _Epochs:
    """What the caller asked of the timed epochs (see :func:`advise`'s arguments).

    Attributes:
        steps: the fewest batches in each timed epoch.
        warmup: batches trained untimed before it.
        rounds: how many times every contender is built and timed at least.
        time_budget: seconds the whole run may take (0: no more than asked).
    """

    steps: int
    warmup: int
    rounds: int
    time_budget: float

    @staticmethod
    def checked(steps: int, warmup: int, rounds: int, time_budget: float) -> _Epochs:
        """The epochs asked for, or a ValueError saying which argument is out of range."""
        if steps < 1 or warmup < 0 or rounds < 1 or not time_budget >= 0:
            raise ValueError(
                "advise: need steps >= 1, warmup >= 0, rounds >= 1 and time_budget >= 0, "
                f"got {steps}, {warmup}, {rounds}, {time_budget}"
            )
        return _Epochs(steps, warmup, rounds, time_budget)


class _Clock:
    """The run's elapsed seconds, the slowest rank's: every rank reads the same."""

    def __init__(self, ranks: _Ranks) -> None:
        self.ranks = ranks
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return float(max(self.ranks.gather(time.monotonic() - self.start)))


def _probe(
    ranks: _Ranks,
    model: nn.Module,
    optimizer: Any,
    batches: Any,
    device: torch.device,
    warmup: int,
    steps: int,
) -> Optional[float]:
    """The plain loop's seconds per step on the first build's model, the slowest rank's
    (None: it failed on some rank; the first round's plain loop then reports why)."""
    seconds: Optional[float]
    try:
        seconds = probe(model, optimizer, batches, device, warmup, steps, ranks.barrier)
    except Exception:
        seconds = None
    gathered = ranks.gather(seconds)
    return None if any(g is None for g in gathered) else float(max(gathered))


class _Rounds:
    """Every contender's results, round by round, and what each round cost."""

    def __init__(self, names: Sequence[str]) -> None:
        self.results: Dict[str, List[List[RoundResult]]] = {name: [] for name in names}
        self.walls: List[float] = []  # each round's seconds, the slowest rank's
        self.timed: List[float] = []  # of which its timed epochs
        self.offset = 0  # contenders measured before these rounds (at a shorter epoch)

    @property
    def count(self) -> int:
        return len(self.walls)

    def cost(self, steps: int) -> Cost:
        """A round's cost, by the rounds after the first (which also runs the ledger epoch)."""
        later = list(range(1, self.count)) or [0]
        timed = statistics.median(self.timed[k] for k in later)
        wall = statistics.median(self.walls[k] for k in later)
        return Cost(fixed=max(wall - timed, 0.0), timed=timed, steps=steps)


@dataclass(frozen=True)
class _FirstBuild:
    """What the first build decided.

    Attributes:
        reasons: per variant asked, why it does not apply (``None``: it does).
        contenders: the plain loop, then each variant that applies, by name.
        device: where the model trains.
        epoch_steps: the batches of each timed epoch, sized by the probe.
        link: the model's link bytes per step, from its shapes (rank 0's).
    """

    reasons: Dict[str, Optional[str]]
    contenders: Dict[str, Optional[Variant]]
    device: torch.device
    epoch_steps: int
    link: Optional[LinkEstimate]


def _first_build(
    build: Build,
    ranks: _Ranks,
    epochs: _Epochs,
    asked: List[Variant],
    variants_named: bool,
    include_compiled: bool,
    device: Optional[torch.device],
    clock: _Clock,
) -> _FirstBuild:
    """A first build decides what applies; its model times the plain loop once,
    to size the timed epoch (it is dropped right after)."""
    steps, warmup = epochs.steps, epochs.warmup
    error: Optional[str] = None
    reasons: Dict[str, Optional[str]] = {}
    model: Optional[nn.Module] = None
    optimizer: Any = None
    batches: Any = None
    built_at = time.monotonic()
    try:
        model, optimizer, batches = call_build(build)
        build_seconds = time.monotonic() - built_at
        train_device = device if device is not None else _device_of(model)
        reasons = {
            v.name: not_applicable(v, model, include_compiled, variants_named) for v in asked
        }
    except BuildError as exc:
        error, train_device, build_seconds = str(exc), torch.device("cpu"), 0.0
    _raise_build_errors(ranks, ranks.gather(error))
    link = ranks.gather(_link_estimate(model, batches, ranks.world))[0]
    timed = [v for v in asked if reasons[v.name] is None]
    contenders: Dict[str, Optional[Variant]] = {PLAIN: None, **{v.name: v for v in timed}}

    epoch_steps = steps
    if epochs.time_budget > 0:
        assert model is not None
        step_seconds = _probe(ranks, model, optimizer, batches, train_device, warmup, steps)
        if step_seconds is not None:
            build_seconds = float(max(ranks.gather(build_seconds)))
            # Outside the timed epochs, a round builds, warms up and runs an untimed
            # epoch for each contender; the first round one more each.
            fixed = len(contenders) * (build_seconds + (warmup + 1.5 * steps) * step_seconds)
            epoch_steps = first_epoch(
                steps,
                step_seconds,
                fixed,
                len(contenders),
                epochs.rounds,
                epochs.time_budget - clock.elapsed(),
            )
    del model, optimizer, batches
    return _FirstBuild(reasons, contenders, train_device, epoch_steps, link)


def _link_estimate(model: Optional[nn.Module], batches: Any, world: int) -> Optional[LinkEstimate]:
    """The model's link bytes per step, from its shapes and its first batch; None when they
    cannot be read (a model or batch of a shape it does not know): it never stops a run."""
    if model is None:
        return None
    try:
        return estimate(model, next(iter(batches)), world)
    except Exception:
        return None


def _advise(
    build: Build,
    ranks: _Ranks,
    epochs: _Epochs,
    asked: List[Variant],
    variants_named: bool,
    budget: Optional[int],
    include_compiled: bool,
    device: Optional[torch.device],
    progress: Optional[Progress],
) -> Advice:
    clock = _Clock(ranks)
    first = _first_build(
        build, ranks, epochs, asked, variants_named, include_compiled, device, clock
    )
    reasons, contenders, epoch_steps = first.reasons, first.contenders, first.epoch_steps
    steps, warmup = epochs.steps, epochs.warmup
    rounds, time_budget = epochs.rounds, epochs.time_budget

    failures: Dict[str, str] = {}
    measured = _Rounds(list(contenders))
    total = rounds * len(contenders)
    wanted: Optional[float] = None
    restarted = False  # the first restart at a longer epoch is made whatever the budget
    while True:
        while measured.count < rounds:
            _measure_round(
                build,
                ranks,
                contenders,
                measured,
                failures,
                first.device,
                warmup,
                steps,
                epoch_steps,
                progress,
                total,
            )
            # A round whose shortest epoch came in short: a contender far faster than the
            # probe's plain loop, or a machine that got quieter since the epoch was sized.
            longer = (
                None
                if time_budget <= 0
                else floor_epoch(epoch_steps, _shortest_of_round(measured, measured.count - 1))
            )
            if longer is not None and (
                not restarted
                or clock.elapsed() + rounds * measured.cost(epoch_steps).round(longer)
                <= time_budget
            ):
                restarted = True
                offset = measured.offset + measured.count * len(contenders)
                epoch_steps, measured = longer, _Rounds(list(contenders))
                measured.offset = offset
                total = offset + rounds * len(contenders)
        advice = compose(
            asked,
            reasons,
            measured.results,
            failures,
            budget,
            measured.count,
            warmup,
            epoch_steps,
            ranks.world,
        )
        if time_budget <= 0:
            break
        move = _next(advice, epoch_steps, measured, rounds)
        if move is None:
            break
        elapsed = clock.elapsed()
        if elapsed + move.seconds > time_budget:
            wanted = elapsed + move.seconds
            break
        if move.epoch_steps != epoch_steps:  # every round again, at the longer epoch
            offset = measured.offset + measured.count * len(contenders)
            epoch_steps, measured = move.epoch_steps, _Rounds(list(contenders))
            measured.offset = offset
        rounds = move.rounds
        total = measured.offset + rounds * len(contenders)
    # No more rounds to come: the budget stopped it, or the verdict names none to measure.
    final = time_budget > 0 and (wanted is not None or advice.verdict.answer is Answer.CANNOT_TELL)
    cost = measured.cost(epoch_steps)
    advice = dataclasses.replace(advice, link=first.link)
    return _finish(advice, steps, time_budget, clock.elapsed(), wanted, final, cost)


def _shortest_of_round(measured: _Rounds, k: int) -> float:
    """The shortest timed epoch of round ``k`` over the contenders (the slowest rank's each)."""
    return min(
        max(r.seconds for r in per_round[k])
        for per_round in measured.results.values()
        if len(per_round) > k
    )


def _next(advice: Advice, epoch_steps: int, measured: _Rounds, rounds: int) -> Optional[Move]:
    epochs = [statistics.median(r.seconds) for r in (advice.plain, *advice.variants) if r.seconds]
    return next_move(
        advice.verdict,
        epoch_steps,
        measured.count,
        rounds,
        min(epochs),
        measured.cost(epoch_steps),
    )


def _finish(
    advice: Advice,
    steps: int,
    time_budget: float,
    elapsed: float,
    wanted: Optional[float],
    final: bool,
    cost: Cost,
) -> Advice:
    """The advice as measured: judged with no rounds to come when ``final``, saying the
    budget is spent when ``wanted`` (what the next move would have taken) exceeded it, and
    what budget the rounds it asks for would take (``cost`` a round's)."""
    # Spent: the run took longer than the budget (the rounds asked for are measured
    # whatever they cost), or the next move would have.
    budget_spent = time_budget > 0 and (wanted is not None or elapsed > time_budget)
    advice = dataclasses.replace(
        advice,
        steps_asked=steps,
        time_budget=time_budget,
        elapsed=elapsed,
        exhausted=final,
        budget_spent=budget_spent,
    )
    if not final:
        return advice
    verdict = judge(advice.plain, advice.variants, advice.memory_budget, exhausted=True)
    if budget_spent:
        rounds_to_come = (verdict.rerun_rounds or 0) - advice.rounds
        if verdict.rerun_steps is None and rounds_to_come > 0:
            # All the rounds it asks for, not only the next one the budget could not afford.
            wanted = max(wanted or 0.0, elapsed + rounds_to_come * cost.round(advice.steps))
        verdict = spent(verdict, time_budget, wanted)
    return dataclasses.replace(advice, verdict=verdict)


def _measure_round(
    build: Build,
    ranks: _Ranks,
    contenders: Dict[str, Optional[Variant]],
    measured: _Rounds,
    failures: Dict[str, str],
    train_device: torch.device,
    warmup: int,
    steps: int,
    epoch_steps: int,
    progress: Optional[Progress],
    total: int,
) -> None:
    """One round: each contender in the round's order, built, timed and freed."""
    round_index = measured.count
    started = time.monotonic()
    timed_seconds = 0.0
    for k, name in enumerate(_round_order(list(contenders), round_index)):
        done = measured.offset + round_index * len(contenders) + k + 1
        if name in failures:
            continue
        outcome: Tuple[Optional[Tuple[str, str, bool]], Optional[RoundResult]]
        try:
            value = measure_round(
                build,
                contenders[name],
                train_device,
                warmup,
                steps,
                detailed=round_index == 0,
                barrier=ranks.barrier,
                agree=ranks.agree,
                epoch_steps=epoch_steps,
            )
            outcome = (None, value)
        except BuildError as exc:
            outcome = ((str(exc), traceback.format_exc(), True), None)
        except Exception as exc:  # the variant's failure: reported, the others go on
            message = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            outcome = ((message, traceback.format_exc(), False), None)
        gathered = ranks.gather(outcome)
        first = _first_error(gathered)
        if first is not None:
            rank, message, _, is_build = first
            if is_build:
                prefix = "" if message.startswith("on rank") else f"on rank {rank}: "
                raise RuntimeError(f"advise: {prefix}{message}")
            if name == PLAIN:
                raise RuntimeError(
                    f"advise: the plain loop (zero_grad, forward, sum(loss).backward(), step) failed on rank "
                    f"{rank}: {message}; the model must train without a pipeline first"
                )
            failures[name] = f"{message} (rank {rank}, round {round_index + 1})"
            # Its earlier rounds go with it: a contender is reported over every round or none.
            measured.results[name] = []
        else:
            results = [value for _, value in gathered]
            measured.results[name].append(results)
            timed_seconds += max(r.seconds for r in results if r is not None)
        if progress is not None:
            progress(f"round {round_index + 1} {name}", done, max(total, done))
    walls = ranks.gather(time.monotonic() - started)
    measured.walls.append(float(max(walls)))
    measured.timed.append(timed_seconds)


def _raise_build_errors(ranks: _Ranks, errors: Sequence[Optional[str]]) -> None:
    for rank, err in enumerate(errors):
        if err is not None:
            raise RuntimeError(f"advise: on rank {rank}: {err}")


__all__ = ["Progress", "advise", "parse_bytes"]
