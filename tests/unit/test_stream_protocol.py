"""Every variant's stream protocol, checked on a recording stand-in for a GPU.

Each pipeline runs a few steps (fill, steady state, drain) inside a
:class:`~trec_pipelines.testing.StreamRecorder`: its side streams are real
objects of a stand-in device, every kernel is attributed to the stream it was
issued on, and the checker replays the record as a GPU would order it (see
``[Note: stream protocol]`` and :mod:`trec_pipelines.testing.stream_checker`).
Then the same pipelines with one wait, ``record_stream`` or event removed
must fail with a message naming the tensor, the streams and the step.

The stand-in model (built on :mod:`tests.unit.fakes`) is stricter than the
plain fake in three ways, each giving the checker something real to see:

* its input_dist hands back *new* tensors, allocated where the tensors
  all-to-all is waited on (as a real all-to-all's output buffers), and its
  sharding context holds a tensor made by input_dist and read by the lookup;
* its forward reads the dense features before calling the sharded module, so
  the batch hand-off of ``WaitBatch`` is needed on its own;
* for the Fused/SemiSync family its table is updated inside the backward
  (like the fused TBE optimizer) rather than by the dense optimizer, and for
  the Prefetch family ``prefetch()`` writes a cache that the lookup reads.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple
from unittest import mock

import pytest
import torch
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Multistreamable

from tests.unit import (
    test_schedule,
    test_schedule_fused,
    test_schedule_lite_eval,
    test_schedule_pec,
    test_schedule_prefetch,
    test_schedule_semi_sync,
)
from tests.unit.fakes import (
    ROWS,
    Batch,
    FakeShardedEBC,
    TinyModel,
    drain,
    make_batches,
    optimizer_for,
    plain_loop,
)
from tests.unit.test_schedule_spec import SPECS
from trec_pipelines.core import streams
from trec_pipelines.core.streams import copy_to_device, wait_for_batch
from trec_pipelines.data.inplace_copy import WORKER_THREAD
from trec_pipelines.observe import recorder as rec
from trec_pipelines.pipelines import base as base_module, sparse_dist as sparse_dist_module
from trec_pipelines.pipelines.base import TrainPipelineBase
from trec_pipelines.pipelines.comp_autograd import TrainPipelineSparseDistCompAutograd
from trec_pipelines.pipelines.eval_fused_sparse_dist import EvalPipelineFusedSparseDist
from trec_pipelines.pipelines.eval_sparse_dist import LOADER_THREAD_NAME, EvalPipelineSparseDist
from trec_pipelines.pipelines.fused_sparse_dist import TrainPipelineFusedSparseDist
from trec_pipelines.pipelines.pec import TrainPipelinePEC
from trec_pipelines.pipelines.prefetch import PrefetchTrainPipelineSparseDist
from trec_pipelines.pipelines.prefetch_ems import TrainPipelinePrefetchEMS
from trec_pipelines.pipelines.pt2 import TorchCompileConfig, TrainPipelinePT2
from trec_pipelines.pipelines.semi_sync import TrainPipelineSemiSync
from trec_pipelines.pipelines.sparse_data_dist_util import SparseDataDistUtil
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist
from trec_pipelines.pipelines.sparse_dist_lite import TrainPipelineSparseDistLite
from trec_pipelines.pipelines.sparse_dist_t import TrainPipelineSparseDistT
from trec_pipelines.pipelines.staged import PipelineStage, StagedTrainPipeline
from trec_pipelines.pipelines.stash import TrainPipelineSparseDistEmbStash
from trec_pipelines.pipelines.train_eval_hybrid import TrainEvalHybridPipelineBase
from trec_pipelines.sparse import (
    cache_prefetch as prefetch_module,
    forwards as forwards_module,
    lookup as lookup_module,
)
from trec_pipelines.sparse.stashing import Stashing
from trec_pipelines.testing import (
    StreamProtocolError,
    StreamRecorder,
    Violation,
    check_schedule,
    check_stream_protocol,
    summarize,
)
from trec_pipelines.testing.stream_recorder import OpRecord

CPU = torch.device("cpu")
N_BATCHES = 5

# ------------------------------------------------------------ stand-ins


class _TensorsAllToAll(Awaitable[KeyedJaggedTensor]):
    def __init__(self, received: KeyedJaggedTensor) -> None:
        super().__init__()
        self._received = received

    def _wait_impl(self) -> KeyedJaggedTensor:
        return self._received


class _SplitsAllToAll(Awaitable[_TensorsAllToAll]):
    """Waiting for the splits launches the tensors all-to-all on the current stream."""

    def __init__(self, features: KeyedJaggedTensor) -> None:
        super().__init__()
        self._features = features

    def _wait_impl(self) -> _TensorsAllToAll:
        sent = self._features
        # The received ids land in new buffers, allocated on this stream.
        received = KeyedJaggedTensor(
            keys=sent.keys(), values=sent.values().clone(), lengths=sent.lengths().clone()
        )
        return _TensorsAllToAll(received)


class _Context(Multistreamable):
    """A sharding context holding a tensor, as real ones do (batch sizes per rank, ...)."""

    def __init__(self) -> None:
        self.lengths: Optional[torch.Tensor] = None

    def record_stream(self, stream: torch.Stream) -> None:
        if self.lengths is not None:
            self.lengths.record_stream(stream)


class AllToAllEBC(FakeShardedEBC):
    """The fake sharded module, with an input_dist whose output is new memory."""

    def create_context(self) -> _Context:  # type: ignore[override]
        return _Context()

    def input_dist(  # type: ignore[override]
        self, ctx: _Context, features: KeyedJaggedTensor
    ) -> Awaitable[Any]:
        self.log.append(("input_dist", int(features.values().sum())))
        ctx.lengths = features.lengths().clone()  # made where input_dist runs
        return _SplitsAllToAll(features)

    def compute(  # type: ignore[override]
        self, ctx: _Context, dist_input: KeyedJaggedTensor
    ) -> torch.Tensor:
        assert ctx.lengths is not None
        ctx.lengths.sum()  # read where the lookup runs
        return super().compute(ctx, dist_input)


class CachingEBC(AllToAllEBC):
    """``prefetch()`` marks the batch's rows in a cache that the lookup then reads."""

    def __init__(self, log: List[Tuple[str, int]]) -> None:
        super().__init__(log)
        self.register_buffer("cache", torch.zeros(ROWS))
        self.cached: Optional[torch.Tensor] = None

    def prefetch(
        self, dist_input: Any, forward_stream: Optional[Any] = None, ctx: Optional[Any] = None
    ) -> None:
        self.cache.index_fill_(0, dist_input.values(), 1.0)

    def compute(self, ctx: Any, dist_input: KeyedJaggedTensor) -> torch.Tensor:  # type: ignore[override]
        self.cached = self.cache.index_select(0, dist_input.values())
        return super().compute(ctx, dist_input)


