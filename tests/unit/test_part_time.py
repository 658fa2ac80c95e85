"""The part timer's rule (benchmarks.measuring.part_time): each timed call's time goes
to its part, less the time of the timed calls inside it, and the timers come off.

Its microseconds describe a machine and no test holds them; a fake clock that
moves only when told holds the rule.
"""

from __future__ import annotations

from typing import Any, List

from benchmarks.measuring import part_time
from benchmarks.measuring.part_time import GUARD, SOURCE, VALIDATION, PartClock, timers
from trec_pipelines.data import source


class _Clock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def test_a_part_inside_another_is_taken_out_of_the_outer_one() -> None:
    clock = _Clock()
    parts = PartClock(clock)

    def check() -> None:
        clock.now += 30  # the inner part's own time

    timed_check = parts.timed(VALIDATION, check)

    def pull() -> None:
        clock.now += 5
        timed_check()
        clock.now += 7

    parts.timed(SOURCE, pull)()
    assert parts.nanos[VALIDATION] == 30
    assert parts.nanos[SOURCE] == 12  # 42 in all, less the check's 30
    assert parts.calls == 2


def test_a_part_that_raises_is_timed_and_its_caller_goes_on() -> None:
    clock = _Clock()
    parts = PartClock(clock)

    def fails() -> None:
        clock.now += 4
        raise ValueError("bad batch")

    timed_fails = parts.timed(VALIDATION, fails)
    seen: List[str] = []

    def outer() -> None:
        try:
            timed_fails()
        except ValueError as error:
            seen.append(str(error))
        clock.now += 1

    parts.timed(GUARD, outer)()
    assert seen == ["bad batch"]
    assert (parts.nanos[VALIDATION], parts.nanos[GUARD]) == (4, 1)
    parts.reset()
    assert set(parts.nanos.values()) == {0} and parts.calls == 0


def test_the_timers_are_on_inside_the_block_only() -> None:
    before = [(owner, name, vars(owner)[name]) for owner, name, _ in part_time._entries()]
    seen: Any = None
    parts = PartClock()
    with timers(parts, []):
        seen = source.batch_problem
        assert source.batch_problem([]) is None  # a batch with no KJT: nothing to check
    assert seen is not before[0][2]
    assert parts.calls == 1 and parts.nanos[VALIDATION] > 0
    assert [(o, n, vars(o)[n]) for o, n, _ in part_time._entries()] == before


def test_the_guard_and_the_progress_it_wraps_are_timed_apart_and_put_back() -> None:
    from trec_pipelines import (
        TrainPipelineBase,
        TrainPipelineSparseDist,
        TrainPipelineSparseDistLite,
    )

    classes = [TrainPipelineBase, TrainPipelineSparseDist, TrainPipelineSparseDistLite]
    guards = {cls: cls.progress for cls in classes}  # type: ignore[attr-defined]

    def inner_of(cls: type) -> Any:
        """The ``progress`` the class's step guard calls."""
        guard = guards[cls]
        cells = dict(zip(guard.__code__.co_freevars, guard.__closure__, strict=True))
        return cells["progress"].cell_contents

    own = {cls: vars(cls).get("progress") for cls in classes}
    inner = {cls: inner_of(cls) for cls in classes}
    with timers(PartClock(), classes):
        for cls in classes:
            # The guard's wrapper calls a timed progress, and the class's progress is
            # the timed guard (Lite's, inherited from SparseDist, through it).
            assert inner_of(cls) is not inner[cls], cls
            assert cls.progress is not guards[cls], cls  # type: ignore[attr-defined]
    assert {cls: vars(cls).get("progress") for cls in classes} == own
    assert {cls: inner_of(cls) for cls in classes} == inner
