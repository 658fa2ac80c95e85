"""Where one step's time goes: the package's own parts, timed inside the training loop.

:mod:`benchmarks.measuring.step_profile` counts a step's calls by part; this
module times them.  For each train pipeline class it runs ``--steps`` steady
``progress()`` calls on the sharded test DLRM (as ``step_profile``, on every
rank of the torchrun world), with a timer around each *entry* of the parts that
hold what the defaults protect, and gives each part its exclusive time (a part
entered inside another is taken out of the outer one's):

* ``validation``: the batch check (``batch_problem``, ``validate_batches``);
* ``agreement``: starting and reading each pull's agreement across ranks
  (the all-reduce, or the code a splits exchange carried; its wait included);
* ``batch source``: the source's calls in the step (``fetch_ahead``, ``next``,
  ``retire``), the iterator's own ``next()`` included;
* ``step guard``: the guard around ``progress()`` and its begin (the peer
  failure news included);
* ``recording``: the recorder's per-step calls (off: each is a check and a
  null context).

The rest of the step (``timeline and what it calls``) is the pipeline's
``progress()`` body with the forward, backward, optimizer step, copy and input
dist it asks for: the plain loop's work and the pipeline's own bookkeeping
around it.  The same run times the plain loop of
:func:`~benchmarks.measuring.read_path.plain_loop` on the same model and batches
(no timers in it), so ``added`` (the pipeline's step minus the plain loop's) and
``rest`` (``added`` minus the timed parts: contexts, forward wrappers, the
timeline's own verbs) follow.

Why time inside the loop, not each part alone: each part runs once a step,
after the forward, backward and optimizer step have filled the caches with
their own code and data, so it runs cold; the batch check, for one, costs
several times its time in a tight loop of checks alone (the bench's
``batch validation`` line).  The timers' own cost (two clock reads a wrapped
call) is printed with the table and is inside the pipeline's step, not the plain
loop's.

Run under torchrun (2 ranks, gloo on CPU, as the step profile; one rank runs
with no agreement)::

    PYTHONPATH=$PWD TREC_DEVICE=cpu .venv/bin/torchrun --standalone --nproc_per_node=2 \\
        -m benchmarks.measuring.part_time [--steps N] [ClassName ...]

Rank 0 prints the table.  Microseconds on this machine, so a comparison is only
good within one run; no test holds them.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from benchmarks.measuring import step_profile
from benchmarks.measuring.read_path import STEADY_CALL, build, measuring_world, plain_loop
from benchmarks.settings.variants import COMPILED_VARIANTS

VALIDATION = "validation"
AGREEMENT = "agreement"
SOURCE = "batch source"
GUARD = "step guard"
RECORDING = "recording"
PARTS: Tuple[str, ...] = (VALIDATION, AGREEMENT, SOURCE, GUARD, RECORDING)

# The step profile's train classes but those that compile (a compiled step's time is the
# compiler's and the graph's, not the parts').
CLASSES = tuple(name for name in step_profile.CLASSES if name not in COMPILED_VARIANTS)


class PartClock:
    """Exclusive time per part: each timed call adds its time to its part, less the
    time of the timed calls made inside it (which their own parts get)."""

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.clock = clock
        self.nanos: Dict[str, int] = dict.fromkeys(PARTS, 0)
        self.calls = 0  # timed calls: the timers' own cost is two clock reads each
        # One entry per timed call under way: the nanoseconds its timed callees took.
        self._inner: List[int] = []

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, its time given to ``part``."""

        def call(*args: Any, **kwargs: Any) -> Any:
            self._inner.append(0)
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                took = self.clock() - start
                inner = self._inner.pop()
                self.nanos[part] = self.nanos.get(part, 0) + took - inner
                if self._inner:
                    self._inner[-1] += took
                self.calls += 1

        return call

    def reset(self) -> None:
        self.nanos = dict.fromkeys(self.nanos, 0)
        self.calls = 0


def _entries() -> List[Tuple[Any, str, str]]:
    """(owner, attribute, part) of every part entry timed (a module's global or a
    class's method)."""
    from trec_pipelines.core.step_guard import StepGuard
    from trec_pipelines.data import source
    from trec_pipelines.data.agreement import Agreement, AgreementChannel
    from trec_pipelines.observe.recording import Recording

    return [
        (source, "batch_problem", VALIDATION),
        (AgreementChannel, "start", AGREEMENT),
        (Agreement, "all_reduce", AGREEMENT),
        (Agreement, "result", AGREEMENT),
        (source.BatchSource, "fetch_ahead", SOURCE),
        (source.BatchSource, "next", SOURCE),
        (source.BatchSource, "retire", SOURCE),
        (StepGuard, "begin", GUARD),
        (Recording, "span", RECORDING),
        (Recording, "begin_call", RECORDING),
    ]