class StandIn(TinyModel):
    """TinyModel on :class:`AllToAllEBC`, reading its dense features before the sharded module."""

    def __init__(
        self, ebc: Callable[[List[Tuple[str, int]]], FakeShardedEBC] = AllToAllEBC
    ) -> None:
        super().__init__()
        self.sparse = ebc(self.log)

    def forward(self, batch: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        dense = self.dense(batch.dense)
        embedded = self.sparse(batch.sparse).values()
        logits = self.over(torch.cat([embedded, dense], dim=1)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, batch.labels, reduction="none"
        )
        return loss, logits.detach()


def caching_model() -> StandIn:
    return StandIn(ebc=CachingEBC)


class CacheReadingEBC(CachingEBC):
    """Its input dist reads the cache state the prefetch writes, as a caching
    module's can (torchrec PR #4191): the next batch's input dist must wait for
    the prefetch before it."""

    def input_dist(  # type: ignore[override]
        self, ctx: _Context, features: KeyedJaggedTensor
    ) -> Awaitable[Any]:
        self.cache.index_select(0, features.values())  # which rows are cached already
        return super().input_dist(ctx, features)


def cache_reading_model() -> StandIn:
    return StandIn(ebc=CacheReadingEBC)


def table_updated_in_backward(model: StandIn, lr: float = 0.1) -> torch.optim.Optimizer:
    """Update the table inside the backward, like the fused TBE optimizer; return the dense optimizer."""
    weight = model.sparse.bag.weight

    def update(param: torch.Tensor) -> None:
        with torch.no_grad():
            param.add_(param.grad, alpha=-lr)
        param.grad = None

    weight.register_post_accumulate_grad_hook(update)
    return torch.optim.SGD([p for n, p in model.named_parameters() if "bag" not in n], lr=lr)


# ---------------------------------------------------- expected schedules
#
# The exact recorded sequences come from each variant's schedule tests:
# fill, then one step template per progress() call, with the actions on
# batches the loader never yielded left out (the drain).


def _batch_of(action: str) -> int:
    match = re.search(r"\[i(\d+)\]", action)
    assert match is not None, action
    return int(match.group(1))


def exact(fill: Sequence[str], steps: Callable[[int], Sequence[str]], n: int) -> List[str]:
    actions = list(fill)
    for i in range(n):
        actions += [s.format(P=i, i=i, n=i + 1, m=i + 2, t=i + 3) for s in steps(i)]
    return [a for a in actions if _batch_of(a) < n]


def every(step: Sequence[str]) -> Callable[[int], Sequence[str]]:
    return lambda i: step


def from_spec(name: str) -> Tuple[str, ...]:
    """A step template from the reference steady state (task, offset, stream)."""
    offsets = {0: "i", 1: "n", 2: "m", 3: "t"}
    return tuple(f"P{{P}} {task}[i{{{offsets[o]}}}]@{role}" for task, o, role in SPECS[name])


def lookup_on(role: str, step: Sequence[str]) -> Tuple[str, ...]:
    return tuple(s.replace("@data_dist", f"@{role}") if "EmbLookup" in s else s for s in step)


def staged_schedule(stages: Sequence[str], n: int) -> List[str]:
    """StagedTrainPipeline: stage s of batch k in the fill, then newest batch first (see its docstring)."""
    count = len(stages)
    actions = [f"P0 {stages[s]}[i{k}]@{stages[s]}" for k in range(count) for s in range(count - k)]
    for call in range(n):
        actions += [f"P{call} {stages[s]}[i{call + count - s}]@{stages[s]}" for s in range(count)]
        actions.append(f"P{call} WaitBatch[i{call}]@default")
    return [a for a in actions if _batch_of(a) < n]


# --------------------------------------------------------------- harness


@dataclass
class Variant:
    """One variant in one configuration: how to build it and what it must record."""

    model: Callable[[], StandIn]
    pipeline: Callable[[StandIn], Any]
    schedule: Callable[[int], List[str]]
    side_streams: Tuple[str, ...]  # streams that must have run kernels


def record(
    variant: Variant,
    n: int = N_BATCHES,
    patch: Callable[[Any], ContextManager[Any]] = lambda pipeline: contextlib.nullcontext(),
) -> StreamRecorder:
    """Run ``variant`` to the end of the data inside a recording; returns the recorder."""
    model = variant.model()  # before the recording: parameters are external memory
    batches = make_batches(n)  # host memory, copied "to the device" by the pipeline
    with StreamRecorder() as recorder:
        pipeline = recorder.watch(variant.pipeline(model))
        with patch(pipeline):
            outputs = drain(pipeline, iter(batches))
        assert len(outputs) == n
        # Drop the pipeline inside the recording: its last frees are recorded too.
        del pipeline, outputs
    return recorder


def assert_clean(recorder: StreamRecorder, variant: Variant, n: int = N_BATCHES) -> None:
    recorder.assert_protocol(variant.schedule(n))
    summary = summarize(recorder)
    assert set(summary.ops) <= {"default", *variant.side_streams}, summary.ops
    for stream in variant.side_streams:
        assert summary.ops.get(stream, 0) > 0, f"no kernel ran on '{stream}': {summary.ops}"
    if variant.side_streams:
        # Something really crossed streams, or the clean check says nothing.
        assert summary.cross_stream_accesses > 0 and summary.waits > 0, summary
        assert summary.record_streams > 0 and summary.handed_over_frees > 0, summary


def sparse_dist_like(make: Callable[..., Any], **kwargs: Any) -> Variant:
    return Variant(
        StandIn,
        lambda m: make(m, optimizer_for(m), CPU, **kwargs),
        lambda n: exact(test_schedule.SPARSE_DIST_FILL, every(test_schedule.SPARSE_DIST_STEP), n),
        ("memcpy", "data_dist"),
    )


def fused(choice: str) -> Variant:
    role = {"data_dist": "data_dist", "new": "emb_lookup", "current": "default"}[choice]
    step = lookup_on(role, test_schedule_fused.FUSED_STEP)
    return Variant(
        StandIn,
        lambda m: TrainPipelineFusedSparseDist(
            m,
            table_updated_in_backward(m),
            CPU,
            emb_lookup_stream=choice,  # type: ignore[arg-type]
        ),
        lambda n: exact(test_schedule_fused.FILL, every(step), n),
        tuple(dict.fromkeys(("memcpy", "data_dist", role))),
    )


def eval_fused(prefetch: bool) -> Variant:
    fill = test_schedule_fused.PREFETCH_FILL if prefetch else test_schedule_fused.FILL
    step = test_schedule_fused.PREFETCH_STEP if prefetch else test_schedule_fused.EVAL_STEP
    return Variant(
        StandIn,
        lambda m: EvalPipelineFusedSparseDist(
            m.eval(), None, CPU, emb_lookup_stream="new", enable_embedding_lookup_prefetch=prefetch
        ),
        lambda n: exact(lookup_on("emb_lookup", fill), every(lookup_on("emb_lookup", step)), n),
        ("memcpy", "data_dist", "emb_lookup"),
    )


SEMI_SYNC_START = 2


def semi_sync_steps(i: int) -> Sequence[str]:
    sync, semi = test_schedule_semi_sync.SYNC_STEP, test_schedule_semi_sync.SEMI_STEP
    return semi if i >= SEMI_SYNC_START else sync


VARIANTS: Dict[str, Variant] = {
    "Base": Variant(
        StandIn,
        lambda m: TrainPipelineBase(m, optimizer_for(m), CPU),
        lambda n: exact(["P0 H2D[i0]@memcpy"], every(test_schedule.BASE_STEP), n),
        ("memcpy",),
    ),
    # Eager throughout: the protocol, not the compiler, is under test.
    "PT2": Variant(
        StandIn,
        lambda m: TrainPipelinePT2(
            m, optimizer_for(m), CPU, compile_configs=TorchCompileConfig(compile_on_iter=10**6)
        ),
        lambda n: exact([], every(from_spec("TrainPipelinePT2")), n),
        (),
    ),
    "SparseDist": sparse_dist_like(TrainPipelineSparseDist),
    "SparseDistLite": Variant(
        StandIn,
        lambda m: TrainPipelineSparseDistLite(m, optimizer_for(m), CPU),
        lambda n: exact(["P0 H2D[i0]@memcpy"], every(test_schedule_lite_eval.LITE_STEP), n),
        ("memcpy",),
    ),
    "Fused-data_dist": fused("data_dist"),
    "Fused-new": fused("new"),
    "Fused-current": fused("current"),
    "SemiSync": Variant(
        StandIn,
        lambda m: TrainPipelineSemiSync(
            m, table_updated_in_backward(m), CPU, start_batch=SEMI_SYNC_START
        ),
        lambda n: exact(test_schedule_semi_sync.FILL, semi_sync_steps, n),
        ("memcpy", "data_dist"),
    ),
    "Prefetch": Variant(
        caching_model,
        lambda m: PrefetchTrainPipelineSparseDist(m, optimizer_for(m), CPU),
        lambda n: exact(test_schedule_prefetch.FILL, every(test_schedule_prefetch.STEP), n),
        ("memcpy", "data_dist", "prefetch"),
    ),
    # The loader thread's copies are recorded too: it issues them on memcpy.
    # (The default: the stand-in device has streams.)
    "EvalSparseDist": Variant(
        StandIn,
        lambda m: EvalPipelineSparseDist(m.eval(), None, CPU),
        lambda n: exact(
            test_schedule_lite_eval.EVAL_FILL, every(test_schedule_lite_eval.EVAL_STEP), n
        ),
        ("memcpy", "data_dist"),
    ),
    # No loader thread: progress() issues the same copies on memcpy itself.
    "EvalSparseDist-inline": Variant(
        StandIn,
        lambda m: EvalPipelineSparseDist(m.eval(), None, CPU, loader_thread=False),
        lambda n: exact(
            test_schedule_lite_eval.EVAL_FILL, every(test_schedule_lite_eval.EVAL_STEP), n
        ),
        ("memcpy", "data_dist"),
    ),
    # Lookups on the default stream at the top of the step; PEC verbs empty (no PEC module).
    "PEC": Variant(
        StandIn,
        lambda m: TrainPipelinePEC(m, optimizer_for(m), CPU),
        test_schedule_pec.pec_schedule,
        ("memcpy", "data_dist"),
    ),
    "EvalFused": eval_fused(prefetch=False),
    "EvalFused-prefetch": eval_fused(prefetch=True),
}


def _compiled_autograd_model() -> StandIn:
    model = StandIn()
    # Compiled autograd captures every backward as in production; the "eager"
    # backend then runs the captured graph op by op.  Inductor's generated
    # kernels would bypass the dispatcher, so the recorder could not see what
    # they read and write (and compiling would take longer than this file).
    model._compiled_autograd_options = {"backend": "eager", "dynamic": True, "fullgraph": False}
    return model


# torchrec's experimental SparseDist schedules: a copy thread (issuing on memcpy,
# memory allocated there as the synchronous copy does), and train/eval by mode.
VARIANTS["SparseDistT"] = sparse_dist_like(TrainPipelineSparseDistT)
VARIANTS["TrainEvalHybrid"] = sparse_dist_like(TrainEvalHybridPipelineBase)


def _without_stashing(make: Callable[[StandIn], Any]) -> Callable[[StandIn], Any]:
    """Build a stash variant with the no-op stashing: on the stand-in device (which
    has streams) it would otherwise hand the recorded streams to torchrec's
    MemoryStashingManager, whose state is global.  What is checked is ours: the
    restore and prefetch points and their streams."""

    def build(model: StandIn) -> Any:
        with mock.patch("trec_pipelines.pipelines.stash.stashing_for", lambda *_: Stashing()):
            return make(model)

    return build


STASH_RESTORE_IN_BACKWARD = tuple(
    step
    for s in test_schedule.SPARSE_DIST_STEP
    for step in ((s, "P{P} StashRestore[i{i}]@default") if "Backward" in s else (s,))
)
PREFETCH_EMS_STEP = tuple(
    step
    for s in STASH_RESTORE_IN_BACKWARD
    for step in (
        ("P{P} StashRestore[i{i}]@default", "P{P} EmbPrefetch[i{n}]@default", s)
        if "Backward" in s
        else (s,)
    )
)
# EmbStash: SparseDist's schedule, the restore at over's first parameter's gradient.
VARIANTS["EmbStash"] = Variant(
    StandIn,
    _without_stashing(lambda m: TrainPipelineSparseDistEmbStash(m, optimizer_for(m), CPU, "over")),
    lambda n: exact(test_schedule.SPARSE_DIST_FILL, every(STASH_RESTORE_IN_BACKWARD), n),
    ("memcpy", "data_dist"),
)
# PrefetchEMS: cur restored and nxt prefetched on the default stream before the
# backward, from nxt's input dist (data_dist).
VARIANTS["PrefetchEMS"] = Variant(
    caching_model,
    _without_stashing(lambda m: TrainPipelinePrefetchEMS(m, optimizer_for(m), CPU, "over")),
    lambda n: exact(test_schedule.SPARSE_DIST_FILL, every(PREFETCH_EMS_STEP), n),
    ("memcpy", "data_dist"),
)

VARIANTS["SparseDistCompAutograd"] = Variant(
    _compiled_autograd_model,
    lambda m: TrainPipelineSparseDistCompAutograd(m, optimizer_for(m), CPU),
    VARIANTS["SparseDist"].schedule,
    ("memcpy", "data_dist"),
)


# ------------------------------------------------------ every variant holds


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_follows_the_stream_protocol(name: str) -> None:
    variant = VARIANTS[name]
    assert_clean(record(variant), variant)


@pytest.mark.parametrize("name", ["EvalSparseDist", "EvalSparseDist-inline"])
def test_eval_loads_on_a_thread_by_default_on_a_device_with_streams(name: str) -> None:
    """The stand-in device has streams: by default Eval copies on its loader thread;
    ``loader_thread=False`` copies in the training thread.  The recorded H2D
    actions say which, and nothing else in the record differs."""
    recorder = record(VARIANTS[name])
    thread = LOADER_THREAD_NAME if name == "EvalSparseDist" else "main"
    copies = [r for r in recorder.records if isinstance(r, OpRecord) and r.stream.name == "memcpy"]
    assert copies and {r.where.thread for r in copies} == {thread}
    labels = {s.thread for s in recorder.spans if s.task == rec.H2D}
    assert labels == {"loader" if name == "EvalSparseDist" else "main"}
    assert {s.thread for s in recorder.spans if s.task != rec.H2D} == {"main"}


def test_semi_sync_lookup_moves_before_the_update_and_stays_ordered() -> None:
    """Both phases: the lookup of i+1 after i's update (sync), then before it (semi-sync)."""
    recorder = record(VARIANTS["SemiSync"], n=6)
    order = [(s.task, s.batch) for s in recorder.spans if s.task in ("EmbLookup", "EmbBackward")]
    assert order.index(("EmbLookup", 2)) > order.index(("EmbBackward", 1))  # sync
    assert order.index(("EmbLookup", 4)) < order.index(("EmbBackward", 3))  # semi-sync
    assert_clean(recorder, VARIANTS["SemiSync"], n=6)


# ------------------------------------------------- async in-place copy


@dataclass
class InplaceBatch(Batch):
    """A batch whose ``to(..., data_copy_stream=s)`` copies in place, like torchrec's ModelInput.

    The device memory is allocated on the current stream; ``s`` waits for that
    stream, then fills it.
    """

    def to(  # type: ignore[override]
        self, device: torch.device, non_blocking: bool = False, data_copy_stream: Any = None
    ) -> "InplaceBatch":
        if data_copy_stream is None:
            moved = super().to(device, non_blocking)
            return InplaceBatch(moved.dense, moved.sparse, moved.labels)
        sources = [self.dense, self.sparse.values(), self.sparse.lengths(), self.labels]
        allocating = streams.current_stream(device)
        targets = [torch.empty_like(t, device=device) for t in sources]  # on the current stream
        with streams.on_stream(data_copy_stream):
            streams.wait_stream(data_copy_stream, allocating)
            for target, source in zip(targets, sources, strict=True):
                target.copy_(source, non_blocking=non_blocking)
        dense, values, lengths, labels = targets
        sparse = KeyedJaggedTensor(keys=self.sparse.keys(), values=values, lengths=lengths)
        return InplaceBatch(dense, sparse, labels)


ASYNC_INPLACE: Dict[str, Variant] = {
    "SparseDist": sparse_dist_like(
        TrainPipelineSparseDist, enable_inplace_copy_batch=True, async_inplace_copy=True
    ),
    "SparseDistT": sparse_dist_like(TrainPipelineSparseDistT, enable_inplace_copy_batch=True),
    "SparseDistLite": Variant(
        StandIn,
        lambda m: TrainPipelineSparseDistLite(m, optimizer_for(m), CPU, async_inplace_copy=True),
        VARIANTS["SparseDistLite"].schedule,
        ("memcpy",),
    ),
    "Prefetch": Variant(
        caching_model,
        lambda m: PrefetchTrainPipelineSparseDist(
            m, optimizer_for(m), CPU, async_inplace_copy=True
        ),
        VARIANTS["Prefetch"].schedule,
        ("memcpy", "data_dist", "prefetch"),
    ),
}


@pytest.mark.parametrize("name", sorted(ASYNC_INPLACE))
def test_async_inplace_copy_follows_the_protocol(name: str) -> None:
    """The worker allocates each batch on the default stream and fills it on memcpy.

    Each slot's Future is resolved before the batch's first consumer waits for
    memcpy, so that wait covers the copy whatever the worker's timing.
    """
    variant = ASYNC_INPLACE[name]
    model, ref = variant.model(), variant.model()
    host = [InplaceBatch(b.dense, b.sparse, b.labels) for b in make_batches(N_BATCHES)]
    with StreamRecorder() as recorder:
        pipeline = recorder.watch(variant.pipeline(model))
        assert pipeline._async_inplace_copy
        outputs = drain(pipeline, iter(host))
        assert len(outputs) == N_BATCHES
        del pipeline
    assert_clean(recorder, variant)
    # The batches the worker copied train exactly as the plain loop.  (The
    # prefetch cache is the pipeline's working state, not a trained weight.)
    ref_outputs = plain_loop(ref, host)
    assert len(outputs) == len(ref_outputs)
    assert all(torch.equal(a, b) for a, b in zip(outputs, ref_outputs, strict=True))
    trained = {k: v for k, v in ref.state_dict().items() if not k.endswith("cache")}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())
    worker = [r for r in recorder.records if isinstance(r, OpRecord) and r.where.thread != "main"]
    assert {r.where.thread.startswith(WORKER_THREAD) for r in worker} == {True}
    fills = [r for r in worker if r.op == "aten.copy_.default"]
    allocations = [r for r in worker if r.op.startswith("aten.empty")]
    assert len(fills) == len(allocations) == 4 * N_BATCHES  # every batch, by the worker
    assert {r.stream.name for r in fills} == {"memcpy"}
    assert {r.stream.name for r in allocations} == {"default"}


