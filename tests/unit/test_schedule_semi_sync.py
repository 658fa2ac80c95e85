"""TrainPipelineSemiSync on the fake model: schedule, semantics, optimizer check, streams."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipelineSemiSync as UpstreamSemiSync,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from tests.unit.fake_cuda import FakeCuda
from tests.unit.fakes import (
    FEATURES,
    Batch,
    TinyModel,
    _head,
    assert_same_training,
    drain,
    make_batches,
    optimizer_for,
    plain_loop,
)
from trec_pipelines.core import streams
from trec_pipelines.pipelines.semi_sync import TrainPipelineSemiSync

CPU = torch.device("cpu")


def semi_sync(model: torch.nn.Module, **kwargs: Any) -> TrainPipelineSemiSync:
    # The fake module has no fused optimizer: SGD over every parameter updates
    # its table at the step, which is what makes the lookup timing visible.
    return TrainPipelineSemiSync(model, optimizer_for(model), CPU, **kwargs)


def recorded(n_batches: int, model: Optional[TinyModel] = None, **kwargs: Any) -> List[str]:
    pipeline = semi_sync(model if model is not None else TinyModel(), **kwargs)
    pipeline.enable_schedule_recording()
    drain(pipeline, iter(make_batches(n_batches)))
    return [str(action) for action in pipeline.schedule_actions]


def step(call: int, i: int, *template: str) -> List[str]:
    return [s.format(P=call, i=i, n=i + 1, m=i + 2, t=i + 3) for s in template]


def upto(n: int, actions: List[str]) -> List[str]:
    """Drop the actions on batches a loader of ``n`` batches never yields (the drain)."""
    return [a for a in actions if int(a.split("[i")[1].split("]")[0]) < n]


FILL = [
    "P0 H2D[i0]@memcpy",
    "P0 InputDistStart[i0]@data_dist",
    "P0 InputDistWait[i0]@data_dist",
    "P0 EmbLookup[i0]@default",
    "P0 H2D[i1]@memcpy",
    "P0 InputDistStart[i1]@data_dist",
    "P0 InputDistWait[i1]@data_dist",
    "P0 H2D[i2]@memcpy",
]

# Batch i trains synchronously: batch i+1 is looked up after i's update.
SYNC_STEP = (
    "P{P} InputDistStart[i{m}]@data_dist",
    "P{P} ZeroGrad[i{i}]@default",
    "P{P} WaitBatch[i{i}]@default",
    "P{P} Forward[i{i}]@default",
    "P{P} H2D[i{t}]@memcpy",
    "P{P} InputDistWait[i{m}]@data_dist",
    "P{P} Backward[i{i}]@default",
    "P{P} EmbBackward[i{i}]@default",
    "P{P} OptimizerStep[i{i}]@default",
    "P{P} EmbLookup[i{n}]@default",
)

# Semi-sync: batch i+1 is looked up right after i's forward, before its update.
SEMI_STEP = (
    "P{P} InputDistStart[i{m}]@data_dist",
    "P{P} ZeroGrad[i{i}]@default",
    "P{P} WaitBatch[i{i}]@default",
    "P{P} Forward[i{i}]@default",
    "P{P} H2D[i{t}]@memcpy",
    "P{P} EmbLookup[i{n}]@default",
    "P{P} InputDistWait[i{m}]@data_dist",
    "P{P} Backward[i{i}]@default",
    "P{P} EmbBackward[i{i}]@default",
    "P{P} OptimizerStep[i{i}]@default",
)


# ---------------------------------------------------------------- schedule


def test_fill_sync_switch_semi_sync_drain() -> None:
    n, start = 7, 2
    expected = list(FILL)
    for i in range(n):
        expected += step(i, i, *(SEMI_STEP if i >= start else SYNC_STEP))
    assert recorded(n, start_batch=start) == upto(n, expected)


def test_drain_spelled_out() -> None:
    actions = recorded(5, start_batch=1)
    assert actions[-22:] == [
        # Call 2: batch 4, the last, is in input_dist; there is nothing left to copy.
        "P2 InputDistStart[i4]@data_dist",
        "P2 ZeroGrad[i2]@default",
        "P2 WaitBatch[i2]@default",
        "P2 Forward[i2]@default",
        "P2 EmbLookup[i3]@default",
        "P2 InputDistWait[i4]@data_dist",
        "P2 Backward[i2]@default",
        "P2 EmbBackward[i2]@default",
        "P2 OptimizerStep[i2]@default",
        # Call 3: two batches left; only the last one's lookup.
        "P3 ZeroGrad[i3]@default",
        "P3 WaitBatch[i3]@default",
        "P3 Forward[i3]@default",
        "P3 EmbLookup[i4]@default",
        "P3 Backward[i3]@default",
        "P3 EmbBackward[i3]@default",
        "P3 OptimizerStep[i3]@default",
        # Call 4: the last batch trains alone.
        "P4 ZeroGrad[i4]@default",
        "P4 WaitBatch[i4]@default",
        "P4 Forward[i4]@default",
        "P4 Backward[i4]@default",
        "P4 EmbBackward[i4]@default",
        "P4 OptimizerStep[i4]@default",
    ]


def test_semi_sync_from_the_first_batch() -> None:
    expected = list(FILL)
    for i in range(5):
        expected += step(i, i, *SEMI_STEP)
    assert recorded(5, start_batch=0) == upto(5, expected)


def test_stash_gradients_steps_the_previous_batch() -> None:
    n, start = 6, 2
    expected = list(FILL)
    for i in range(n):
        if i < start:
            expected += step(i, i, *SYNC_STEP)
            continue
        semi = step(i, i, *SEMI_STEP)
        at = semi.index(f"P{i} OptimizerStep[i{i}]@default")
        if i == start:
            del semi[at]  # nothing stashed yet: the step is skipped
        else:
            semi[at] = f"P{i} OptimizerStep[i{i - 1}]@default"  # applies batch i-1's gradients
        expected += semi
    assert recorded(n, start_batch=start, stash_gradients=True) == upto(n, expected)


@pytest.mark.parametrize("start", [0, 3])
@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_short_loaders(n: int, start: int) -> None:
    expected = list(FILL)
    for i in range(n):
        expected += step(i, i, *(SEMI_STEP if i >= start else SYNC_STEP))
    actions = recorded(n, start_batch=start)
    assert actions == upto(n, expected)
    if n == 0:
        assert actions == []
    if n == 1:
        assert actions == FILL[:4] + [
            "P0 ZeroGrad[i0]@default",
            "P0 WaitBatch[i0]@default",
            "P0 Forward[i0]@default",
            "P0 Backward[i0]@default",
            "P0 EmbBackward[i0]@default",
            "P0 OptimizerStep[i0]@default",
        ]


def test_eval_mode_has_no_backward_and_keeps_the_lookup_placement() -> None:
    model = TinyModel()
    model.eval()
    actions = recorded(4, model=model, start_batch=1)
    tasks = {a.split()[1].split("[")[0] for a in actions}
    assert tasks.isdisjoint({"Backward", "EmbBackward", "OptimizerStep", "ZeroGrad"})
    assert actions[8:14] == [
        "P0 InputDistStart[i2]@data_dist",
        "P0 WaitBatch[i0]@default",
        "P0 Forward[i0]@default",
        "P0 H2D[i3]@memcpy",
        "P0 InputDistWait[i2]@data_dist",
        "P0 EmbLookup[i1]@default",  # batch 0 is synchronous: lookup last
    ]
    assert actions[14:19] == [
        "P1 InputDistStart[i3]@data_dist",
        "P1 WaitBatch[i1]@default",
        "P1 Forward[i1]@default",
        "P1 EmbLookup[i2]@default",  # batch 1 is semi-sync: lookup before the wait
        "P1 InputDistWait[i3]@data_dist",
    ]


def test_is_semi_sync_reports_the_next_batch() -> None:
    pipeline = semi_sync(TinyModel(), start_batch=2)
    it = iter(make_batches(5))
    assert not pipeline.is_semi_sync()  # nothing loaded yet
    modes = []
    for _ in range(5):
        pipeline.progress(it)
        modes.append(pipeline.is_semi_sync())
    assert modes == [False, True, True, True, False]  # next batch: 1, 2, 3, 4, none


def test_reset_restarts_the_synchronous_phase() -> None:
    pipeline = semi_sync(TinyModel(), start_batch=2)
    pipeline.enable_schedule_recording()
    it = iter(make_batches(6))
    for _ in range(4):
        pipeline.progress(it)
    pipeline.reset()
    assert not pipeline.batches and not pipeline.is_semi_sync()
    before = len(pipeline.schedule_actions)
    drain(pipeline, iter(make_batches(3)))
    after = [str(a).split(" ", 1)[1] for a in pipeline.schedule_actions[before:]]
    # Indices restart at 0: batches 0 and 1 are synchronous again, batch 2 semi-sync.
    expected = FILL + step(0, 0, *SYNC_STEP) + step(1, 1, *SYNC_STEP) + step(2, 2, *SEMI_STEP)
    assert after == [a.split(" ", 1)[1] for a in upto(3, expected)]


# ---------------------------------------------------------------- semantics


def reference(
    model: TinyModel, batches: List[Batch], start_batch: int, stash: bool
) -> List[torch.Tensor]:
    """Semi-sync training written out plainly, one batch at a time.

    The lookup of batch i+1 happens before batch i's update when batch i is
    at or past ``start_batch``, after it otherwise; with ``stash`` each
    semi-sync step applies the previous semi-sync batch's gradients.
    """
    optimizer = optimizer_for(model)
    stashed: Dict[str, torch.Tensor] = {}
    outputs = []
    looked_up = model.sparse(batches[0].sparse).values() if batches else None
    for i, batch in enumerate(batches):
        embedded = looked_up
        assert embedded is not None
        leaf = embedded.detach().requires_grad_()
        loss, pred = _head(model, leaf, batch)
        has_next = i + 1 < len(batches)
        semi = i >= start_batch
        if has_next and semi:
            looked_up = model.sparse(batches[i + 1].sparse).values()
        torch.sum(loss, dim=0).backward()
        embedded.backward(leaf.grad)
        if semi and stash:
            current = {name: p.grad for name, p in model.named_parameters()}
            for name, p in model.named_parameters():
                p.grad = stashed.get(name)
            stashed = {name: g.clone() for name, g in current.items() if g is not None}
            if i != start_batch:
                optimizer.step()
        else:
            optimizer.step()
        optimizer.zero_grad()
        if has_next and not semi:
            looked_up = model.sparse(batches[i + 1].sparse).values()
        outputs.append(pred)
    return outputs


def feature_sums(batches: List[Batch]) -> List[int]:
    return [int(b.sparse.values().sum()) for b in batches]


@pytest.mark.parametrize("stash", [False, True], ids=["naive", "stash"])
@pytest.mark.parametrize("start", [0, 2, 100])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4])
def test_loaders_train_each_batch_once_in_order(n: int, start: int, stash: bool) -> None:
    batches = make_batches(n)
    model, ref = TinyModel(), TinyModel()
    outputs = drain(semi_sync(model, start_batch=start, stash_gradients=stash), iter(batches))
    # One input_dist and one lookup per batch, in loading order.
    assert [v for op, v in model.log if op == "input_dist"] == feature_sums(batches)
    assert [v for op, v in model.log if op == "compute"] == feature_sums(batches)
    assert_same_training(outputs, reference(ref, batches, start, stash), model, ref)


@pytest.mark.parametrize("stash", [False, True], ids=["naive", "stash"])
def test_synchronous_phase_is_the_plain_loop(stash: bool) -> None:
    batches = make_batches(6)
    model, ref = TinyModel(), TinyModel()
    outputs = drain(semi_sync(model, start_batch=6, stash_gradients=stash), iter(batches))
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)


def test_semi_sync_differs_from_the_plain_loop_after_start_batch() -> None:
    """Guards the tests above against a pipeline that is never semi-sync."""
    batches = make_batches(6)
    outputs = drain(semi_sync(TinyModel(), start_batch=2), iter(batches))
    plain = plain_loop(TinyModel(), batches)
    assert all(torch.equal(outputs[k], plain[k]) for k in range(3))
    # Batch 3 on may miss the previous batch's update (if it reads a row it touched).
    assert any(not torch.equal(outputs[k], plain[k]) for k in range(3, 6))


def test_new_iterator_continues_semi_sync_without_reset() -> None:
    first, second = make_batches(3, seed=1), make_batches(3, seed=2)
    model, ref = TinyModel(), TinyModel()
    pipeline = semi_sync(model, start_batch=1, stash_gradients=True)
    outputs = drain(pipeline, iter(first)) + drain(pipeline, iter(second))
    assert_same_training(outputs, reference(ref, first + second, 1, True), model, ref)


def test_detach_attach_mid_epoch_keeps_the_looked_up_batch() -> None:
    batches = make_batches(6)
    model, ref = TinyModel(), TinyModel()
    pipeline = semi_sync(model, start_batch=1)
    it = iter(batches)
    outputs = [pipeline.progress(it) for _ in range(3)]
    pipeline.detach()
    assert not getattr(model.sparse, "is_pipelined", False)
    pipeline.attach()
    outputs += drain(pipeline, it)
    assert_same_training(outputs, reference(ref, batches, 1, False), model, ref)


class UnusedEmbeddings(TinyModel):
    """Calls the sharded module but the loss ignores its output."""

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        self.sparse(batch.sparse).values()
        embedded = torch.zeros(batch.dense.shape[0], 8)
        return _head(self, embedded, batch)


def test_unused_embeddings_get_no_gradient(caplog: pytest.LogCaptureFixture) -> None:
    model = UnusedEmbeddings()
    table = model.sparse.bag.weight.detach().clone()
    with caplog.at_level(logging.WARNING):
        drain(semi_sync(model, start_batch=0), iter(make_batches(3)))
    assert torch.equal(model.sparse.bag.weight, table)
    unused = [r for r in caplog.records if "no gradient reaches" in r.getMessage()]
    assert len(unused) == 1 and "f0" in unused[0].getMessage()


def test_grad_swap_never_applies_a_gradient_twice() -> None:
    model = TinyModel()
    pipeline = semi_sync(model)
    weight = model.over.weight
    g1 = torch.ones_like(weight)
    weight.grad = g1
    pipeline._grad_swap()
    assert weight.grad is None  # nothing stashed before
    pipeline._grad_swap()  # this batch gave the weight no gradient ...
    assert torch.equal(weight.grad, g1)  # ... the previous one is applied once
    weight.grad = None
    pipeline._grad_swap()
    assert weight.grad is None  # upstream would apply g1 a second time here


# ------------------------------------------------------ optimizer sharing


def dense_optimizer(model: TinyModel) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        [p for name, p in model.named_parameters() if not name.startswith("sparse.")], lr=0.1
    )


def test_strict_rejects_an_optimizer_holding_embedding_parameters() -> None:
    model = TinyModel()
    pipeline = semi_sync(model, strict=True)
    with pytest.raises(ValueError, match="in_backward_optimizer_filter.*strict=False"):
        pipeline.progress(iter(make_batches(3)))


def test_shared_parameters_warn_without_strict(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        outputs = drain(semi_sync(TinyModel()), iter(make_batches(2)))
    assert len(outputs) == 2
    expected = "holds parameters of the pipelined module(s) ['sparse']"
    assert any(expected in r.getMessage() for r in caplog.records)


def test_dense_optimizer_passes_strict(caplog: pytest.LogCaptureFixture) -> None:
    model = TinyModel()
    pipeline = TrainPipelineSemiSync(model, dense_optimizer(model), CPU, strict=True)
    with caplog.at_level(logging.WARNING):
        assert len(drain(pipeline, iter(make_batches(3)))) == 3
    assert not any("holds parameters" in r.getMessage() for r in caplog.records)


def test_constructor_matches_torchrec() -> None:
    ours = inspect.signature(TrainPipelineSemiSync.__init__).parameters
    theirs = inspect.signature(UpstreamSemiSync.__init__).parameters
    assert [(p.name, p.default) for p in ours.values()][: len(theirs)] == [
        (p.name, p.default) for p in theirs.values()
    ]
    extra = list(ours.values())[len(theirs) :]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)


@dataclass
class Envelope(Pipelineable):
    """A loader item that carries the model's input inside it."""

    inner: Batch

    def to(self, device: torch.device, non_blocking: bool = False) -> "Envelope":
        return Envelope(self.inner.to(device, non_blocking))

    def record_stream(self, stream: torch.Stream) -> None:
        self.inner.record_stream(stream)


