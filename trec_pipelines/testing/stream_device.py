"""The stand-in for a device with streams that a stream recording runs on.

:class:`RecordingDevice` takes the place of ``torch.cuda`` inside
``with StreamRecorder():`` (see [Note: recording the stream protocol] in
:mod:`trec_pipelines.testing.stream_recorder`): it makes
:class:`RecordingStream` s and :class:`RecordingEvent` s, keeps each thread's
current stream, and reports every ordering call (``wait_stream``, an event's
``record`` and wait, ``synchronize``) to the recorder.  Nothing runs on its
streams: tensors stay on the CPU.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Iterator, List, Optional, Protocol

import torch


class StreamCalls(Protocol):
    """What the stand-in reports each ordering call to (a ``StreamRecorder``)."""

    def _wait_stream(self, stream: RecordingStream, producer: RecordingStream) -> None: ...

    def _record_event(self, event: RecordingEvent, stream: RecordingStream) -> None: ...

    def _wait_event(self, stream: RecordingStream, event: RecordingEvent) -> None: ...

    def _synchronize(
        self, stream: Optional[RecordingStream] = None, event: Optional[RecordingEvent] = None
    ) -> None: ...


class RecordingStream:
    """A stand-in ``torch.cuda.Stream``: its calls are recorded, nothing runs on it."""

    def __init__(
        self, device: "RecordingDevice", name: str, priority: int = 0, named: bool = True
    ) -> None:
        self._device = device
        self.name = name
        self.priority = priority
        self.device = device.device
        # False while the name is a placeholder the schedule recorder may replace by a role.
        self.named = named

    def wait_stream(self, stream: "RecordingStream") -> None:
        self._device.recorder._wait_stream(self, stream)

    def wait_event(self, event: "RecordingEvent") -> None:
        self._device.recorder._wait_event(self, event)

    def record_event(self, event: Optional["RecordingEvent"] = None) -> "RecordingEvent":
        event = event if event is not None else self._device.Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self._device.recorder._synchronize(stream=self)

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"RecordingStream({self.name!r})"


class RecordingEvent:
    """A stand-in ``torch.cuda.Event``."""

    def __init__(self, device: "RecordingDevice", number: int) -> None:
        self._device = device
        self.number = number
        self.recorded = False
        self._tick = 0  # the record index of the last record(), for elapsed_time

    def record(self, stream: Optional[RecordingStream] = None) -> None:
        self._device.recorder._record_event(self, stream or self._device.current_stream())

    def wait(self, stream: Optional[RecordingStream] = None) -> None:
        (stream or self._device.current_stream()).wait_event(self)

    def synchronize(self) -> None:
        self._device.recorder._synchronize(event=self)

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "RecordingEvent") -> float:
        # Milliseconds; one record is one microsecond of "device time".
        return (end._tick - self._tick) / 1e3

    def __repr__(self) -> str:
        return f"RecordingEvent(#{self.number})"


class RecordingDevice:
    """Stands in for ``torch.cuda``: streams, a per-thread current stream, events.

    The pipeline reaches it through :func:`trec_pipelines.core.streams.device_module`
    while the owning :class:`~trec_pipelines.testing.stream_recorder.StreamRecorder`
    is active.  Each thread starts on
    the default stream, as on CUDA.
    """

    def __init__(self, recorder: StreamCalls, device: torch.device) -> None:
        self.recorder = recorder
        self.device = device
        self.default = RecordingStream(self, "default")
        # Every stream made, default first (a role without a recorder stream names one of these).
        self.streams: List[RecordingStream] = [self.default]
        self._local = threading.local()
        self._stream_numbers = itertools.count(1)
        self._event_numbers = itertools.count(1)

    def Stream(  # noqa: N802 (torch.cuda's spelling)
        self, priority: int = 0, device: Any = None, *, name: Optional[str] = None
    ) -> RecordingStream:
        """A new side stream; ``name`` labels it in messages (else the pipeline's role, or "streamN")."""
        number = next(self._stream_numbers)
        stream = RecordingStream(self, name or f"stream{number}", priority, named=name is not None)
        self.streams.append(stream)
        return stream

    def stream_named(self, name: str) -> Optional[RecordingStream]:
        """The stream called ``name`` (the last one made, if several are)."""
        for stream in reversed(self.streams):
            if stream.named and stream.name == name:
                return stream
        return None

    def Event(  # noqa: N802
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> RecordingEvent:
        return RecordingEvent(self, next(self._event_numbers))

    def current_stream(self, device: Any = None) -> RecordingStream:
        stream: Optional[RecordingStream] = getattr(self._local, "stream", None)
        return stream if stream is not None else self.default

    def default_stream(self, device: Any = None) -> RecordingStream:
        return self.default

    def set_stream(self, stream: RecordingStream) -> None:
        self._local.stream = stream

    @contextlib.contextmanager
    def stream(self, stream: Optional[RecordingStream]) -> Iterator[None]:
        if stream is None:
            yield
            return
        previous = self.current_stream()
        self.set_stream(stream)
        try:
            yield
        finally:
            self.set_stream(previous)

    def synchronize(self, device: Any = None) -> None:
        self.recorder._synchronize()

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0


__all__ = ["RecordingDevice", "RecordingEvent", "RecordingStream", "StreamCalls"]