# ------------------------------------------------------------------ staged


def train_staged_with_sdd_stages(
    recorder: StreamRecorder,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: List[Any],
    extra_stage: Optional[str],
    device: torch.device,
) -> SparseDataDistUtil:
    """Train ``batches`` in the user's loop on a StagedTrainPipeline made of the copy
    and SparseDataDistUtil's input_dist stages, plus its ``extra_stage`` ("prefetch" or
    "start_embedding_lookup"), each on a stream of the recorder's named after its
    stage (the stages record those names as roles); the util, still attached."""
    streams = recorder.device
    h2d, dist = streams.Stream(name="h2d"), streams.Stream(name="start_sparse_data_dist")
    side: Dict[str, Any] = {}
    if extra_stage == "prefetch":
        side["prefetch_stream"] = streams.Stream(name="prefetch")
    if extra_stage == "start_embedding_lookup":
        side["embedding_lookup_stream"] = streams.Stream(name="start_embedding_lookup")
    sdd = SparseDataDistUtil(model, data_dist_stream=dist, **side)
    stages = [
        PipelineStage("h2d", lambda batch: batch.to(device, non_blocking=True), h2d),
        sdd.start_sparse_data_dist_stage(),
    ]
    if extra_stage == "prefetch":
        stages.append(PipelineStage("prefetch", sdd.prefetch, sdd.prefetch_stream))
    if extra_stage == "start_embedding_lookup":
        stages.append(sdd.start_embedding_lookup_stage())
    pipeline = recorder.watch(StagedTrainPipeline(stages))
    it = iter(batches)
    trained = 0
    while (batch := pipeline.progress(it)) is not None:
        optimizer.zero_grad()
        losses, _ = model(batch)
        torch.sum(losses, dim=0).backward()
        optimizer.step()
        trained += 1
    assert trained == len(batches)
    return sdd