class Unwrapping(TrainPipelineSemiSync):
    def extract_model_input_from_batch(self, batch: Any) -> Any:
        return batch.inner


def test_extract_model_input_feeds_input_dist() -> None:
    batches = make_batches(4)
    model, ref = TinyModel(), TinyModel()
    pipeline = Unwrapping(
        model,
        optimizer_for(model),
        CPU,
        start_batch=1,
        custom_model_fwd=lambda envelope: model(envelope.inner),
        rewrite_strategy="fx",
    )
    # FX binds the module to ``batch.sparse`` of the model's input, which only
    # the extracted input has.
    outputs = drain(pipeline, iter([Envelope(b) for b in batches]))
    assert [v for op, v in model.log if op == "input_dist"] == feature_sums(batches)
    assert_same_training(outputs, reference(ref, batches, 1, False), model, ref)


# ------------------------------------------------- stream hand-offs (as on CUDA)


IDS = len(FEATURES) * 3  # one id per sample and feature


class MarkedBatch(Batch):
    """Batch k holds only id k; copies and ``record_stream`` are logged."""

    log: List[Tuple[Any, ...]] = []

    @property
    def k(self) -> int:
        return int(self.sparse.values().sum()) // IDS

    def to(self, device: torch.device, non_blocking: bool = False) -> "MarkedBatch":
        MarkedBatch.log.append(("h2d", self.k))
        return self

    def record_stream(self, stream: Any) -> None:
        MarkedBatch.log.append(("record_stream", "batch", self.k, stream.name))


