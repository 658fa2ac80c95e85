"""One contender (the plain loop or one variant) measured for one round, on this rank.

A round of a contender: ``build()`` a fresh model, train ``warmup`` batches
(untimed), then time one epoch of the next ``epoch_steps`` batches -- fill and
drain included, as the bench times an epoch.  Batches that end sooner are
cycled: one pass of them, repeated in the same order (the same objects), as
long as the epoch asks -- the same for every contender, so each trains the
same batches in the same order as the plain loop.  Then, untimed, over the
first ``steps`` of those batches:
in the first round an epoch with the memory ledger on (what the pipeline
holds after every verb; resident and device memory sampled after every
step), and in every round an epoch with the input dist tapped (the training
thread's input-dist time, median over the steady steps; one epoch of it is
noisy, so run.py takes the median over rounds too).  Then everything is
dropped before the next contender is built.

The ranks meet only in the model's own collectives and in the two callbacks
:mod:`trec_pipelines.advise.run` passes (``agree`` after the build,
``barrier`` before the timed epoch); run.py gathers what each rank measured.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Iterable,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Protocol,
    Tuple,
    cast,
)

import torch
from torch import nn

from trec_pipelines.advise.variants import Variant, examples_per_batch, iterable_problem
from trec_pipelines.core.streams import device_module, has_streams, new_stream
from trec_pipelines.observe.memory import DEVICE_BATCH, HOST_BATCH, device_memory, rss_bytes
from trec_pipelines.observe.recorder import Recordable
from trec_pipelines.pipelines.sparse_data_dist_util import SparseDataDistUtil
from trec_pipelines.pipelines.staged import PipelineStage
from trec_pipelines.sparse.input_dist_tap import tap_input_dist

Build = Callable[[], Tuple[nn.Module, Any, Iterable[Any]]]
PLAIN = "plain loop"


class BuildError(Exception):
    """``build()`` raised or returned something advise can't use (the user's to fix, not a variant's failure)."""


@dataclass
class RoundResult:
    """What one rank measured of one contender in one round.

    Attributes:
        seconds: the timed epoch, wall seconds on this rank.
        steps: the steps it made (``progress()`` calls that returned).
        examples_per_step: samples of this rank's first timed batch (None: no KJT in it).
        unpipelined: the sharded modules the variant's rewrite left alone, and why.
        held_peak: the memory ledger's peak bytes (None: the class has no
            ledger, or not the first round).
        held_steady: its steady bytes (None: as ``held_peak``).
        held_host: the ledger's largest bytes in host batches (pulled, not yet
            copied to the device) after any action (None: as ``held_peak``).
        held_device: the same in device batches (None: as ``held_peak``).
        rss_peak: the largest resident memory sampled after a step of the
            measured epochs (None: not the first round, or no ``/proc``).
        device_peak: the device allocator's max allocated bytes over the round
            (None on CPU).
        exposed_input_dist: training-thread input-dist seconds per steady step,
            the median over the steady steps of the tapped epoch (None: no steady step).
        pass_length: batches in one pass of ``build()``'s batches when a pass
            ended before the round had what it asked (they were cycled); None
            when every pass went on past it.
    """

    seconds: float
    steps: int
    examples_per_step: Optional[int] = None
    unpipelined: Tuple[Tuple[str, str], ...] = ()
    held_peak: Optional[int] = None
    held_steady: Optional[int] = None
    held_host: Optional[int] = None
    held_device: Optional[int] = None
    rss_peak: Optional[int] = None
    device_peak: Optional[int] = None
    exposed_input_dist: Optional[float] = None
    pass_length: Optional[int] = None


class Taken(NamedTuple):
    """Batches taken from a pass, cycled if the pass ended first.

    Attributes:
        items: the batches, in order.
        pass_length: the batches in one pass, when the pass ended before
            ``start + count`` (so it was cycled); None otherwise.
    """

    items: List[Any]
    pass_length: Optional[int]


class _Driven(Protocol):
    """What a round uses of a contender's pipeline: ``progress(it)``; besides,
    ``reset()`` and the recording methods
    (:class:`~trec_pipelines.observe.recorder.Recordable`) where it has them
    (a user's own class may lack them)."""

    def progress(self, dataloader_iter: Iterator[Any]) -> Any: ...