def _staged_run(
    extra_stage: Optional[str], model_factory: Optional[Callable[[], StandIn]] = None
) -> StreamRecorder:
    if model_factory is None:
        model_factory = caching_model if extra_stage == "prefetch" else StandIn
    model = model_factory()
    if extra_stage == "start_embedding_lookup":
        optimizer = table_updated_in_backward(model)
    else:
        optimizer = optimizer_for(model)
    batches = make_batches(N_BATCHES)
    with StreamRecorder() as recorder:
        sdd = train_staged_with_sdd_stages(recorder, model, optimizer, batches, extra_stage, CPU)
        del sdd
    return recorder


@pytest.mark.parametrize("extra_stage", [None, "prefetch", "start_embedding_lookup"])
def test_staged_with_sparse_data_dist_stages_follows_the_protocol(
    extra_stage: Optional[str],
) -> None:
    """Copy and input_dist stages, plus SparseDataDistUtil's prefetch or lookup stage.

    The checker found the prefetch stage rewriting cache state the previous
    forward may still read, and the caller's backward updating the table
    while the next batch's lookup may still read it (rule (a), write after
    read); both are fenced now (see SparseDataDistUtil).
    """
    recorder = _staged_run(extra_stage)
    stages = ["h2d", "start_sparse_data_dist"] + ([extra_stage] if extra_stage else [])
    recorder.assert_protocol(staged_schedule(stages, N_BATCHES))
    summary = summarize(recorder)
    assert all(summary.ops.get(s, 0) > 0 for s in stages), summary.ops
    assert summary.cross_stream_accesses > 0 and summary.record_streams > 0, summary
    assert summary.handed_over_frees > 0, summary


