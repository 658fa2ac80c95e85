"""TrainPipelineSparseDistLite and EvalPipelineSparseDist on the fake model.

Exact recorded schedules (fill, steady state, drain), short loaders, epochs,
and Eval's loading, inline (the default on CPU) and on its loader thread
(``loader_thread=True``): errors, shutdown, no batch lost or duplicated.
"""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref
from typing import Any, Iterable, List

import pytest
import torch
from torch import nn

from tests.unit.fakes import (
    TinyModel,
    assert_same_training,
    drain,
    make_batches,
    optimizer_for,
    plain_loop,
)
from tests.unit.test_loaders import Refillable
from trec_pipelines import EvalPipelineSparseDist, TrainPipelineSparseDistLite
from trec_pipelines.pipelines.eval_sparse_dist import LOADER_THREAD_NAME

CPU = torch.device("cpu")


def lite_pipeline(model: nn.Module, **kwargs: Any) -> TrainPipelineSparseDistLite:
    return TrainPipelineSparseDistLite(model, optimizer_for(model), CPU, **kwargs)


def eval_pipeline(model: nn.Module, **kwargs: Any) -> EvalPipelineSparseDist:
    model.eval()
    return EvalPipelineSparseDist(model, None, CPU, **kwargs)


def threaded_eval(model: nn.Module, **kwargs: Any) -> EvalPipelineSparseDist:
    """An Eval pipeline with its loader thread, which CPU does not start by default."""
    return eval_pipeline(model, loader_thread=True, **kwargs)


def loader_threads(besides: Iterable[threading.Thread] = ()) -> List[threading.Thread]:
    """The live threads of Eval pipelines' loaders, other than ``besides`` (an
    earlier test's, still ending)."""
    old = set(besides)
    return [t for t in threading.enumerate() if t.name == LOADER_THREAD_NAME and t not in old]


# Eval's loading modes: the default (inline on CPU) and a loader thread.
LOADING = pytest.mark.parametrize("loader_thread", [None, True], ids=["inline", "thread"])


def plain_eval(model: nn.Module, batches: List[Any]) -> List[Any]:
    """The Eval oracle: eval mode, one no_grad forward per batch."""
    model.eval()
    outputs = []
    with torch.no_grad():
        for batch in batches:
            output = model(batch)
            outputs.append(output[1] if isinstance(output, tuple) else output)
    return outputs


def recorded(pipeline: Any, n_batches: int) -> List[str]:
    pipeline.enable_schedule_recording()
    drain(pipeline, iter(make_batches(n_batches)))
    return [str(action) for action in pipeline.schedule_actions]


def steady(call: int, i: int, *step: str) -> List[str]:
    return [s.format(P=call, i=i, n=i + 1) for s in step]


def sums(batches: List[Any]) -> List[int]:
    return [int(b.sparse.values().sum()) for b in batches]


def calls(model: TinyModel, kind: str) -> List[int]:
    """The batches (by id sum) the fake sharded module ran ``kind`` on, in order."""
    return [s for k, s in model.log if k == kind]


# ------------------------------------------------------------------ Lite

LITE_STEP = (
    "P{P} ZeroGrad[i{i}]@default",
    "P{P} WaitBatch[i{i}]@default",
    "P{P} InputDistStart[i{i}]@default",
    "P{P} InputDistWait[i{i}]@default",
    "P{P} Forward[i{i}]@default",
    "P{P} Backward[i{i}]@default",
    "P{P} H2D[i{n}]@memcpy",  # between backward and step, as upstream
    "P{P} OptimizerStep[i{i}]@default",
)


def test_lite_fill_steady_drain() -> None:
    pipeline = lite_pipeline(TinyModel())
    expected = ["P0 H2D[i0]@memcpy"]
    for i in range(3):
        expected += steady(i, i, *LITE_STEP)
    expected += [a for a in steady(3, 3, *LITE_STEP) if "H2D" not in a]  # nothing left to copy
    assert recorded(pipeline, 4) == expected
    assert {a.thread for a in pipeline.schedule_actions} == {"main"}