@dataclass
class _Built:
    """One contender's objects for a round (``pipeline`` None: the plain loop)."""

    model: nn.Module
    optimizer: Any
    batches: Iterable[Any]
    pipeline: Optional[_Driven] = None
    staged: bool = False  # the pipeline returns batches; the loop trains them
    rewrite: object = (
        None  # what holds the rewrite_result (the pipeline, or Staged's SparseDataDistUtil)
    )
    after_step: List[Callable[[], None]] = field(default_factory=list)


def _train_step(model: nn.Module, optimizer: Any, batch: Any) -> None:
    optimizer.zero_grad()
    losses, _ = model(batch)
    torch.sum(losses, dim=0).backward()
    optimizer.step()


def _make_pipeline(built: _Built, variant: Variant, device: torch.device) -> None:
    """``variant``'s pipeline over ``built``'s model; Staged with the bench's two stages."""
    if not variant.staged:
        built.pipeline = variant.cls(built.model, built.optimizer, device, **variant.kwargs)
        built.rewrite = built.pipeline
        return
    util: SparseDataDistUtil[Any] = SparseDataDistUtil(
        model=built.model, data_dist_stream=new_stream(device)
    )
    stages = [
        PipelineStage(
            name="data_copy",
            runnable=lambda batch: batch.to(device, non_blocking=True),
            stream=new_stream(device),
        ),
        PipelineStage(
            name="start_sparse_data_dist",
            runnable=util.start_sparse_data_dist,
            stream=util.data_dist_stream,
            fill_callback=util.wait_sdd_fill_callback,
        ),
    ]
    built.pipeline = variant.cls(pipeline_stages=stages, **variant.kwargs)
    built.staged, built.rewrite = True, util


def call_build(build: Build) -> Tuple[nn.Module, Any, Iterable[Any]]:
    """``build()``, checked: raises :class:`BuildError` saying what is wrong and what to return."""
    try:
        built = build()
    except Exception as exc:
        raise BuildError(
            f"build() raised {type(exc).__name__}: {exc}. advise calls build() once per variant and round; "
            "it must return (model, optimizer, batches) as you would build them for training"
        ) from exc
    if not isinstance(built, tuple) or len(built) != 3:
        raise BuildError(
            f"build() returned {type(built).__name__}{'' if not isinstance(built, tuple) else f' of {len(built)}'}; "
            "it must return a tuple (model, optimizer, batches)"
        )
    model, optimizer, batches = built
    if not isinstance(model, nn.Module):
        raise BuildError(
            f"build()'s model is a {type(model).__name__}; it must be an nn.Module (a DMP-sharded model)"
        )
    if not (hasattr(optimizer, "step") and hasattr(optimizer, "zero_grad")):
        raise BuildError(
            f"build()'s optimizer is a {type(optimizer).__name__}, with no step()/zero_grad()"
        )
    problem = iterable_problem(batches)
    if problem is not None:
        raise BuildError(problem)
    return model, optimizer, batches


def take(batches: Iterable[Any], start: int, count: int, what: str) -> Taken:
    """Items ``start .. start+count`` of a fresh pass over ``batches``, cycled.

    A pass that ends first is repeated in the same order (its items held, not
    walked again), so item ``k`` is the pass's item ``k % len(pass)``.  A pass
    with no item is a :class:`BuildError`.
    """
    got = list(itertools.islice(iter(batches), start + count))
    if not got:
        raise BuildError(
            f"batches gave 0 of the {count} {what} batches (items {start}..{start + count - 1} of a pass): "
            "advise walks batches several times per build (and cycles a pass that ends early); "
            "return a list or an iterable that restarts on each iter(), with at least one batch"
        )
    if len(got) >= start + count:
        return Taken(got[start:], None)
    return Taken([got[(start + k) % len(got)] for k in range(count)], len(got))


def _run_epoch(built: _Built, batches: List[Any], device: torch.device) -> int:
    """Train ``batches`` once: the plain loop, or ``progress()`` until StopIteration."""
    if built.pipeline is None:
        for batch in batches:
            _train_step(built.model, built.optimizer, batch.to(device, non_blocking=True))
            for hook in built.after_step:
                hook()
        return len(batches)
    if built.staged:
        return _run_staged_epoch(built, batches)
    pipeline = built.pipeline
    it = iter(batches)
    steps = 0
    limit = len(batches) + 8  # a pipeline that never stops is a failure, not a hang
    while True:
        try:
            pipeline.progress(it)
        except StopIteration:
            break
        steps += 1
        for hook in built.after_step:
            hook()
        if steps > limit:
            raise RuntimeError(
                f"{type(pipeline).__name__} did not raise StopIteration after {limit} steps"
            )
    if hasattr(pipeline, "reset"):
        pipeline.reset()  # nothing in flight between epochs (torchrec-style classes need it)
    if steps != len(batches):
        raise RuntimeError(
            f"{type(pipeline).__name__} made {steps} steps over {len(batches)} batches"
        )
    return steps