def test_staged_next_input_dist_waits_for_the_prefetch_on_the_cache() -> None:
    """torchrec PR #4191 in SparseDataDistUtil's stages: with a module whose input
    dist reads the cache, every input dist waits for the prefetch before it."""
    recorder = _staged_run("prefetch", cache_reading_model)
    stages = ["h2d", "start_sparse_data_dist", "prefetch"]
    recorder.assert_protocol(staged_schedule(stages, N_BATCHES))


def test_staged_without_the_data_dist_fence() -> None:
    """The same run with the fence removed: the checker reports the input dist's
    read of the cache racing the prefetch stage's write."""
    from trec_pipelines.pipelines import sparse_data_dist_util as sdd_module

    real = sdd_module.wait_stream

    def wait(waiter: Any, producer: Any) -> None:
        if getattr(waiter, "name", None) == "start_sparse_data_dist" and (
            getattr(producer, "name", None) == "prefetch"
        ):
            return  # the fence in start_sparse_data_dist
        real(waiter, producer)

    with mock.patch.object(sdd_module, "wait_stream", wait):
        recorder = _staged_run("prefetch", cache_reading_model)
    stages = ["h2d", "start_sparse_data_dist", "prefetch"]
    with pytest.raises(StreamProtocolError, match="cache|prefetch"):
        recorder.assert_protocol(staged_schedule(stages, N_BATCHES))


@pytest.mark.parametrize("name", ["SparseDist", "Fused-new", "EvalFused-prefetch", "Prefetch"])
def test_detach_hands_the_model_back_safely(name: str) -> None:
    """Detach mid-epoch, train the model directly, attach and finish: still clean.

    The checker found Prefetch's in-flight prefetch (cache writes) and
    EvalFused's in-flight lookup (table reads) unordered with what the caller
    runs on the model after ``detach()`` (rule (a)); ``detach()`` now waits for them.
    """
    variant = VARIANTS[name]
    model = variant.model()
    batches = make_batches(N_BATCHES)
    user_optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with StreamRecorder() as recorder:
        pipeline = recorder.watch(variant.pipeline(model))
        it = iter(batches)
        outputs = [pipeline.progress(it) for _ in range(2)]
        pipeline.detach()
        user_optimizer.zero_grad()
        losses, _ = model(batches[0].to(CPU))
        torch.sum(losses).backward()
        user_optimizer.step()
        pipeline.attach()
        outputs += drain(pipeline, it)
        assert len(outputs) == N_BATCHES
        del pipeline, outputs
    recorder.assert_protocol()


# -------------------------------------------------- broken on purpose


def _only(violations: List[Violation], rule: str) -> List[str]:
    assert violations, "the checker found nothing"
    return [v.message for v in violations if v.rule == rule]


def _instance_patch(
    name: str, replacement: Callable[[Any], Callable[..., Any]]
) -> Callable[[Any], ContextManager[Any]]:
    """Replace method ``name`` of the pipeline under test by ``replacement(pipeline)``."""

    @contextlib.contextmanager
    def patch(pipeline: Any) -> Iterator[None]:
        original = getattr(pipeline, name)
        setattr(pipeline, name, replacement(pipeline))
        try:
            yield
        finally:
            setattr(pipeline, name, original)

    return patch


def _module_patch(module: Any, name: str, value: Any) -> Callable[[Any], ContextManager[Any]]:
    @contextlib.contextmanager
    def patch(pipeline: Any) -> Iterator[None]:
        original = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, original)

    return patch


