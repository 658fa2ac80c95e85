"""The exact order of work of each variant, from the schedule recorder."""

from __future__ import annotations

from typing import Any, Callable, List

import pytest

from tests.unit.fakes import TinyModel, base_pipeline, drain, make_batches, sparse_dist_pipeline


def recorded(make: Callable[..., Any], n_batches: int, **kwargs: Any) -> List[str]:
    pipeline = make(TinyModel(), **kwargs)
    pipeline.enable_schedule_recording()
    drain(pipeline, iter(make_batches(n_batches)))
    return [str(action) for action in pipeline.schedule_actions]


def steady(call: int, i: int, *middle: str) -> List[str]:
    return [s.format(P=call, i=i, n=i + 1, m=i + 2) for s in middle]


BASE_STEP = (
    "P{P} ZeroGrad[i{i}]@default",
    "P{P} WaitBatch[i{i}]@default",
    "P{P} Forward[i{i}]@default",
    "P{P} H2D[i{n}]@memcpy",
    "P{P} Backward[i{i}]@default",
    "P{P} OptimizerStep[i{i}]@default",
)


def test_base_fill_steady_drain() -> None:
    expected = ["P0 H2D[i0]@memcpy"]
    for i in range(3):
        expected += steady(i, i, *BASE_STEP)
    # last batch: nothing left to copy
    expected += [a for a in steady(3, 3, *BASE_STEP) if "H2D" not in a]
    assert recorded(base_pipeline, 4) == expected


SPARSE_DIST_STEP = (
    "P{P} ZeroGrad[i{i}]@default",
    "P{P} WaitBatch[i{i}]@default",
    "P{P} InputDistStart[i{n}]@data_dist",
    "P{P} H2D[i{m}]@memcpy",
    "P{P} Forward[i{i}]@default",
    "P{P} InputDistWait[i{n}]@data_dist",
    "P{P} Backward[i{i}]@default",
    "P{P} OptimizerStep[i{i}]@default",
)

SPARSE_DIST_FILL = [
    "P0 H2D[i0]@memcpy",
    "P0 InputDistStart[i0]@data_dist",
    "P0 InputDistWait[i0]@data_dist",
    "P0 H2D[i1]@memcpy",
]


def test_sparse_dist_fill_steady_drain() -> None:
    expected = list(SPARSE_DIST_FILL)
    for i in range(3):
        expected += steady(i, i, *SPARSE_DIST_STEP)
    # batch 3 was the last: no copy of i5 at P3 ...
    expected += [a for a in steady(3, 3, *SPARSE_DIST_STEP) if "H2D" not in a]
    # ... and at P4 nothing is left to start or copy.
    expected += [a for a in steady(4, 4, *SPARSE_DIST_STEP) if "[i4]" in a]
    assert recorded(sparse_dist_pipeline, 5) == expected


def test_sparse_dist_enqueue_after_forward_moves_only_the_copy() -> None:
    step = list(SPARSE_DIST_STEP)
    step.remove("P{P} H2D[i{m}]@memcpy")
    step.insert(step.index("P{P} Forward[i{i}]@default") + 1, "P{P} H2D[i{m}]@memcpy")
    actions = recorded(sparse_dist_pipeline, 6, enqueue_batch_after_forward=True)
    assert actions[len(SPARSE_DIST_FILL) : len(SPARSE_DIST_FILL) + len(step)] == steady(0, 0, *step)


@pytest.mark.parametrize("n", [0, 1, 2])
def test_sparse_dist_short_loaders(n: int) -> None:
    actions = recorded(sparse_dist_pipeline, n)
    forwards = [a for a in actions if "Forward" in a]
    assert forwards == [f"P{i} Forward[i{i}]@default" for i in range(n)]
    if n == 0:
        assert actions == []
    if n == 1:
        assert actions == SPARSE_DIST_FILL[:3] + [
            "P0 ZeroGrad[i0]@default",
            "P0 WaitBatch[i0]@default",
            "P0 Forward[i0]@default",
            "P0 Backward[i0]@default",
            "P0 OptimizerStep[i0]@default",
        ]


def test_recording_off_by_default() -> None:
    pipeline = sparse_dist_pipeline(TinyModel())
    drain(pipeline, iter(make_batches(3)))
    assert pipeline.schedule_actions == []