def test_lite_in_eval_mode_skips_training_verbs_only() -> None:
    model = TinyModel()
    model.eval()
    step = [a for a in LITE_STEP if not any(t in a for t in ("ZeroGrad", "Backward", "Optimizer"))]
    expected = ["P0 H2D[i0]@memcpy"] + steady(0, 0, *step) + steady(1, 1, *step)[:-1]  # no i2
    assert recorded(lite_pipeline(model), 2) == expected


# ------------------------------------------------------------------ Eval

EVAL_FILL = [
    "P0 H2D[i0]@memcpy",
    "P0 InputDistStart[i0]@data_dist",
    "P0 InputDistWait[i0]@data_dist",
]

EVAL_STEP = (
    "P{P} H2D[i{n}]@memcpy",  # copied inline, or taken from the loader thread
    "P{P} WaitBatch[i{i}]@default",
    "P{P} InputDistStart[i{n}]@data_dist",
    "P{P} Forward[i{i}]@default",
    "P{P} InputDistWait[i{n}]@data_dist",
)


@LOADING
def test_eval_fill_steady_drain(loader_thread: Any) -> None:
    pipeline = eval_pipeline(TinyModel(), loader_thread=loader_thread)
    expected = list(EVAL_FILL)
    for i in range(3):
        expected += steady(i, i, *EVAL_STEP)
    expected += ["P3 WaitBatch[i3]@default", "P3 Forward[i3]@default"]
    assert recorded(pipeline, 4) == expected  # the same in both modes
    threads = [(a.task, a.thread) for a in pipeline.schedule_actions]
    if loader_thread:
        assert all((thread == "loader") == (task == "H2D") for task, thread in threads)
    else:
        assert {thread for _, thread in threads} == {"main"}


# ---------------------------------------------------- short loaders, both


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_lite_short_loaders_train_exactly_those_batches(n: int) -> None:
    batches = make_batches(n)
    model, ref = TinyModel(), TinyModel()
    pipeline = lite_pipeline(model)
    pipeline.enable_schedule_recording()
    outputs = drain(pipeline, iter(batches))
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)
    assert calls(model, "compute") == sums(batches)
    actions = [str(a) for a in pipeline.schedule_actions]
    assert [a for a in actions if "Forward" in a] == [
        f"P{i} Forward[i{i}]@default" for i in range(n)
    ]
    if n == 0:
        assert actions == []
    if n == 1:
        assert actions == ["P0 H2D[i0]@memcpy"] + [
            a for a in steady(0, 0, *LITE_STEP) if "H2D" not in a
        ]


@LOADING
@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_eval_short_loaders_run_exactly_those_batches(n: int, loader_thread: Any) -> None:
    batches = make_batches(n)
    model, ref = TinyModel(), TinyModel()
    pipeline = eval_pipeline(model, loader_thread=loader_thread)
    pipeline.enable_schedule_recording()
    outputs = drain(pipeline, iter(batches))
    assert_same_training(outputs, plain_eval(ref, batches), model, TinyModel())  # weights unchanged
    # input_dist once per batch (upstream starts the first one twice), compute in order
    assert calls(model, "input_dist") == calls(model, "compute") == sums(batches)
    actions = [str(a) for a in pipeline.schedule_actions]
    assert [a for a in actions if "Forward" in a] == [
        f"P{i} Forward[i{i}]@default" for i in range(n)
    ]
    if n == 0:
        assert actions == []
    if n == 1:
        assert actions == EVAL_FILL + ["P0 WaitBatch[i0]@default", "P0 Forward[i0]@default"]
    assert pipeline._loader is None  # the loader (thread) was stopped with the epoch


# ------------------------------------------------------------ epochs, both