def marked_batches(n: int) -> List[MarkedBatch]:
    out = []
    for k, plain in enumerate(make_batches(n)):
        kjt = KeyedJaggedTensor(
            keys=FEATURES,
            values=torch.full((IDS,), k),
            lengths=torch.ones(IDS, dtype=torch.long),
        )
        out.append(MarkedBatch(plain.dense, kjt, plain.labels))
    return out


def run_on_fake_cuda(
    n: int, start_batch: int, monkeypatch: pytest.MonkeyPatch
) -> List[Tuple[Any, ...]]:
    log: List[Tuple[Any, ...]] = []
    MarkedBatch.log = log

    # CPU tensors can't record a fake stream; log that they were asked to.
    def record_stream(tensor: torch.Tensor, stream: Any) -> None:
        log.append(("record_stream", "tensor", stream.name))

    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    model = TinyModel()
    model.sparse.log = log  # input_dist / compute land in the same log
    with streams.use_device_module(FakeCuda(log)):
        pipeline = TrainPipelineSemiSync(
            model, dense_optimizer(model), CPU, start_batch=start_batch
        )
        for role in ("memcpy", "data_dist"):
            getattr(pipeline._streams, role).name = role
        assert len(drain(pipeline, iter(marked_batches(n)))) == n
    return log