def _run_staged_epoch(built: _Built, batches: List[Any]) -> int:
    """StagedTrainPipeline: each batch it returns is trained by this loop; None ends the epoch."""
    pipeline = built.pipeline
    assert pipeline is not None  # the plain loop has no pipeline, and is not staged
    it = iter(batches)
    steps = 0
    while steps <= len(batches) + 8:
        batch = pipeline.progress(it)
        if batch is None:
            break
        _train_step(built.model, built.optimizer, batch)
        steps += 1
        for hook in built.after_step:
            hook()
    if steps != len(batches):
        raise RuntimeError(
            f"{type(pipeline).__name__} made {steps} steps over {len(batches)} batches"
        )
    return steps


@contextlib.contextmanager
def _sampling(built: _Built, device: torch.device) -> Iterator[List[Optional[int]]]:
    """Samples resident memory (and the device's allocation) after every step of the block."""
    peaks: List[Optional[int]] = [None, None]

    def sample() -> None:
        rss = rss_bytes()
        if rss is not None:
            peaks[0] = max(peaks[0] or 0, rss)
        dev = device_memory(device)
        if dev is not None:
            peaks[1] = max(peaks[1] or 0, dev.max_allocated)

    built.after_step.append(sample)
    try:
        yield peaks
    finally:
        built.after_step.remove(sample)


def _exposed_per_step(
    intervals: List[Tuple[str, float, float]], call_starts: List[float], end: float
) -> Optional[float]:
    """Median tapped input-dist seconds per steady call.

    Steady: every call after the first (the fill) that issues an input dist,
    as the bench counts them ([Note: the hidden fraction] in benchmarks/measuring/schedule_bound.py).
    """
    windows = [
        (s, call_starts[k + 1] if k + 1 < len(call_starts) else end)
        for k, s in enumerate(call_starts)
    ]
    issues = [start for kind, start, _ in intervals if kind == "issue"]
    steady = [
        (lo, hi)
        for k, (lo, hi) in enumerate(windows)
        if k >= 1 and any(lo <= t < hi for t in issues)
    ]
    if not steady:
        return None
    spans = sorted((start, stop) for _, start, stop in intervals)
    merged: List[List[float]] = []
    for start, stop in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    covered = [sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in merged) for lo, hi in steady]
    return statistics.median(covered)


def _tapped_epoch(built: _Built, batches: List[Any], device: torch.device) -> Optional[float]:
    call_starts: List[float] = []
    built.after_step.insert(0, lambda: call_starts.append(time.perf_counter()))
    try:
        with tap_input_dist(built.model) as tap:
            start = time.perf_counter()
            _run_epoch(built, batches, device)
            end = time.perf_counter()
    finally:
        built.after_step.pop(0)
    # A call starts where the one before it returned.
    starts = [start] + call_starts[:-1]
    return _exposed_per_step(tap.intervals, starts, end)


