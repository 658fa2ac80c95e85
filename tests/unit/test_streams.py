"""Stream helpers: everything is None / a no-op on CPU; real calls go to the device module."""

from __future__ import annotations

from typing import Any, List, Tuple

import torch

from trec_pipelines import streams


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

    from trec_pipelines.forwards import record_output

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
