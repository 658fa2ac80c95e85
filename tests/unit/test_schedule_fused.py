"""TrainPipelineFusedSparseDist and EvalPipelineFusedSparseDist on the fake model.

Exact recorded schedules (fill, steady state, drain, loaders of 0..3
batches), results against plain loops, and the stream protocol replayed on a
recording stand-in for a device with streams.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import pytest
import torch

from tests.unit.fakes import (
    TinyModel,
    assert_same_training,
    drain,
    make_batches,
    optimizer_for,
    plain_loop,
)
from trec_pipelines.core import streams
from trec_pipelines.observe.recorder import ScheduleRecorder
from trec_pipelines.pipelines.eval_fused_sparse_dist import EvalPipelineFusedSparseDist
from trec_pipelines.pipelines.fused_sparse_dist import TrainPipelineFusedSparseDist

CPU = torch.device("cpu")


def fused(model: torch.nn.Module, **kwargs: Any) -> TrainPipelineFusedSparseDist:
    return TrainPipelineFusedSparseDist(model, optimizer_for(model), CPU, **kwargs)


def eval_fused(model: torch.nn.Module, **kwargs: Any) -> EvalPipelineFusedSparseDist:
    model.eval()
    return EvalPipelineFusedSparseDist(model, optimizer_for(model), CPU, **kwargs)


def recorded(make: Callable[..., Any], n_batches: int, **kwargs: Any) -> List[str]:
    pipeline = make(TinyModel(), **kwargs)
    pipeline.enable_schedule_recording()
    outputs = drain(pipeline, iter(make_batches(n_batches)))
    assert len(outputs) == n_batches
    return [str(action) for action in pipeline.schedule_actions]


def steady(call: int, i: int, template: Sequence[str]) -> List[str]:
    return [s.format(P=call, i=i, n=i + 1, m=i + 2) for s in template]


def only_batches_below(n: int, actions: List[str]) -> List[str]:
    """Drop the actions on batches the loader never yielded."""
    return [a for a in actions if int(a.split("[i")[1].split("]")[0]) < n]


FILL = [
    "P0 H2D[i0]@memcpy",
    "P0 InputDistStart[i0]@data_dist",
    "P0 InputDistWait[i0]@data_dist",
    "P0 H2D[i1]@memcpy",
]

FUSED_STEP = (
    "P{P} EmbLookup[i{i}]@data_dist",
    "P{P} ZeroGrad[i{i}]@default",
    "P{P} WaitBatch[i{i}]@default",
    "P{P} InputDistStart[i{n}]@data_dist",
    "P{P} H2D[i{m}]@memcpy",
    "P{P} Forward[i{i}]@default",
    "P{P} InputDistWait[i{n}]@data_dist",
    "P{P} Backward[i{i}]@default",
    "P{P} OptimizerStep[i{i}]@default",
)

EVAL_STEP = (
    "P{P} EmbLookup[i{i}]@data_dist",
    "P{P} WaitBatch[i{i}]@default",
    "P{P} InputDistStart[i{n}]@data_dist",
    "P{P} H2D[i{m}]@memcpy",
    "P{P} Forward[i{i}]@default",
    "P{P} InputDistWait[i{n}]@data_dist",
)

PREFETCH_FILL = [
    "P0 H2D[i0]@memcpy",
    "P0 InputDistStart[i0]@data_dist",
    "P0 InputDistWait[i0]@data_dist",
    "P0 EmbLookup[i0]@data_dist",
    "P0 H2D[i1]@memcpy",
]

PREFETCH_STEP = (
    "P{P} WaitBatch[i{i}]@default",
    "P{P} InputDistStart[i{n}]@data_dist",
    "P{P} H2D[i{m}]@memcpy",
    "P{P} Forward[i{i}]@default",
    "P{P} InputDistWait[i{n}]@data_dist",
    "P{P} EmbLookup[i{n}]@data_dist",
)


def expected(fill: List[str], step: Sequence[str], n: int) -> List[str]:
    actions = list(fill)
    for i in range(n):
        actions += steady(i, i, step)
    return only_batches_below(n, actions)


# ------------------------------------------------------------------ Fused


def test_fused_fill_steady_drain() -> None:
    expected_actions = list(FILL)
    for i in range(3):
        expected_actions += steady(i, i, FUSED_STEP)
    # P3: batch 4 is copied already, nothing left to copy
    expected_actions += [a for a in steady(3, 3, FUSED_STEP) if "H2D" not in a]
    # P4: the last batch trains alone
    expected_actions += [
        "P4 EmbLookup[i4]@data_dist",
        "P4 ZeroGrad[i4]@default",
        "P4 WaitBatch[i4]@default",
        "P4 Forward[i4]@default",
        "P4 Backward[i4]@default",
        "P4 OptimizerStep[i4]@default",
    ]
    assert recorded(fused, 5) == expected_actions


def test_fused_one_batch_exactly() -> None:
    assert recorded(fused, 1) == [
        "P0 H2D[i0]@memcpy",
        "P0 InputDistStart[i0]@data_dist",
        "P0 InputDistWait[i0]@data_dist",
        "P0 EmbLookup[i0]@data_dist",
        "P0 ZeroGrad[i0]@default",
        "P0 WaitBatch[i0]@default",
        "P0 Forward[i0]@default",
        "P0 Backward[i0]@default",
        "P0 OptimizerStep[i0]@default",
    ]


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_fused_short_loaders(n: int) -> None:
    actions = recorded(fused, n)
    assert actions == expected(FILL, FUSED_STEP, n)
    assert [a for a in actions if "Forward" in a] == [
        f"P{i} Forward[i{i}]@default" for i in range(n)
    ]


@pytest.mark.parametrize(
    "choice, role", [("data_dist", "data_dist"), ("new", "emb_lookup"), ("current", "default")]
)
def test_fused_lookup_stream_choice(choice: str, role: str) -> None:
    step = [s.replace("@data_dist", f"@{role}") if "EmbLookup" in s else s for s in FUSED_STEP]
    assert recorded(fused, 4, emb_lookup_stream=choice) == expected(FILL, step, 4)


def test_fused_lookup_after_data_dist_moves_only_the_lookup() -> None:
    step = list(FUSED_STEP)
    step.remove("P{P} EmbLookup[i{i}]@data_dist")
    step.insert(step.index("P{P} H2D[i{m}]@memcpy") + 1, "P{P} EmbLookup[i{i}]@data_dist")
    assert recorded(fused, 4, embedding_lookup_after_data_dist=True) == expected(FILL, step, 4)


def test_fused_enqueue_after_forward_moves_only_the_copy() -> None:
    step = list(FUSED_STEP)
    step.remove("P{P} H2D[i{m}]@memcpy")
    step.insert(step.index("P{P} Forward[i{i}]@default") + 1, "P{P} H2D[i{m}]@memcpy")
    assert recorded(fused, 4, enqueue_batch_after_forward=True) == expected(FILL, step, 4)


def test_fused_rejects_unknown_lookup_stream() -> None:
    model = TinyModel()
    with pytest.raises(ValueError, match="'data_dist', 'new', 'current'.*got 'side'"):
        fused(model, emb_lookup_stream="side")


def test_fused_matches_plain_loop() -> None:
    batches = make_batches(6)
    model, ref_model = TinyModel(), TinyModel()
    ours = drain(fused(model), iter(batches))
    assert_same_training(ours, plain_loop(ref_model, batches), model, ref_model)


def test_fused_lookup_runs_before_the_forward() -> None:
    """The module's compute for batch i runs in EmbLookup; the forward only picks it up."""
    model = TinyModel()
    batches = make_batches(4)
    computed_before_forward: List[List[int]] = []

    def forward(batch: Any) -> Any:
        computed_before_forward.append([ids for verb, ids in model.log if verb == "compute"])
        return model(batch)

    pipeline = fused(model, custom_model_fwd=forward)
    assert len(drain(pipeline, iter(batches))) == 4
    sums = [int(b.sparse.values().sum()) for b in batches]
    assert computed_before_forward == [sums[: i + 1] for i in range(4)]
    assert [ids for verb, ids in model.log if verb == "compute"] == sums