@pytest.mark.parametrize("kind", ["lite", "eval", "eval-thread"])
def test_new_iterator_and_refilled_iterator_start_new_epochs(kind: str) -> None:
    batches = make_batches(3)
    model, ref = TinyModel(), TinyModel()
    if kind == "lite":
        pipeline: Any = lite_pipeline(model)
    else:
        pipeline = eval_pipeline(model, loader_thread=kind == "eval-thread")
    loader = Refillable(batches)
    outputs = drain(pipeline, iter(batches)) + drain(pipeline, loader)
    loader.refill()
    outputs += drain(pipeline, loader)
    assert loader.next_calls_after_end == 0, "next() called again after StopIteration"
    if kind == "lite":
        assert_same_training(outputs, plain_loop(ref, batches * 3), model, ref)
    else:
        assert_same_training(outputs, plain_eval(ref, batches * 3), model, ref)


def test_lite_detach_attach_mid_epoch() -> None:
    batches = make_batches(5)
    model, ref = TinyModel(), TinyModel()
    pipeline = lite_pipeline(model)
    it = iter(batches)
    outputs = [pipeline.progress(it) for _ in range(2)]
    pipeline.detach()
    pipeline.attach()
    outputs += drain(pipeline, it)
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, batch: Any) -> Any:
        return self.inner(batch)


def test_lite_attach_new_model_rewrites_on_next_input_dist() -> None:
    batches = make_batches(5)
    model, ref = TinyModel(), TinyModel()
    pipeline = lite_pipeline(model)
    it = iter(batches)
    outputs = [pipeline.progress(it) for _ in range(2)]
    pipeline.attach(Wrapper(model))  # same parameters, so the same optimizer still fits
    assert pipeline.rewrite_result is None  # no in-flight input_dist: deferred to progress()
    outputs += drain(pipeline, it)
    assert pipeline.rewrite_result is not None and pipeline.rewrite_result.names == ["inner.sparse"]
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)


def test_lite_needs_an_optimizer_eval_does_not() -> None:
    with pytest.raises(ValueError, match="optimizer"):
        TrainPipelineSparseDistLite(TinyModel(), None, CPU)  # type: ignore[arg-type]
    EvalPipelineSparseDist(TinyModel(), None, CPU)


# ------------------------------------------------------- Eval: the model


class PredictionsOnly(TinyModel):
    """Returns only the logits, not detached."""

    def forward(self, batch: Any) -> Any:  # type: ignore[override]
        x = torch.cat([self.sparse(batch.sparse).values(), self.dense(batch.dense)], dim=1)
        return self.over(x).squeeze(1)


class DictOutput(TinyModel):
    def forward(self, batch: Any) -> Any:  # type: ignore[override]
        loss, pred = super().forward(batch)
        return {"loss": loss, "pred": pred}


def test_eval_returns_predictions_of_a_predictions_only_model_under_no_grad() -> None:
    batches = make_batches(3)
    model, ref = PredictionsOnly(), PredictionsOnly()
    outputs = drain(eval_pipeline(model), iter(batches))
    expected = plain_eval(ref, batches)
    assert len(outputs) == 3
    for got, want in zip(outputs, expected, strict=True):
        assert torch.equal(got, want)
        assert not got.requires_grad  # no_grad: no graph was built
    assert all(p.grad is None for p in model.parameters())


def test_eval_returns_other_outputs_as_they_are() -> None:
    batches = make_batches(2)
    outputs = drain(eval_pipeline(DictOutput()), iter(batches))
    assert [sorted(o) for o in outputs] == [["loss", "pred"]] * 2


def test_eval_leaves_the_model_mode_alone() -> None:
    model = TinyModel()
    pipeline = EvalPipelineSparseDist(model, None, CPU)
    assert model.training
    drain(pipeline, iter(make_batches(2)))
    assert model.training


# ----------------------------------------------- Eval: where it loads


class Watching:
    """Yields ``batches``, noting at each next() the loader threads alive then."""

    def __init__(self, batches: List[Any]) -> None:
        self._it = iter(batches)
        self._before = loader_threads()
        self.seen: List[List[str]] = []

    def __iter__(self) -> "Watching":
        return self

    def __next__(self) -> Any:
        self.seen.append([t.name for t in loader_threads(self._before)])
        return next(self._it)