def test_sparse_dist_wait_batch_without_its_wait() -> None:
    def wait_batch_without_wait(pipeline: Any) -> Callable[[], None]:
        def wait_for_batch() -> None:  # keeps the record_stream, drops the wait
            with pipeline._recording.span(rec.WAIT_BATCH, pipeline.contexts[0].index):
                streams.record_stream(pipeline.batches[0], streams.current_stream(CPU))

        return wait_for_batch

    violations = check_stream_protocol(
        record(
            VARIANTS["SparseDist"],
            patch=_instance_patch("_wait_for_batch", wait_batch_without_wait),
        )
    )
    # Only batch 0's dense features: later copies are covered through the
    # previous forward's hand-off from data_dist, which had waited for memcpy.
    (message,) = _only(violations, "a")
    assert message.startswith("cross-stream read without a wait: tensor float32[3, 3] (storage #")
    assert (
        "produced by aten._to_copy.default on stream 'memcpy' at step P0 H2D[i0]@memcpy" in message
    )
    assert (
        "read by aten.addmm.default on stream 'default' at step P0 Forward[i0]@default" in message
    )
    assert "(progress call 0, task Forward)" in message
    assert "'default' has not waited for that work" in message


def test_pipelined_forward_without_record_stream() -> None:
    def wait_only(obj: Any, producer: Optional[Any]) -> None:
        if producer is not None:
            streams.wait_stream(streams.current_stream(CPU), producer)

    violations = check_stream_protocol(
        record(VARIANTS["SparseDist"], patch=_module_patch(forwards_module, "hand_off", wait_only))
    )
    messages = _only(violations, "b")
    assert messages and len(messages) == len(violations)
    first = messages[0]
    # The sharding context's tensor (made by input_dist) and the received ids
    # (made by the all-to-all), both on data_dist and read by the lookup on default.
    assert first.startswith("missing record_stream: tensor int64[")
    assert re.search(
        r"allocated on stream 'data_dist' by aten.clone.default "
        r"at step P0 InputDist(Start|Wait)\[i0\]@data_dist",
        first,
    )
    assert {
        m.split("by aten.clone.default at step P0 ")[1].split("[")[0] for m in messages[:4]
    } == {
        "InputDistStart",
        "InputDistWait",
    }
    assert "used on stream 'default'" in first and "Forward[i0]@default" in first
    assert "without record_stream('default')" in first
    assert "stream 'data_dist' then issued" in first and "InputDistWait[i1]@data_dist" in first


def test_fused_forward_without_the_lookup_event_wait() -> None:

    violations = check_stream_protocol(
        record(
            VARIANTS["Fused-new"],
            patch=_module_patch(forwards_module, "wait_event", lambda s, e: None),
        )
    )
    first = _only(violations, "a")[0]
    assert first.startswith(
        "cross-stream read without a wait: tensor float32[3, 8]"
    )  # the embeddings
    assert "produced by aten.cat.default on stream 'emb_lookup' at step P0 EmbLookup[i0]" in first
    assert "read by aten.cat.default on stream 'default' at step P0 Forward[i0]@default" in first
    assert "no wait_stream('emb_lookup')" in first


def test_fused_forward_waiting_on_an_unrecorded_event() -> None:
    def unrecorded_event(stream: Any) -> Any:
        return streams.device_module(stream.device).Event()

    violations = check_stream_protocol(
        record(
            VARIANTS["Fused-new"],
            patch=_module_patch(lookup_module, "record_event", unrecorded_event),
        )
    )
    waits = _only(violations, "c")
    assert len(waits) == N_BATCHES  # one per forward
    assert re.match(
        r"wait on an unrecorded event: stream 'default' waits on event #\d+ at step "
        r"P0 Forward\[i0\]@default \(progress call 0, task Forward\), but the event is never recorded",
        waits[0],
    )
    assert _only(violations, "a"), "the unordered reads it allows are reported too"


def test_fused_lookup_without_the_weights_ready_event() -> None:
    violations = check_stream_protocol(
        record(
            VARIANTS["Fused-new"],
            patch=_instance_patch("_mark_weights_ready", lambda p: lambda: None),
        )
    )
    reads = [m for m in _only(violations, "a") if "tensor float32[20, 4]" in m]  # the table
    assert reads, violations
    assert (
        "produced by aten.add_.Tensor on stream 'default' at step P0 Backward[i0]@default"
        in reads[0]
    )
    assert (
        "read by aten._embedding_bag.default on stream 'emb_lookup' at step P1 EmbLookup[i1]"
        in reads[0]
    )


def test_fused_with_a_dense_optimized_table_is_the_documented_limitation() -> None:
    """Fused reads the table before the dense optimizer's step writes it: flagged, as documented."""
    variant = fused("new")
    dense_opt = Variant(
        StandIn,
        lambda m: TrainPipelineFusedSparseDist(m, optimizer_for(m), CPU, emb_lookup_stream="new"),
        variant.schedule,
        variant.side_streams,
    )
    reads = _only(check_stream_protocol(record(dense_opt)), "a")
    assert len(reads) == N_BATCHES - 1
    assert (
        "by aten.add_.Tensor on stream 'default' at step P0 OptimizerStep[i0]@default" in reads[0]
    )


def test_prefetch_without_the_forward_fence() -> None:
    violations = check_stream_protocol(
        record(
            VARIANTS["Prefetch"],
            patch=_module_patch(prefetch_module, "wait_event", lambda s, e: None),
        )
    )
    writes = _only(violations, "a")
    assert len(writes) == len(violations) == N_BATCHES - 1
    assert writes[0] == (
        "cross-stream write without a wait: tensor float32[20] (storage #"
        + writes[0].split("(storage #")[1].split(")")[0]
        + "), read by aten.index_select.default on stream 'default' at step P0 Forward[i0]@default "
        "(progress call 0, task Forward), is overwritten by aten.index_fill_.int_Scalar on stream "
        "'prefetch' at step P0 EmbPrefetch[i1]@prefetch (progress call 0, task EmbPrefetch), "
        "before 'prefetch' waited for that read."
    )


def test_base_without_record_stream() -> None:
    def without_record(batch: Any, producer: Any, record: bool = True) -> None:
        wait_for_batch(batch, producer, record=False)

    violations = check_stream_protocol(
        record(VARIANTS["Base"], patch=_module_patch(base_module, "wait_for_batch", without_record))
    )
    messages = _only(violations, "b")
    assert len(messages) == len(violations)
    assert (
        "allocated on stream 'memcpy' by aten._to_copy.default at step P0 H2D[i0]@memcpy"
        in messages[0]
    )
    assert (
        "stream 'memcpy' then issued aten._to_copy.default at step P1 H2D[i2]@memcpy" in messages[0]
    )