# ------------------------------------------------------------------- Eval


def test_eval_in_order_fill_steady_drain() -> None:
    expected_actions = list(FILL)
    for i in range(3):
        expected_actions += steady(i, i, EVAL_STEP)
    expected_actions += [a for a in steady(3, 3, EVAL_STEP) if "H2D" not in a]
    expected_actions += [
        "P4 EmbLookup[i4]@data_dist",
        "P4 WaitBatch[i4]@default",
        "P4 Forward[i4]@default",
    ]
    assert recorded(eval_fused, 5) == expected_actions


def test_eval_prefetch_fill_steady_drain() -> None:
    expected_actions = list(PREFETCH_FILL)
    for i in range(3):
        expected_actions += steady(i, i, PREFETCH_STEP)
    expected_actions += [a for a in steady(3, 3, PREFETCH_STEP) if "H2D" not in a]
    # P4: batch 4's lookup was started by P3
    expected_actions += ["P4 WaitBatch[i4]@default", "P4 Forward[i4]@default"]
    assert recorded(eval_fused, 5, enable_embedding_lookup_prefetch=True) == expected_actions


def test_eval_prefetch_one_batch_exactly() -> None:
    assert recorded(eval_fused, 1, enable_embedding_lookup_prefetch=True) == [
        "P0 H2D[i0]@memcpy",
        "P0 InputDistStart[i0]@data_dist",
        "P0 InputDistWait[i0]@data_dist",
        "P0 EmbLookup[i0]@data_dist",
        "P0 WaitBatch[i0]@default",
        "P0 Forward[i0]@default",
    ]


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_eval_short_loaders(n: int) -> None:
    assert recorded(eval_fused, n) == expected(FILL, EVAL_STEP, n)
    assert recorded(eval_fused, n, enable_embedding_lookup_prefetch=True) == expected(
        PREFETCH_FILL, PREFETCH_STEP, n
    )