def measure_round(
    build: Build,
    variant: Optional[Variant],
    device: torch.device,
    warmup: int,
    steps: int,
    detailed: bool,
    barrier: Callable[[], None],
    agree: Callable[[Optional[str]], None],
    epoch_steps: Optional[int] = None,
) -> RoundResult:
    """One round of ``variant`` (None: the plain loop) on this rank; see the module docstring.

    The timed epoch has ``epoch_steps`` batches (default ``steps``), the
    untimed ones ``steps``.

    ``barrier`` meets the other ranks right before the timed epoch, so each
    rank's clock starts together; ``agree`` is called on every rank with this
    rank's build error (or None) and raises :class:`BuildError` on all of them
    if any rank's build failed, before any rank trains (a rank that trained
    alone would wait in the model's collectives).  Raises :class:`BuildError` for what
    ``build()`` did wrong, anything else for the variant's own failure.
    """
    gc.collect()  # nobody pays for the garbage of the contender before
    context = variant.build_context() if variant is not None else contextlib.nullcontext()
    prepared: Any
    try:
        with context:
            model, optimizer, batches = call_build(build)
        # Every pass the round makes, taken now: a short or one-shot iterable
        # fails here, on every rank, before any rank trains.
        taken = [
            take(batches, 0, warmup, "warm-up") if warmup else Taken([], None),
            take(batches, warmup, steps if epoch_steps is None else epoch_steps, "timed"),
            take(batches, warmup, steps, "measured"),
        ]
        warm, timed, measured = (t.items for t in taken)
        lengths = [t.pass_length for t in taken if t.pass_length is not None]
        prepared = (model, optimizer, batches)
    except BuildError as exc:
        prepared = exc
    agree(str(prepared) if isinstance(prepared, BuildError) else None)
    if isinstance(prepared, BuildError):
        raise prepared
    model, optimizer, batches = prepared
    del prepared
    built = _Built(model, optimizer, batches)
    try:
        if has_streams(device) and hasattr(device_module(device), "reset_peak_memory_stats"):
            device_module(device).reset_peak_memory_stats(device)
        if variant is not None:
            _make_pipeline(built, variant, device)
        if warm:
            _run_epoch(built, warm, device)
        result = _timed(built, timed, device, barrier)
        result.pass_length = min(lengths) if lengths else None
        rewrite = getattr(built.rewrite, "rewrite_result", None)
        if rewrite is not None:
            result.unpipelined = tuple(rewrite.not_pipelined)
        result.examples_per_step = examples_per_batch(timed[0])
        if detailed:
            _detail(built, result, measured, device)
        result.exposed_input_dist = _tapped_epoch(built, measured, device)
        return result
    finally:
        pipeline, built.pipeline = built.pipeline, None
        if pipeline is not None and hasattr(pipeline, "reset"):
            with contextlib.suppress(Exception):
                pipeline.reset()
        built.rewrite = None
        del pipeline, built, model, optimizer, batches
        gc.collect()


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU), so the clock sees it."""
    if has_streams(device):
        device_module(device).synchronize(device)


def _timed(
    built: _Built, batches: List[Any], device: torch.device, barrier: Callable[[], None]
) -> RoundResult:
    _synchronize(device)  # the warm-up's kernels are not this epoch's
    barrier()
    start = time.perf_counter()
    made = _run_epoch(built, batches, device)
    _synchronize(device)
    return RoundResult(seconds=time.perf_counter() - start, steps=made)


def _detail(built: _Built, result: RoundResult, batches: List[Any], device: torch.device) -> None:
    """The first round's untimed memory epoch: the ledger, resident and device memory."""
    pipeline = built.pipeline
    # Every pipeline of the package records its schedule; a user's own class may not.
    recording = (
        cast(Recordable, pipeline) if hasattr(pipeline, "enable_schedule_recording") else None
    )
    with _sampling(built, device) as peaks:
        if recording is not None:
            recording.disable_schedule_recording()
            recording.enable_schedule_recording(memory=True)
            try:
                _run_epoch(built, batches, device)
                summary = recording.memory_ledger()
            finally:
                recording.disable_schedule_recording()
            result.held_peak, result.held_steady = summary.peak_bytes, summary.steady_bytes
            result.held_host = summary.max_by_place[HOST_BATCH]
            result.held_device = summary.max_by_place[DEVICE_BATCH]
        else:
            _run_epoch(built, batches, device)
            if pipeline is None:
                result.held_peak = result.held_steady = (
                    0  # the plain loop keeps nothing between steps
                )
                result.held_host = result.held_device = 0
    result.rss_peak, result.device_peak = peaks


def probe(
    model: nn.Module,
    optimizer: Any,
    batches: Iterable[Any],
    device: torch.device,
    warmup: int,
    steps: int,
    barrier: Callable[[], None],
) -> float:
    """Seconds per step of the plain loop on ``model``: ``warmup`` batches untimed, then
    ``steps`` timed (cycled as a round's).  run.py sizes the timed epochs by it."""
    built = _Built(model, optimizer, batches)
    warm = take(batches, 0, warmup, "warm-up").items if warmup else []
    timed = take(batches, warmup, steps, "timed").items
    if warm:
        _run_epoch(built, warm, device)
    result = _timed(built, timed, device, barrier)
    return result.seconds / max(result.steps, 1)


__all__ = [
    "PLAIN",
    "Build",
    "BuildError",
    "RoundResult",
    "Taken",
    "call_build",
    "measure_round",
    "probe",
    "take",
]