def test_copy_issued_on_the_wrong_stream() -> None:
    def on_default(batch: Any, device: torch.device, stream: Any, inplace: bool = False) -> Any:
        return copy_to_device(batch, device, None, inplace)

    violations = check_stream_protocol(
        record(
            VARIANTS["SparseDist"],
            patch=_module_patch(sparse_dist_module, "copy_to_device", on_default),
        )
    )
    wrong = _only(violations, "d")
    assert wrong[0] == (
        "work on the wrong stream: P0 H2D[i0]@memcpy is recorded on stream 'memcpy', but its "
        "aten._to_copy.default ran on stream 'default' (at step P0 H2D[i0]@memcpy (progress "
        "call 0, task H2D))."
    )


def test_schedule_out_of_order_is_reported_per_stream() -> None:
    variant = VARIANTS["SparseDist"]
    recorder = record(variant)
    expected = variant.schedule(N_BATCHES)
    swapped = list(expected)
    a, b = swapped.index("P1 H2D[i3]@memcpy"), swapped.index("P2 H2D[i4]@memcpy")
    swapped[a], swapped[b] = "P1 H2D[i4]@memcpy", "P2 H2D[i3]@memcpy"
    with pytest.raises(StreamProtocolError) as error:
        recorder.assert_protocol(swapped)
    assert error.value.violations == [
        Violation(
            "d",
            "schedule of stream 'memcpy': its task #3 is H2D[i3] (in progress call 1), the "
            "schedule has H2D[i4] (in progress call 1) (5 task(s) recorded on it, 5 expected).",
        )
    ]
    assert check_schedule(recorder.spans, expected) == []


# ------------------------------------------- the checker on small records


def _ops_on(stream: Any) -> ContextManager[Any]:
    return streams.on_stream(stream)


def test_transitive_wait_covers_and_early_wait_does_not() -> None:
    with StreamRecorder() as recorder:
        a, b, c, d = (recorder.device.Stream(name=n) for n in "abcd")
        with _ops_on(a):
            t = torch.ones(4) * 2  # written on a
        b.wait_stream(a)
        c.wait_stream(b)  # c -> b -> a, after the write
        with _ops_on(c):
            t.sum()
        with _ops_on(a):
            u = torch.ones(4) * 3  # written on a after those waits
        d.wait_stream(c)  # d -> c -> b -> a: covers t, but c's view of a predates u
        with _ops_on(d):
            t.sum()
            u.sum()
    (violation,) = check_stream_protocol(recorder)
    assert violation.rule == "a"
    assert "produced by aten.mul.Tensor on stream 'a'" in violation.message
    assert "read by aten.sum.default on stream 'd'" in violation.message
    t_made, u_made = [r for r in recorder.records if getattr(r, "op", "") == "aten.mul.Tensor"]
    assert f"(storage #{u_made.allocs[0]})" in violation.message  # u, not t


def test_events_order_only_what_came_before_their_record() -> None:
    with StreamRecorder() as recorder:
        side = recorder.device.Stream(name="side")
        early = recorder.device.Event()
        with _ops_on(side):
            early.record()
            x = torch.zeros(3) + 1
            late = streams.record_event(side)
            y = torch.zeros(3) + 2
        default = streams.current_stream(CPU)
        streams.wait_event(default, late)
        x.sum()  # covered by late
        streams.wait_event(default, early)
        y.sum()  # produced after late was recorded
    (violation,) = check_stream_protocol(recorder)
    assert "produced by aten.add.Tensor on stream 'side'" in violation.message
    assert "is read by aten.sum.default on stream 'default'" in violation.message


def test_event_waited_before_it_is_recorded() -> None:
    with StreamRecorder() as recorder:
        side = recorder.device.Stream(name="side")
        event = recorder.device.Event()
        streams.wait_event(streams.current_stream(CPU), event)
        event.record(side)
    (violation,) = check_stream_protocol(recorder)
    assert violation.rule == "c"
    assert "is first recorded only later, on stream 'side'" in violation.message


def test_record_stream_is_needed_only_when_the_block_can_be_reused() -> None:
    def run(record_it: bool, wait_before_reuse: bool) -> List[Violation]:
        with StreamRecorder() as recorder:
            side = recorder.device.Stream(name="side")
            default = streams.current_stream(CPU)
            with _ops_on(side):
                t = torch.ones(5)  # allocated on side
            default.wait_stream(side)
            t.sum()  # used on default
            if record_it:
                t.record_stream(default)
            del t  # freed
            if wait_before_reuse:
                side.wait_stream(default)
            with _ops_on(side):
                torch.zeros(5)  # the next allocation on side may take the block
        return check_stream_protocol(recorder)

    assert run(record_it=True, wait_before_reuse=False) == []
    assert run(record_it=False, wait_before_reuse=True) == []
    (violation,) = run(record_it=False, wait_before_reuse=False)
    assert violation.rule == "b"
    assert violation.message.startswith("missing record_stream: tensor float32[5] (storage #1)")
    assert "stream 'side' then issued aten.zeros.default" in violation.message


def test_write_after_a_read_on_another_stream() -> None:
    with StreamRecorder() as recorder:
        side = recorder.device.Stream(name="side")
        t = torch.ones(3)
        side.wait_stream(streams.current_stream(CPU))
        with _ops_on(side):
            t.sum()  # read on side
        t.add_(1)  # written on default, which never waited for side
    (violation,) = check_stream_protocol(recorder)
    assert violation.message.startswith("cross-stream write without a wait")
    assert "before 'default' waited for that read" in violation.message


def test_synchronize_orders_everything_after_it() -> None:
    with StreamRecorder() as recorder:
        side = recorder.device.Stream(name="side")
        with _ops_on(side):
            t = torch.ones(3) + 1
        side.synchronize()
        t.sum()
    assert check_stream_protocol(recorder) == []


def _verb_finishing_side_work(join: bool, read_after: bool) -> List[Violation]:
    """Forward finishes on data_dist an all-to-all InputDistStart issued there,
    as torchrec's does, then (``join``) makes its own stream wait for it."""
    with StreamRecorder() as recorder:
        side = recorder.device.Stream(name="data_dist")
        default = streams.current_stream(CPU)
        schedule = rec.ScheduleRecorder(streams={"default": default, "data_dist": side})
        schedule.begin_call()
        with schedule.span("InputDistStart", 0, "data_dist"), _ops_on(side):
            sent = torch.ones(4) * 2
        with schedule.span("Forward", 0, "default"):
            with _ops_on(side):  # completes where it was issued
                received = sent + 1
            if join:
                streams.hand_off(received, side)
        with schedule.span("Backward", 0, "default"):
            if read_after:
                received.sum()
            torch.ones(2) * 3  # more work on the verb's stream
    return check_stream_protocol(recorder)


