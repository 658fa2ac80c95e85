"""Stream helpers: everything is None / a no-op on CPU; real calls go to the device module."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, List, Tuple

import pytest
import torch
from torchrec.distributed.types import LazyAwaitable

from trec_pipelines.core import streams


def test_cpu_has_no_side_streams() -> None:
    cpu = torch.device("cpu")
    stream_set = streams.make_streams(
        cpu, memcpy=True, data_dist=True, prefetch=True, emb_lookup=True
    )
    assert stream_set == streams.StreamSet()
    assert streams.current_stream(cpu) is None
    assert streams.record_event(None) is None
    with streams.on_stream(None):
        pass
    tensor = torch.ones(2)
    streams.hand_off(tensor, None)
    streams.record_stream(tensor, None)
    streams.wait_stream(None, None)
    streams.wait_event(None, None)


class _Stream:
    def __init__(self, log: List[Tuple[str, ...]], name: str) -> None:
        self.log, self.name, self.device = log, name, torch.device("cuda")

    def wait_stream(self, other: "_Stream") -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: Any) -> None:
        self.log.append(("wait_event", self.name, event.name))


class _Event:
    def __init__(self, log: List[Tuple[str, ...]]) -> None:
        self.log, self.name = log, "event"

    def record(self, stream: _Stream) -> None:
        self.log.append(("record_event", stream.name))


class _DeviceModule:
    def __init__(self) -> None:
        self.log: List[Tuple[str, ...]] = []
        self.count = 0
        self.default = _Stream(self.log, "default")

    def Stream(self, priority: int = 0) -> _Stream:
        self.count += 1
        return _Stream(self.log, f"side{self.count}")

    def current_stream(self) -> _Stream:
        return self.default

    def Event(self) -> _Event:
        return _Event(self.log)


class _Recorded:
    def __init__(self, log: List[Tuple[str, ...]]) -> None:
        self.log = log

    def record_stream(self, stream: _Stream) -> None:
        self.log.append(("record_stream", stream.name))


def test_helpers_call_the_device_module() -> None:
    fake = _DeviceModule()
    with streams.use_device_module(fake):
        side = streams.make_streams(torch.device("cpu"), memcpy=True).memcpy
        assert side is not None
        streams.hand_off(_Recorded(fake.log), side)  # type: ignore[arg-type]
        event = streams.record_event(side)  # type: ignore[arg-type]
        streams.wait_event(streams.current_stream(torch.device("cpu")), event)
    assert fake.log == [
        ("wait_stream", "default", "side1"),
        ("record_stream", "default"),
        ("record_event", "side1"),
        ("wait_event", "default", "event"),
    ]
    assert streams.current_stream(torch.device("cpu")) is None  # override is gone


def test_lookup_outputs_of_both_kinds_are_recorded(monkeypatch: Any) -> None:
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

    from trec_pipelines.sparse.forwards import record_output

    seen: List[Tuple[int, str]] = []
    monkeypatch.setattr(
        torch.Tensor, "record_stream", lambda t, s: seen.append((t.numel(), s.name))
    )
    consumer = _Stream([], "default")
    keyed = KeyedTensor(keys=["a"], length_per_key=[2], values=torch.zeros(3, 2))
    jagged = {"a": JaggedTensor(values=torch.zeros(5), lengths=torch.tensor([2, 3]))}
    record_output(keyed, consumer)  # type: ignore[arg-type]
    record_output(jagged, consumer)  # type: ignore[arg-type]
    assert (6, "default") in seen and (5, "default") in seen


class _HeldRequest:
    """A request as torchrec's all-to-alls hold one: buffers in attributes, one nested."""

    def __init__(self) -> None:
        self.tensor: Any = torch.zeros(7)
        self.info = SimpleNamespace(splits=[torch.zeros(2)], by_name={"sizes": torch.zeros(3)})
        self.again = self  # a cycle is walked once