@pytest.mark.parametrize("start", [0, 2, 100], ids=["semi", "switch", "sync"])
def test_stream_protocol(start: int, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 5
    log = run_on_fake_cuda(n, start, monkeypatch)
    copy_event = {}
    for k in range(n):
        # The copy of batch k is marked by an event on memcpy right after it ...
        at = log.index(("h2d", k))
        assert log[at + 1][:2] == ("record_event", "memcpy")
        copy_event[k] = log[at + 1][2]
        # ... input_dist waits for the memcpy stream on data_dist ...
        start_dist = log.index(("input_dist", IDS * k))
        assert log[start_dist - 2 : start_dist] == [
            ("wait_stream", "data_dist", "memcpy"),
            ("record_stream", "batch", k, "data_dist"),
        ]
        # ... the lookup makes default wait for data_dist (where the tensors
        # all-to-all completed) and keeps its input alive there, then computes ...
        compute = log.index(("compute", IDS * k))
        before = log[:compute]
        handed = len(before) - 1 - before[::-1].index(("wait_stream", "default", "data_dist"))
        assert handed > start_dist
        assert set(log[handed + 1 : compute]) == {("record_stream", "tensor", "default")}
        # ... and the forward waits for exactly batch k's copy event, then
        # keeps the batch alive on default.
        waited = log.index(("record_stream", "batch", k, "default"))
        assert log[waited - 1] == ("wait_event", "default", copy_event[k])
    # Never the whole memcpy stream on default (that would wait for later copies).
    assert ("wait_stream", "default", "memcpy") not in log