def test_verb_may_finish_side_stream_work_it_joins_before_it_ends() -> None:
    """Rule (d): on a GPU, what the default stream runs after Forward waits for
    the data_dist kernels Forward issued, exactly as if they had run on default."""
    assert _verb_finishing_side_work(join=True, read_after=True) == []
    # Not joined: the kernels escape the verb -- reported even when nothing reads them.
    (violation,) = _verb_finishing_side_work(join=False, read_after=False)
    assert violation == Violation(
        "d",
        "work on the wrong stream: P0 Forward[i0]@default is recorded on stream 'default', "
        "but its aten.add.Tensor ran on stream 'data_dist' (at step P0 Forward[i0]@default "
        "(progress call 0, task Forward)), and stream 'default' had not waited for that work "
        "when the step ended (no wait_stream('data_dist') and no wait of an event recorded "
        "after it).",
    )
    # ... and a read of their output after the verb is a race of its own (rule a).
    rules = sorted(v.rule for v in _verb_finishing_side_work(join=False, read_after=True))
    assert rules == ["a", "d"]


def test_default_stream_work_in_a_side_stream_verb_is_reported_even_when_joined() -> None:
    """The default stream is no side stream: work a memcpy verb issues there
    serializes the copy with compute, whatever waits come after."""
    with StreamRecorder() as recorder:
        side = recorder.device.Stream(name="memcpy")
        default = streams.current_stream(CPU)
        schedule = rec.ScheduleRecorder(streams={"default": default, "memcpy": side})
        schedule.begin_call()
        with schedule.span("H2D", 0, "memcpy"):
            torch.ones(3) + 1  # issued on default
            side.wait_stream(default)
    (violation,) = check_stream_protocol(recorder)
    assert violation.rule == "d"
    assert "but its aten.ones.default ran on stream 'default'" in violation.message
    assert "had not waited" not in violation.message


def test_host_memory_is_host_work_not_a_stream_kernel() -> None:
    """fbgemm keeps the learning rate in a host tensor on every device: the fused
    optimizer's fill_ and the lookup's clone of it run on the CPU in program
    order, so they race with nothing; a kernel mixing it with device memory
    is still checked."""

    def run(host: bool) -> List[Violation]:
        lr = torch.tensor(0.1)
        table = torch.ones(4)
        with StreamRecorder(host_memory=[lr] if host else []) as recorder:
            side = recorder.device.Stream(name="data_dist")
            with _ops_on(side):
                lr.clone()  # the lookup reads the rate
            lr.fill_(0.2)  # zero_grad() sets it, on default, no wait
            table.add_(lr)  # a device kernel reading it: the update
            with _ops_on(side):
                table.sum()  # read on data_dist without waiting for the update
        return check_stream_protocol(recorder)

    assert [v.rule for v in run(host=False)] == ["a", "a"]
    (violation,) = run(host=True)
    assert "produced by aten.add_.Tensor on stream 'default'" in violation.message


def test_pipeline_built_outside_the_recording_is_refused() -> None:
    model = StandIn()
    pipeline = TrainPipelineSparseDist(model, optimizer_for(model), CPU)
    with StreamRecorder() as recorder:
        with pytest.raises(ValueError, match="built outside the recording"):
            recorder.watch(pipeline)


def test_recorder_leaves_nothing_behind() -> None:
    with StreamRecorder() as recorder:
        assert streams.has_streams(CPU)
        assert streams.current_stream(CPU) is recorder.device.default
        with pytest.raises(RuntimeError, match="do not nest"):
            StreamRecorder().__enter__()
    assert not streams.has_streams(CPU)
    assert "record_stream" not in torch.Tensor.__dict__ and "to" not in torch.Tensor.__dict__
    host = torch.ones(2)
    assert host.to(CPU) is host  # no copies once the recording is over


def test_sparse_dist_t_issues_every_copy_on_its_thread() -> None:
    """Not in place: the worker allocates on memcpy and copies there, as the
    synchronous copy does; the training thread issues none of them."""
    recorder = record(VARIANTS["SparseDistT"])
    copies = [r for r in recorder.records if isinstance(r, OpRecord) and r.stream.name == "memcpy"]
    assert copies and {r.where.thread.startswith(WORKER_THREAD) for r in copies} == {True}


def test_prefetch_ems_prefetch_without_its_wait_for_the_input_dist() -> None:
    """nxt's prefetch reads its input dist on the default stream: without the
    wait for data_dist the checker reports the read."""
    from trec_pipelines.pipelines import prefetch_ems

    def no_wait(pipeline: Any) -> ContextManager[Any]:
        return mock.patch.object(prefetch_ems, "wait_stream", lambda *_: None)

    with pytest.raises(StreamProtocolError, match="data_dist"):
        record(VARIANTS["PrefetchEMS"], patch=no_wait).assert_protocol(
            VARIANTS["PrefetchEMS"].schedule(N_BATCHES)
        )


PREFETCH_READING_CACHE = Variant(
    cache_reading_model,
    lambda m: PrefetchTrainPipelineSparseDist(m, optimizer_for(m), CPU),
    lambda n: exact(test_schedule_prefetch.FILL, every(test_schedule_prefetch.STEP), n),
    ("memcpy", "data_dist", "prefetch"),
)


def test_prefetch_next_input_dist_waits_for_the_prefetch_on_the_cache() -> None:
    """torchrec PR #4191: with a module whose input dist reads the cache, the
    data_dist <- prefetch fence keeps every input dist after the prefetch before it."""
    assert_clean(record(PREFETCH_READING_CACHE), PREFETCH_READING_CACHE)


def test_prefetch_without_the_data_dist_fence() -> None:
    """The same run with the fence removed: the checker reports the input dist's
    read of the cache on data_dist, racing the prefetch's write on its stream."""
    from trec_pipelines.pipelines import prefetch as prefetch_module

    real = prefetch_module.wait_stream

    def without_fence(pipeline: Any) -> ContextManager[Any]:
        def wait(waiter: Any, producer: Any) -> None:
            streams_ = pipeline._streams
            if waiter is streams_.data_dist and producer is streams_.prefetch:
                return  # the fence in start_sparse_data_dist
            real(waiter, producer)

        return mock.patch.object(prefetch_module, "wait_stream", wait)

    with pytest.raises(StreamProtocolError, match="cache|prefetch"):
        record(PREFETCH_READING_CACHE, patch=without_fence).assert_protocol(
            PREFETCH_READING_CACHE.schedule(N_BATCHES)
        )