def test_eval_ignores_enqueue_after_forward_like_upstream() -> None:
    assert recorded(eval_fused, 4, enqueue_batch_after_forward=True) == expected(FILL, EVAL_STEP, 4)


def test_eval_lookup_after_data_dist() -> None:
    step = list(EVAL_STEP)
    step.remove("P{P} EmbLookup[i{i}]@data_dist")
    step.insert(step.index("P{P} H2D[i{m}]@memcpy") + 1, "P{P} EmbLookup[i{i}]@data_dist")
    assert recorded(eval_fused, 4, embedding_lookup_after_data_dist=True) == expected(FILL, step, 4)


@pytest.mark.parametrize("prefetch", [False, True])
def test_eval_matches_no_grad_loop_and_keeps_weights(prefetch: bool) -> None:
    batches = make_batches(5)
    model, ref_model = TinyModel(), TinyModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ours = drain(eval_fused(model, enable_embedding_lookup_prefetch=prefetch), iter(batches))
    ref_model.eval()
    with torch.no_grad():
        ref = [ref_model(batch)[1] for batch in batches]
    assert len(ours) == len(ref) == 5
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert torch.equal(a, b), f"output differs at step {step}"
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"eval changed {name}"


def test_eval_in_training_mode_zero_grads_but_never_steps() -> None:
    model = TinyModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pipeline = EvalPipelineFusedSparseDist(model, optimizer_for(model), CPU)
    pipeline.enable_schedule_recording()
    drain(pipeline, iter(make_batches(3)))
    tasks = [a.task for a in pipeline.schedule_actions]
    assert tasks.count("ZeroGrad") == 3
    assert "Backward" not in tasks and "OptimizerStep" not in tasks
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"eval changed {name}"


def test_eval_needs_no_optimizer() -> None:
    model = TinyModel().eval()
    pipeline = EvalPipelineFusedSparseDist(model, None, CPU, enable_embedding_lookup_prefetch=True)
    assert len(drain(pipeline, iter(make_batches(3)))) == 3


def test_eval_second_epoch_without_reset() -> None:
    model = TinyModel()
    pipeline = eval_fused(model, enable_embedding_lookup_prefetch=True)
    batches = make_batches(3)
    first = drain(pipeline, iter(batches))
    second = drain(pipeline, iter(batches))
    assert len(first) == 3
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------- the stream protocol
#
# A stand-in device module records every stream call; the recorder's spans go
# to the same log, so each call can be attributed to the verb that made it.


class _Stream:
    def __init__(self, log: List[Tuple[str, ...]], name: str) -> None:
        self.log, self.name, self.device = log, name, torch.device("cpu")

    def wait_stream(self, other: "_Stream") -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: "_Event") -> None:
        self.log.append(("wait_event", self.name, event.name))


class _Event:
    def __init__(self, log: List[Tuple[str, ...]], name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream: _Stream) -> None:
        self.log.append(("record_event", stream.name, self.name))


class _DeviceModule:
    def __init__(self) -> None:
        self.log: List[Tuple[str, ...]] = []
        self.streams = 0
        self.events = 0
        self.default = _Stream(self.log, "default")

    def Stream(self, priority: int = 0) -> _Stream:
        self.streams += 1
        return _Stream(self.log, f"side{self.streams}")

    def current_stream(self) -> _Stream:
        return self.default

    def Event(self) -> _Event:
        self.events += 1
        return _Event(self.log, f"e{self.events}")

    def stream(self, stream: _Stream) -> Any:
        return contextlib.nullcontext()


class _LoggingRecorder(ScheduleRecorder):
    def __init__(self, log: List[Tuple[str, ...]]) -> None:
        super().__init__()
        self.log = log

    def span(self, task: str, batch: Optional[int], stream: str, thread: str = "main") -> Any:
        self.log.append(("span", task, str(batch)))
        return super().span(task, batch, stream, thread)


