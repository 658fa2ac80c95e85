"""PrefetchTrainPipelineSparseDist on the fake model: schedule, prefetch order, stream hand-offs."""

from __future__ import annotations

import inspect
from typing import Any, List, Optional, Tuple

import pytest
import torch
import torchrec.distributed.train_pipeline as upstream
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Multistreamable

from tests.unit.fake_cuda import FakeCuda as FakeDevice
from tests.unit.fakes import (
    FEATURES,
    Batch,
    FakeShardedEBC,
    TinyModel,
    assert_same_training,
    drain,
    make_batches,
    optimizer_for,
    plain_loop,
)
from trec_pipelines.core import streams
from trec_pipelines.pipelines.prefetch import PrefetchTrainPipelineSparseDist

CPU = torch.device("cpu")
BATCH_SIZE = 3
IDS_PER_BATCH = len(FEATURES) * BATCH_SIZE  # one id per sample and feature


def prefetch_pipeline(model: torch.nn.Module, **kwargs: Any) -> PrefetchTrainPipelineSparseDist:
    return PrefetchTrainPipelineSparseDist(model, optimizer_for(model), CPU, **kwargs)


def recorded(n_batches: int, model: Optional[TinyModel] = None) -> List[str]:
    pipeline = prefetch_pipeline(model if model is not None else TinyModel())
    pipeline.enable_schedule_recording()
    drain(pipeline, iter(make_batches(n_batches)))
    return [str(action) for action in pipeline.schedule_actions]


def steady(call: int, i: int, *step: str) -> List[str]:
    return [s.format(P=call, i=i, n=i + 1, m=i + 2) for s in step]


# ---------------------------------------------------------------- schedule

FILL = [
    "P0 H2D[i0]@memcpy",
    "P0 InputDistStart[i0]@data_dist",
    "P0 InputDistWait[i0]@data_dist",
    "P0 EmbPrefetch[i0]@prefetch",
    "P0 H2D[i1]@memcpy",
    "P0 InputDistStart[i1]@data_dist",
]

STEP = (
    "P{P} ZeroGrad[i{i}]@default",
    "P{P} WaitBatch[i{i}]@default",
    "P{P} H2D[i{m}]@memcpy",
    "P{P} InputDistWait[i{n}]@data_dist",
    "P{P} Forward[i{i}]@default",
    "P{P} EmbPrefetch[i{n}]@prefetch",
    "P{P} Backward[i{i}]@default",
    "P{P} OptimizerStep[i{i}]@default",
    "P{P} InputDistStart[i{m}]@data_dist",
)


def test_fill_steady_drain() -> None:
    expected = list(FILL)
    for i in range(3):
        expected += steady(i, i, *STEP)
    # P3: no batch 5 to copy, so none to start either; batch 4 is still prefetched.
    expected += [a for a in steady(3, 3, *STEP) if "[i5]" not in a]
    # P4: the last batch trains alone.
    expected += [a for a in steady(4, 4, *STEP) if "[i4]" in a]
    assert recorded(5) == expected


SHORT = {
    0: [],
    1: FILL[:4] + [a for a in steady(0, 0, *STEP) if "[i0]" in a],
    2: FILL
    + [a for a in steady(0, 0, *STEP) if "[i2]" not in a]
    + [a for a in steady(1, 1, *STEP) if "[i1]" in a],
    3: FILL
    + steady(0, 0, *STEP)
    + [a for a in steady(1, 1, *STEP) if "[i3]" not in a]
    + [a for a in steady(2, 2, *STEP) if "[i2]" in a],
}


@pytest.mark.parametrize("n", sorted(SHORT))
def test_short_loaders(n: int) -> None:
    assert recorded(n) == SHORT[n]


def test_eval_mode_only_waits_and_forwards_on_default() -> None:
    model = TinyModel()
    model.eval()
    default = [a for a in recorded(3, model) if a.endswith("@default")]
    assert default == [
        f"P{i} {task}[i{i}]@default" for i in range(3) for task in ("WaitBatch", "Forward")
    ]


# ------------------------------------------------------- training results


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4])
def test_loader_lengths_match_plain_loop(n: int) -> None:
    batches = make_batches(n)
    model, ref = TinyModel(), TinyModel()
    outputs = drain(prefetch_pipeline(model), iter(batches))
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)


def test_new_iterator_starts_new_epoch_without_reset() -> None:
    batches = make_batches(3)
    model, ref = TinyModel(), TinyModel()
    pipeline = prefetch_pipeline(model)
    outputs = drain(pipeline, iter(batches)) + drain(pipeline, iter(batches))
    assert_same_training(outputs, plain_loop(ref, batches + batches), model, ref)