@contextlib.contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` set to ``value`` (a class's own or inherited method, a module's
    global), then put back as it was."""
    missing = object()
    old = vars(owner).get(name, missing)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(owner, name)  # it was inherited
        else:
            setattr(owner, name, old)


@contextlib.contextmanager
def _guard_timed(clock: PartClock, classes: Sequence[type]) -> Iterator[None]:
    """Time each class's step guard: its ``progress`` (the guard's wrapper) as the
    guard, and the ``progress`` the wrapper calls (its closure's) as the timeline,
    whose time the guard's is then without.  A ``progress`` several classes share is
    timed once."""
    with contextlib.ExitStack() as stack:
        done: set[int] = set()
        for cls in classes:
            outer = cls.progress
            cells = dict(zip(outer.__code__.co_freevars, outer.__closure__ or (), strict=True))
            if "progress" not in cells or id(outer) in done:  # not guarded, or timed
                continue
            done.add(id(outer))
            cell = cells["progress"]
            inner = cell.cell_contents
            cell.cell_contents = clock.timed("timeline", inner)
            stack.callback(setattr, cell, "cell_contents", inner)
            owner = next(k for k in cls.__mro__ if vars(k).get("progress") is outer)
            stack.enter_context(_replaced(owner, "progress", clock.timed(GUARD, outer)))
        yield


@contextlib.contextmanager
def timers(clock: PartClock, classes: Sequence[type]) -> Iterator[None]:
    """Every part entry of :func:`_entries` (and each of ``classes``' step guard)
    timed into ``clock``."""
    with contextlib.ExitStack() as stack:
        for owner, name, part in _entries():
            stack.enter_context(_replaced(owner, name, clock.timed(part, vars(owner)[name])))
        stack.enter_context(_guard_timed(clock, classes))
        yield


@dataclass
class Timing:
    """One contender's rounds: its step, and each part's exclusive time, per round."""

    name: str
    step_us: List[float] = field(default_factory=list)
    parts_us: Dict[str, List[float]] = field(default_factory=lambda: {p: [] for p in PARTS})
    timed_calls: float = 0.0  # per step
    error: Optional[str] = None

    def part(self, name: str) -> float:
        """The part's median over rounds, microseconds per step."""
        return statistics.median(self.parts_us[name])


def run_rounds(
    steps: Dict[str, Callable[[], Any]], rounds: int, per_round: int, clock: PartClock
) -> Dict[str, Timing]:
    """``rounds`` rounds of ``per_round`` steps of each contender (after a warm-up),
    in an order that starts one contender further on each round; per round, each
    contender's mean step and its parts' exclusive times, in microseconds."""
    timings = {name: Timing(name) for name in steps}
    for step in steps.values():
        for _ in range(STEADY_CALL):
            step()
    names = list(steps)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step, timing = steps[name], timings[name]
            gc.collect()
            clock.reset()
            start = time.perf_counter_ns()
            for _ in range(per_round):
                step()
            timing.step_us.append((time.perf_counter_ns() - start) / 1000 / per_round)
            for part in PARTS:
                timing.parts_us[part].append(clock.nanos[part] / 1000 / per_round)
            timing.timed_calls = clock.calls / per_round
    return timings


def timer_cost_us() -> float:
    """One timed call's own cost, in microseconds (a wrapped no-op, warm: a floor)."""
    clock = PartClock()
    noop = clock.timed(VALIDATION, lambda: None)
    start = time.perf_counter_ns()
    for _ in range(10_000):
        noop()
    return (time.perf_counter_ns() - start) / 1000 / 10_000


def table(rows: Sequence[Timing], plain: Timing, timer_us: float) -> str:
    """A markdown table: each class's step, what it adds over the plain loop, and
    each part's exclusive time, in microseconds per step (medians over rounds;
    ``added``: of each round's difference from the plain loop)."""
    head = ["class", "step", "added over plain", *PARTS, "rest of added", "timed calls"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    plain_us = statistics.median(plain.step_us)
    for t in rows:
        if t.error is not None:
            lines.append(f"| `{t.name}` | no step on this device: {t.error} |")
            continue
        added = statistics.median(a - b for a, b in zip(t.step_us, plain.step_us, strict=True))
        parts = [t.part(p) for p in PARTS]
        cells = [
            f"`{t.name}`",
            f"{statistics.median(t.step_us):.0f}",
            f"{added:.0f} ({added / plain_us:.1%})",
            *(f"{p:.1f}" for p in parts),
            f"{added - sum(parts):.0f}",
            f"{t.timed_calls:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        f"Microseconds per step; the plain loop's step: {plain_us:.0f}. Medians over "
        f"{len(plain.step_us)} rounds (each round: every contender's steps, back to back). "
        f"A timed call costs about {timer_us:.2f} us of its own (warm; more when cold), "
        "counted in the step and in the part it wraps."
    )
    return "\n".join(lines)


def _option(argv: List[str], flag: str, default: int) -> int:
    """The value after ``flag`` in ``argv`` (taken out of it), else ``default``."""
    if flag not in argv:
        return default
    at = argv.index(flag)
    value = int(argv[at + 1])
    del argv[at : at + 2]
    return value


def main(argv: Sequence[str]) -> None:
    import trec_pipelines

    args = list(argv)
    rounds = _option(args, "--rounds", 21)
    per_round = _option(args, "--steps", 20)
    count = STEADY_CALL + rounds * per_round + 4
    with measuring_world(args, CLASSES) as (prints, names):
        steps: Dict[str, Callable[[], Any]] = {"plain loop": plain_loop(count)}
        failed: List[Timing] = []
        for name in names:
            try:
                steps[name] = build(trec_pipelines, name, batches=count)[1]
            except Exception as error:  # noqa: BLE001 -- a variant may not run on this device
                failed.append(Timing(name, error=f"{error!r:.160}"))
        clock = PartClock()
        classes = [getattr(trec_pipelines, n) for n in steps if n != "plain loop"]
        with timers(clock, classes):
            timings = run_rounds(steps, rounds, per_round, clock)
        if prints:
            rows = [timings.get(n) or next(f for f in failed if f.name == n) for n in names]
            print(table(rows, timings["plain loop"], timer_cost_us()))


if __name__ == "__main__":
    main(sys.argv[1:])