def _protocol_log(
    monkeypatch: pytest.MonkeyPatch, make: Callable[..., Any], n_batches: int, **kwargs: Any
) -> Tuple[List[Tuple[str, ...]], Any]:
    fake = _DeviceModule()

    def record_stream(tensor: torch.Tensor, stream: _Stream) -> None:
        fake.log.append(("record_stream", stream.name))

    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    with streams.use_device_module(fake):
        pipeline = make(TinyModel(), **kwargs)
        pipeline._recording.recorder = _LoggingRecorder(fake.log)
        outputs = drain(pipeline, iter(make_batches(n_batches)))
    assert len(outputs) == n_batches
    return fake.log, pipeline


def _span_body(log: List[Tuple[str, ...]], task: str, batch: int) -> List[Tuple[str, ...]]:
    """The stream calls made by the verb ``task`` on ``batch``."""
    start = log.index(("span", task, str(batch))) + 1
    end = next((k for k in range(start, len(log)) if log[k][0] == "span"), len(log))
    return log[start:end]


def _after(log: List[Tuple[str, ...]], task: str, batch: int) -> Iterator[Tuple[str, ...]]:
    start = log.index(("span", task, str(batch))) + 1
    return iter(log[start:])


@pytest.mark.parametrize("choice", ["new", "data_dist"])
def test_fused_stream_protocol(monkeypatch: pytest.MonkeyPatch, choice: str) -> None:
    log, pipeline = _protocol_log(monkeypatch, fused, 4, emb_lookup_stream=choice)
    lookup = pipeline._lookup_stream.name
    data_dist = pipeline._streams.data_dist.name
    assert lookup == (data_dist if choice == "data_dist" else pipeline._streams.emb_lookup.name)
    for i in range(4):
        body = _span_body(log, "EmbLookup", i)
        # 1. the lookup waits until the embedding rows are up to date:
        if i == 0:
            # before any backward, for everything issued to the default stream
            # so far (weight init, a loaded checkpoint)
            assert body[0][:2] == ("record_event", "default")
            assert body[1] == ("wait_event", lookup, body[0][2])
            body = body[1:]
        else:
            # then for the previous batch's backward (where the fused TBE
            # writes them), not for its optimizer step
            assert body[0][:2] == ("wait_event", lookup)
            after_backward = next(
                c for c in _after(log, "Backward", i - 1) if c[0] != "record_stream"
            )
            assert after_backward == ("record_event", "default", body[0][2])
        # 2. the lookup reads the tensors all-to-all's output after it is done
        if choice == "new":
            assert ("wait_stream", lookup, data_dist) in body
        # 3. its input is kept alive for the lookup stream and the default (backward) one
        assert ("record_stream", lookup) in body
        assert ("record_stream", "default") in body
        # 4. an event after the lookup, and the forward waits on exactly that
        assert body[-1][:2] == ("record_event", lookup)
        forward = _span_body(log, "Forward", i)
        assert forward[0] == ("wait_event", "default", body[-1][2])
        # 5. the forward keeps the lookup output alive on the default stream
        assert ("record_stream", "default") in forward
    # The lookup never waits for the whole default stream: it overlaps the step.
    assert not [c for c in log if c[:2] == ("wait_stream", lookup) and c[2] == "default"]


def test_fused_waits_for_user_work_after_detach(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _DeviceModule()
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    with streams.use_device_module(fake):
        pipeline = fused(TinyModel(), emb_lookup_stream="new")
        pipeline._recording.recorder = _LoggingRecorder(fake.log)
        it = iter(make_batches(4))
        pipeline.progress(it)
        pipeline.detach()
        mark = len(fake.log)
        pipeline.attach()
        pipeline.progress(it)
    body = _span_body(fake.log[mark:], "EmbLookup", 1)
    ready = body[0][2]
    # a fresh event on the default stream, recorded after the detach
    assert ("record_event", "default", ready) in fake.log[mark:]


def test_eval_prefetch_stream_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    log, pipeline = _protocol_log(
        monkeypatch, eval_fused, 4, emb_lookup_stream="new", enable_embedding_lookup_prefetch=True
    )
    lookup = pipeline._lookup_stream.name
    first = _span_body(log, "EmbLookup", 0)
    assert first[0][:2] == ("record_event", "default")
    first_ready = first[0][2]
    for i in range(4):
        body = _span_body(log, "EmbLookup", i)[1 if i == 0 else 0 :]
        # The weights never change in eval: every lookup waits on the event of
        # the first one, not on the forward before it, so lookup i+1 is free
        # to overlap forward i.
        assert body[0] == ("wait_event", lookup, first_ready)
        forward = _span_body(log, "Forward", i)
        assert forward[0] == ("wait_event", "default", body[-1][2])
    assert [c for c in log if c[0] == "record_event" and c[1] == "default"] == [
        ("record_event", "default", first_ready)
    ]