def test_detach_attach_mid_epoch_keeps_the_prefetched_batch() -> None:
    batches = make_batches(5)
    model, ref = TinyModel(), TinyModel()
    pipeline = prefetch_pipeline(model)
    it = iter(batches)
    outputs = [pipeline.progress(it) for _ in range(2)]
    pipeline.detach()
    pipeline.attach()
    outputs += drain(pipeline, it)
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)


def test_constructor_matches_torchrec() -> None:
    ours = inspect.signature(PrefetchTrainPipelineSparseDist.__init__).parameters
    theirs = inspect.signature(upstream.PrefetchTrainPipelineSparseDist.__init__).parameters
    positional = [
        (p.name, p.default) for p in ours.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY
    ]
    upstream_params = [(p.name, p.default) for p in theirs.values()]
    assert positional[: len(upstream_params)] == upstream_params
    # torchrec 1.9.2 added async_inplace_copy last; we offer it on 1.8.0 too.
    assert positional[len(upstream_params) :] in ([], [("async_inplace_copy", False)])


# ------------------------------------------ a sharded module that prefetches


class _Marked(Multistreamable):
    """A distributed input that says which batch it is and where it was used."""

    def __init__(self, kjt: KeyedJaggedTensor, log: List[Tuple[Any, ...]]) -> None:
        self.kjt = kjt
        self.batch = int(kjt.values().sum()) // IDS_PER_BATCH
        self._log = log

    def record_stream(self, stream: Any) -> None:
        self._log.append(("record_stream", "dist_input", self.batch, stream.name))


class _MarkedCtx(Multistreamable):
    def __init__(self, log: List[Tuple[Any, ...]]) -> None:
        self.batch: Optional[int] = None
        self._log = log

    def record_stream(self, stream: Any) -> None:
        self._log.append(("record_stream", "ctx", self.batch, stream.name))


class _TensorsPhase(Awaitable[Any]):
    """The tensors all-to-all: logs the stream it is waited on."""

    def __init__(self, value: _Marked, where: "_Where") -> None:
        super().__init__()
        self._value, self._where = value, where

    def _wait_impl(self) -> _Marked:
        self._where.log.append(("tensors_wait", self._value.batch, self._where.stream()))
        return self._value


class _SplitsPhase(Awaitable[Any]):
    def __init__(self, value: _TensorsPhase) -> None:
        super().__init__()
        self._value = value

    def _wait_impl(self) -> _TensorsPhase:
        return self._value


class _Where:
    """Where work is issued: the stand-in device module's current stream, or none."""

    def __init__(self, log: List[Tuple[Any, ...]]) -> None:
        self.log = log
        self.device: Optional["FakeDevice"] = None

    def stream(self) -> Optional[str]:
        return None if self.device is None else self.device.current_stream().name


class PrefetchingEBC(FakeShardedEBC):
    """The fake sharded EBC plus ``prefetch()``; logs which batch each call saw.

    Batches come from :func:`marked_batches`, so a batch's index is its ids'
    sum divided by the number of ids.
    """

    def __init__(self, where: _Where) -> None:
        super().__init__([])
        self.where = where
        self.prefetch_args: List[Tuple[int, Any, Any]] = []

    def create_context(self) -> _MarkedCtx:  # type: ignore[override]
        return _MarkedCtx(self.where.log)

    def input_dist(  # type: ignore[override]
        self, ctx: _MarkedCtx, features: KeyedJaggedTensor
    ) -> Awaitable[Any]:
        marked = _Marked(features, self.where.log)
        ctx.batch = marked.batch
        self.where.log.append(("input_dist", marked.batch, self.where.stream()))
        return _SplitsPhase(_TensorsPhase(marked, self.where))

    def prefetch(
        self,
        dist_input: _Marked,
        forward_stream: Optional[Any] = None,
        ctx: Optional[_MarkedCtx] = None,
    ) -> None:
        assert ctx is not None and ctx.batch == dist_input.batch
        self.where.log.append(("prefetch", dist_input.batch, self.where.stream()))
        self.prefetch_args.append((dist_input.batch, forward_stream, ctx))

    def compute(  # type: ignore[override]
        self, ctx: _MarkedCtx, dist_input: _Marked
    ) -> torch.Tensor:
        # The forward must get the very context its prefetch saw.
        assert any(c is ctx for b, _, c in self.prefetch_args if b == dist_input.batch)
        self.where.log.append(("compute", dist_input.batch, self.where.stream()))
        return super().compute(ctx, dist_input.kjt)