def test_eval_on_cpu_loads_inline_by_default() -> None:
    batches = make_batches(5)
    model, ref = TinyModel(), TinyModel()
    pipeline = eval_pipeline(model)
    before = loader_threads()
    loader = Watching(batches)
    outputs = []
    while True:
        assert loader_threads(before) == [], "a loader thread runs during the epoch"
        try:
            outputs.append(pipeline.progress(loader))
        except StopIteration:
            break
    assert loader.seen == [[]] * (len(batches) + 1)  # every next(), the end's included
    assert_same_training(outputs, plain_eval(ref, batches), model, ref)
    assert calls(model, "compute") == sums(batches)


def test_eval_loader_thread_true_on_cpu_starts_the_thread() -> None:
    batches = make_batches(5)
    model, ref = TinyModel(), TinyModel()
    pipeline = threaded_eval(model)
    before = loader_threads()
    loader = Watching(batches)
    outputs = [pipeline.progress(loader)]
    assert [t.name for t in loader_threads(before)] == [LOADER_THREAD_NAME]
    outputs += drain(pipeline, loader)
    assert loader.seen == [[LOADER_THREAD_NAME]] * (len(batches) + 1)  # next() on the thread
    assert loader_threads(before) == []  # joined at the end of the data
    assert_same_training(outputs, plain_eval(ref, batches), model, ref)
    assert calls(model, "compute") == sums(batches)


@pytest.mark.parametrize("value", [1, 0, "yes", "thread"])
def test_eval_refuses_a_loader_thread_that_is_not_a_bool(value: Any) -> None:
    with pytest.raises(TypeError, match="loader_thread must be None.*True or False"):
        EvalPipelineSparseDist(TinyModel(), None, CPU, loader_thread=value)


# ----------------------------------------------- Eval: the loader thread


class Failing:
    """Yields ``batches`` then raises ``error`` (once; a broken loader)."""

    def __init__(self, batches: List[Any], error: Exception) -> None:
        self._it = iter(batches)
        self.error = error

    def __iter__(self) -> "Failing":
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            raise self.error from None


@LOADING
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_eval_iterator_error_reaches_caller_and_no_batch_is_lost(
    k: int, loader_thread: Any
) -> None:
    batches = make_batches(k)
    model, ref = TinyModel(), TinyModel()
    pipeline = eval_pipeline(model, loader_thread=loader_thread)
    loader = Failing(batches, ValueError("broken shard"))
    outputs, errors = [], []
    for _ in range(10):
        try:
            outputs.append(pipeline.progress(loader))
        except ValueError as error:
            errors.append(error)
            if loader_thread:
                thread = pipeline._loader._thread  # type: ignore[union-attr]
                assert not thread.is_alive()
        except StopIteration:
            break
    assert errors == [loader.error]  # the iterator's own exception, exactly once
    assert len(outputs) == k
    for got, want in zip(outputs, plain_eval(ref, batches), strict=True):
        assert torch.equal(got, want)
    assert calls(model, "compute") == sums(batches)


@LOADING
def test_eval_bad_batch_error_is_raised_by_progress(loader_thread: Any) -> None:
    pipeline = eval_pipeline(TinyModel(), loader_thread=loader_thread)
    with pytest.raises(TypeError, match="Pipelineable"):
        pipeline.progress(iter([{"dense": torch.zeros(2)}]))


def test_eval_thread_ends_with_the_data() -> None:
    pipeline = threaded_eval(TinyModel())
    it = iter(make_batches(3))
    pipeline.progress(it)
    thread = pipeline._loader._thread  # type: ignore[union-attr]
    assert thread.is_alive()
    drain(pipeline, it)
    assert not thread.is_alive() and pipeline._loader is None


@LOADING
def test_eval_reset_stops_the_loader_and_the_next_epoch_is_whole(loader_thread: Any) -> None:
    batches = make_batches(5)
    model, ref = TinyModel(), TinyModel()
    pipeline = eval_pipeline(model, loader_thread=loader_thread)
    it = iter(batches)
    before = loader_threads()
    first = [pipeline.progress(it) for _ in range(2)]
    threads = loader_threads(before)
    assert len(threads) == (1 if loader_thread else 0)
    pipeline.reset()
    assert not any(t.is_alive() for t in threads) and not pipeline.batches
    assert pipeline._loader is None
    second = drain(pipeline, iter(batches))
    expected = plain_eval(ref, batches)
    assert_same_training(first + second, expected[:2] + expected, model, ref)