class _Lazy(LazyAwaitable[torch.Tensor]):
    """Waits (and says so) the moment an attribute it lacks is looked up."""

    def __init__(self) -> None:
        super().__init__()
        self.request = _HeldRequest()
        self.waited = False

    def _wait_impl(self) -> torch.Tensor:
        self.waited = True
        return torch.zeros(1)


def test_record_stream_held_records_what_an_awaitable_holds_without_waiting_it(
    monkeypatch: Any,
) -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    seen: List[int] = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: seen.append(t.numel()))
    consumer = _Stream([], "default")
    consumer.device = torch.device("cpu")  # the tensors' device type
    lazy = _Lazy()
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.zeros(4), lengths=torch.tensor([4]))
    holder = SimpleNamespace(
        awaitable=lazy,
        features=kjt,
        module=torch.nn.Linear(2, 2),
        elsewhere=torch.zeros(9, device="meta"),  # another device type: not this stream's
    )
    assert streams.record_stream_held(holder, consumer) == 4  # type: ignore[arg-type]
    assert sorted(seen) == [1, 2, 3, 4, 7]  # the KJT records its values and lengths
    assert not lazy.waited  # no attribute lookup that would wait for it
    assert streams.record_stream_held(holder, None) == 0  # no streams (CPU): nothing
    seen.clear()
    assert streams.record_stream_held(holder, consumer, depth=1) == 1  # type: ignore[arg-type]
    assert sorted(seen) == [1, 4]  # only the KJT is one level down; a module is not entered


class _SmallPool(_DeviceModule):
    """A stream pool of ``size`` streams that wraps around (as a small ROCm pool
    does), optionally starting with the default stream itself."""

    def __init__(self, size: int, first_is_default: bool = False) -> None:
        super().__init__()
        self.pool = [_Stream(self.log, f"pooled{i}") for i in range(size)]
        if first_is_default:
            self.pool[0] = self.default

    def Stream(self, priority: int = 0) -> _Stream:
        self.count += 1
        return self.pool[(self.count - 1) % len(self.pool)]


def test_every_role_gets_a_stream_of_its_own() -> None:
    with streams.use_device_module(_DeviceModule()):
        made = streams.make_streams(
            torch.device("cpu"), memcpy=True, data_dist=True, prefetch=True, emb_lookup=True
        )
    roles = [made.memcpy, made.data_dist, made.prefetch, made.emb_lookup]
    assert len({id(s) for s in roles}) == 4


@pytest.mark.parametrize(
    "pool,clash",
    [
        (_SmallPool(1), "data_dist stream and its memcpy stream"),
        (_SmallPool(2), "prefetch stream and its memcpy stream"),
        (_SmallPool(3, first_is_default=True), "memcpy stream and its default stream"),
    ],
)
def test_a_stream_pool_that_wraps_around_is_refused(pool: _SmallPool, clash: str) -> None:
    with streams.use_device_module(pool), pytest.raises(RuntimeError, match=clash):
        streams.make_streams(torch.device("cpu"), memcpy=True, data_dist=True, prefetch=True)


def test_a_pipeline_on_an_aliased_stream_pool_is_refused_through_the_recording_backend() -> None:
    """The recording backend stands in for the device: when its pool hands out one
    stream for every role, the pipeline's constructor says so instead of running
    a schedule whose cross-stream waits order nothing."""
    from tests.unit.fakes import TinyModel, optimizer_for
    from trec_pipelines import PrefetchTrainPipelineSparseDist, TrainPipelineSparseDist
    from trec_pipelines.testing import StreamRecorder

    for cls in (TrainPipelineSparseDist, PrefetchTrainPipelineSparseDist):
        model = TinyModel()
        with StreamRecorder() as recorder:
            made = recorder.device.Stream(name="the only one")
            recorder.device.Stream = lambda *_, only=made, **__: only  # type: ignore[method-assign]
            with pytest.raises(RuntimeError, match="stream pool wrapped around"):
                cls(model, optimizer_for(model), torch.device("cpu"))
        with StreamRecorder():  # a healthy pool: the same pipeline builds
            cls(model, optimizer_for(model), torch.device("cpu"))