def prefetching_model(where: _Where) -> TinyModel:
    model = TinyModel()
    bag = model.sparse.bag
    model.sparse = PrefetchingEBC(where)
    model.sparse.bag = bag  # same weights as TinyModel(), so plain_loop can compare
    return model


def marked_batches(n: int) -> List[Batch]:
    """Batch ``k`` holds the id ``k`` once per sample and feature."""
    g = torch.Generator().manual_seed(3)
    out = []
    for k in range(n):
        lengths = torch.ones(IDS_PER_BATCH, dtype=torch.long)
        values = torch.full((IDS_PER_BATCH,), k)
        kjt = KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths)
        dense = torch.rand(BATCH_SIZE, 3, generator=g)
        labels = torch.randint(0, 2, (BATCH_SIZE,), generator=g).float()
        out.append(Batch(dense, kjt, labels))
    return out


def module_calls(log: List[Tuple[Any, ...]]) -> List[Tuple[str, int]]:
    return [(e[0], e[1]) for e in log if e[0] in ("input_dist", "prefetch", "compute")]


def test_prefetch_of_next_batch_runs_after_forward_consumed_the_current_one() -> None:
    # The timeline's comments stay in their columns.
    # fmt: off
    where = _Where([])
    model, ref = prefetching_model(where), TinyModel()
    batches = marked_batches(4)
    outputs = drain(prefetch_pipeline(model), iter(batches))
    assert module_calls(where.log) == [
        ("input_dist", 0), ("prefetch", 0), ("input_dist", 1),  # fill
        ("compute", 0), ("prefetch", 1), ("input_dist", 2),     # P0
        ("compute", 1), ("prefetch", 2), ("input_dist", 3),     # P1
        ("compute", 2), ("prefetch", 3),                        # P2
        ("compute", 3),                                         # P3
    ]
    # Every CPU module goes through the stage: one prefetch per batch, none on a side stream.
    assert [(b, s) for b, s, _ in model.sparse.prefetch_args] == [(k, None) for k in range(4)]
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)


# ------------------------------------------------- stream hand-offs (as on CUDA)


class StreamBatch(Batch):
    """A batch that logs ``record_stream`` instead of calling it on CPU tensors."""

    log: List[Tuple[Any, ...]] = []

    def to(self, device: torch.device, non_blocking: bool = False) -> "StreamBatch":
        return StreamBatch(self.dense, self.sparse, self.labels)

    def record_stream(self, stream: Any) -> None:
        batch = int(self.sparse.values().sum()) // IDS_PER_BATCH
        StreamBatch.log.append(("record_stream", "batch", batch, stream.name))


def run_with_fake_streams(n_batches: int) -> Tuple[List[Tuple[Any, ...]], PrefetchingEBC]:
    log: List[Tuple[Any, ...]] = []
    where = _Where(log)
    device = FakeDevice(log)
    where.device = device
    StreamBatch.log = log
    model = prefetching_model(where)
    batches = [StreamBatch(b.dense, b.sparse, b.labels) for b in marked_batches(n_batches)]
    with streams.use_device_module(device):
        pipeline = prefetch_pipeline(model)
        for role in ("memcpy", "data_dist", "prefetch"):
            getattr(pipeline._streams, role).name = role
        assert pipeline._streams.emb_lookup is None
        drain(pipeline, iter(batches))
    return log, model.sparse  # type: ignore[return-value]


def test_steady_state_stream_protocol() -> None:
    """One steady-state call (batch 1 trains), as a GPU would see it."""
    log, _ = run_with_fake_streams(4)
    start = log.index(("compute", 0, "default"))
    end = log.index(("compute", 1, "default"))
    call = log[log.index(("input_dist", 2, "data_dist"), start) + 1 : end + 1]
    assert call == [
        # WaitBatch(1): default waits for prefetch (which waited data_dist, which waited memcpy).
        ("wait_stream", "default", "prefetch"),
        ("record_stream", "batch", 1, "default"),
        # InputDistWait(2) issues nothing on the GPU here (the fake all-to-all is ready).
        # Forward(1): the wrapper takes the prefetched input over from the prefetch stream ...
        ("wait_stream", "default", "prefetch"),
        ("record_stream", "dist_input", 1, "default"),
        ("wait_stream", "default", "prefetch"),
        ("record_stream", "ctx", 1, "default"),
        ("compute", 1, "default"),
    ]
    # ... and nothing between the end of forward(0) and prefetch(1) skips the fence:
    after_forward_0 = log[start + 1 : log.index(("prefetch", 1, "prefetch"))]
    assert after_forward_0 == [
        ("record_event", "default", 0),  # forward(0) issued (the first event)
        # EmbPrefetch(1): the tensors all-to-all is waited on its own stream ...
        ("tensors_wait", 1, "data_dist"),
        # ... not before forward(0) has read prefetch(0) ...
        ("wait_event", "prefetch", 0),
        # ... and its output handed to the prefetch stream.
        ("wait_stream", "prefetch", "data_dist"),
        ("record_stream", "dist_input", 1, "prefetch"),
        ("record_stream", "ctx", 1, "prefetch"),
    ]