class Blocking:
    """Yields batches; the ``block_at``-th next() waits for ``release``."""

    def __init__(self, batches: List[Any], block_at: int) -> None:
        self._batches = batches
        self._block_at = block_at
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def __iter__(self) -> "Blocking":
        return self

    def __next__(self) -> Any:
        self.calls += 1
        if self.calls == self._block_at + 1:
            self.entered.set()
            assert self.release.wait(10)
        if self.calls > len(self._batches):
            raise StopIteration
        return self._batches[self.calls - 1]


def test_eval_reset_waits_for_a_next_under_way_then_never_calls_it_again() -> None:
    loader = Blocking(make_batches(6), block_at=2)
    pipeline = threaded_eval(TinyModel())
    pipeline.progress(loader)  # took i0 and i1; the thread is now inside next() for i2
    assert loader.entered.wait(10)
    resetting = threading.Thread(target=pipeline.reset)
    resetting.start()
    resetting.join(0.2)
    assert resetting.is_alive(), "reset() returned while the loader was inside next()"
    loader.release.set()
    resetting.join(10)
    assert not resetting.is_alive()
    calls = loader.calls
    time.sleep(0.05)
    assert loader.calls == calls == 3


def test_eval_collecting_the_pipeline_stops_its_thread() -> None:
    pipeline = threaded_eval(TinyModel())
    pipeline.progress(iter(make_batches(6)))
    thread = pipeline._loader._thread  # type: ignore[union-attr]
    alive = weakref.ref(pipeline)
    del pipeline
    gc.collect()
    assert alive() is None, "the loader thread keeps the pipeline alive"
    thread.join(10)
    assert not thread.is_alive()


class Jittery:
    """An iterator whose next() takes a random time, so hand-overs race."""

    def __init__(self, batches: List[Any], seed: int) -> None:
        self._it = iter(batches)
        self._rng = random.Random(seed)

    def __iter__(self) -> "Jittery":
        return self

    def __next__(self) -> Any:
        time.sleep(self._rng.choice([0.0, 0.0, 0.001, 0.005]))
        return next(self._it)


@pytest.mark.parametrize("seed", range(5))
def test_eval_every_batch_exactly_once_whatever_the_timing(seed: int) -> None:
    batches = make_batches(8, seed=seed + 10)
    model, ref = TinyModel(), TinyModel()
    pipeline = threaded_eval(model)
    pipeline.enable_schedule_recording()
    rng = random.Random(seed)
    outputs = []
    it = Jittery(batches, seed)
    while True:
        time.sleep(rng.choice([0.0, 0.002]))  # the consumer is slow now and then too
        try:
            outputs.append(pipeline.progress(it))
        except StopIteration:
            break
    assert_same_training(outputs, plain_eval(ref, batches), model, ref)
    assert calls(model, "compute") == sums(batches)
    expected = list(EVAL_FILL)
    for i in range(7):
        expected += steady(i, i, *EVAL_STEP)
    expected += ["P7 WaitBatch[i7]@default", "P7 Forward[i7]@default"]
    assert [str(a) for a in pipeline.schedule_actions] == expected  # the same on every run


@LOADING
def test_eval_refuses_a_new_iterator_mid_epoch_and_loses_nothing(loader_thread: Any) -> None:
    """In both modes, so a program behaves the same on every device."""
    batches = make_batches(4)
    model, ref = TinyModel(), TinyModel()
    pipeline = eval_pipeline(model, loader_thread=loader_thread)
    it = iter(batches)
    outputs = [pipeline.progress(it)]
    with pytest.raises(RuntimeError, match="different iterator.*reset"):
        pipeline.progress(iter(make_batches(4, seed=99)))
    outputs += drain(pipeline, it)
    assert_same_training(outputs, plain_eval(ref, batches), model, ref)