def test_every_prefetch_waits_for_the_previous_forward() -> None:
    log, module = run_with_fake_streams(5)
    for k in range(1, 5):
        forward = log.index(("compute", k - 1, "default"))
        prefetch = log.index(("prefetch", k, "prefetch"))
        recorded = [e[2] for e in log[forward:prefetch] if e[:2] == ("record_event", "default")]
        waited = [e[2] for e in log[forward:prefetch] if e[:2] == ("wait_event", "prefetch")]
        assert recorded and recorded == waited, f"prefetch({k}) not fenced after forward({k - 1})"
    # The first prefetch has no forward to wait for.
    assert not [e for e in log[: log.index(("prefetch", 0, "prefetch"))] if e[0] == "wait_event"]
    # prefetch() gets the stream the forward runs on, never its own.
    assert [(b, s.name) for b, s, _ in module.prefetch_args] == [(k, "default") for k in range(5)]


def test_input_dist_waits_for_the_copy() -> None:
    log, _ = run_with_fake_streams(3)
    for k in range(3):
        start = log.index(("input_dist", k, "data_dist"))
        assert log[start - 2 : start] == [
            ("wait_stream", "data_dist", "memcpy"),
            ("record_stream", "batch", k, "data_dist"),
        ]


class DenseOnly(TinyModel):
    """No sharded module is called: nothing is pipelined, nothing prefetched."""

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        logits = self.dense(batch.dense).sum(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, batch.labels, reduction="none"
        )
        return loss, logits.detach()


def test_batch_chain_holds_without_pipelined_modules() -> None:
    """WaitBatch waits on the prefetch stream only: it must still cover copy and input_dist."""
    log: List[Tuple[Any, ...]] = []
    device = FakeDevice(log)
    StreamBatch.log = log
    model, ref = DenseOnly(), DenseOnly()
    batches = [StreamBatch(b.dense, b.sparse, b.labels) for b in marked_batches(3)]
    with streams.use_device_module(device):
        pipeline = prefetch_pipeline(model)
        for role in ("memcpy", "data_dist", "prefetch"):
            getattr(pipeline._streams, role).name = role
        outputs = drain(pipeline, iter(batches))
    assert pipeline.rewrite_result.pipelined == ()
    waits = [e for e in log if e[0] == "wait_stream"]
    # Per batch: input_dist waits for the copy, prefetch for input_dist, default for prefetch.
    assert ("wait_stream", "data_dist", "memcpy") in waits
    assert ("wait_stream", "prefetch", "data_dist") in waits
    first_default_wait = log.index(("wait_stream", "default", "prefetch"))
    assert log[:first_default_wait].count(("wait_stream", "prefetch", "data_dist")) == 1
    assert waits.count(("wait_stream", "prefetch", "data_dist")) == 3
    assert waits.count(("wait_stream", "default", "prefetch")) == 3
    assert_same_training(outputs, plain_loop(ref, marked_batches(3)), model, ref)


def test_without_execute_all_batches_the_fill_runs_once() -> None:
    """torchrec PR #4503: upstream re-ran its fill every step in this mode.

    Without execute_all_batches the batches in flight when the data ends are
    dropped (as in every sparse-dist variant): 3 of 5 are trained.
    """
    batches = make_batches(5)
    model, ref = TinyModel(), TinyModel()
    pipeline = prefetch_pipeline(model, execute_all_batches=False)
    pipeline.enable_schedule_recording()
    outputs = drain(pipeline, iter(batches))
    prefetches = [str(a) for a in pipeline.schedule_actions if a.task == "EmbPrefetch"]
    assert prefetches == ["P0 EmbPrefetch[i0]@prefetch"] + [
        f"P{k - 1} EmbPrefetch[i{k}]@prefetch" for k in range(1, 4)
    ]
    assert_same_training(outputs, plain_loop(ref, batches[:3]), model, ref)
