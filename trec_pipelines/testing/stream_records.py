"""The records of a stream recording, and what the checker reads of a recording.

:class:`~trec_pipelines.testing.stream_recorder.StreamRecorder` writes these
records; :mod:`trec_pipelines.testing.stream_checker` replays them.  They live
here, apart from both, so that the checker needs nothing of the recorder but
its records, and the recorder can offer ``check()`` without a circle.

A record names its stream and event as the recorder's stand-ins
(``RecordingStream``, ``RecordingEvent``); here they are typed by what the
records and the checker use of them (:class:`StreamLike`, :class:`EventLike`):
their identity, and a name or number for messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Protocol, Sequence, Tuple, Union

import torch


class StreamLike(Protocol):
    """A stream as records hold it: compared by identity, named in messages."""

    @property
    def name(self) -> str: ...


class EventLike(Protocol):
    """An event as records hold it: compared by identity, numbered in messages."""

    @property
    def number(self) -> int: ...


@dataclass(frozen=True)
class Span:
    """A schedule-recorder span (one pipeline verb) as the stream record saw it.

    ``role`` is the stream role the pipeline recorded the verb on; ``stream``
    the stand-in stream that role names in the pipeline's recorder (``None``
    when the role is not one of the recorder's, e.g. a staged pipeline's
    stage name).
    """

    call: int
    task: str
    batch: Optional[int]
    role: str
    thread: str
    stream: Optional[StreamLike]

    def __str__(self) -> str:
        batch = "--" if self.batch is None else f"i{self.batch}"
        return f"P{self.call} {self.task}[{batch}]@{self.role}"


@dataclass(frozen=True)
class Where:
    """When and where a record was made: its position, thread, span and step."""

    index: int
    thread: str
    span: Optional[Span]
    call: int

    def __str__(self) -> str:
        if self.span is not None:
            return f"step {self.span} (progress call {self.span.call}, task {self.span.task})"
        if self.call < 0:
            return "before the first progress call"
        return f"progress call {self.call}, outside any recorded task"


@dataclass(frozen=True)
class TensorInfo:
    """The first tensor seen on a storage: how a message names it."""

    storage: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    external: bool

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        shape = ", ".join(str(s) for s in self.shape)
        return f"tensor {dtype}[{shape}] (storage #{self.storage})"


@dataclass(frozen=True)
class OpRecord:
    """A kernel: ``op`` issued on ``stream``, reading, writing and allocating storages."""

    where: Where
    stream: StreamLike
    op: str
    reads: Tuple[int, ...]
    writes: Tuple[int, ...]
    allocs: Tuple[int, ...]


@dataclass(frozen=True)
class WaitStreamRecord:
    """``stream.wait_stream(producer)``: later work on ``stream`` waits for ``producer``'s so far."""

    where: Where
    stream: StreamLike
    producer: StreamLike


@dataclass(frozen=True)
class RecordEventRecord:
    """``event.record(stream)``: the event now marks the work issued to ``stream`` so far."""

    where: Where
    stream: StreamLike
    event: EventLike


@dataclass(frozen=True)
class WaitEventRecord:
    """``stream.wait_event(event)``: later work on ``stream`` waits for what ``event`` marks."""

    where: Where
    stream: StreamLike
    event: EventLike


@dataclass(frozen=True)
class RecordStreamRecord:
    """``record_stream(stream)`` on the tensor whose storage is ``storage``."""

    where: Where
    storage: int
    stream: Any  # a RecordingStream, or whatever else the caller passed


@dataclass(frozen=True)
class FreeRecord:
    """The storage was freed by the CPU before the record at ``where.index``."""

    where: Where
    storage: int


@dataclass(frozen=True)
class SyncRecord:
    """The CPU waited for ``stream``, ``event``, or (both None) the whole device."""

    where: Where
    stream: Optional[StreamLike]
    event: Optional[EventLike]


@dataclass(frozen=True)
class SpanRecord:
    """A pipeline verb starts (``enter``) or ends."""

    where: Where
    span: Span
    enter: bool


Record = Union[
    OpRecord,
    WaitStreamRecord,
    RecordEventRecord,
    WaitEventRecord,
    RecordStreamRecord,
    FreeRecord,
    SyncRecord,
    SpanRecord,
]


class Recording(Protocol):
    """What a check reads of a recording; a ``StreamRecorder`` is one.

    Attributes:
        records: everything recorded, in the order the CPU issued it.
        tensors: storage number -> the first tensor seen on that storage.
        spans: every recorded span, in the order the verbs started.
    """

    @property
    def records(self) -> Sequence[Record]: ...

    @property
    def tensors(self) -> Mapping[int, TensorInfo]: ...

    @property
    def spans(self) -> List[Span]: ...


__all__ = [
    "EventLike",
    "FreeRecord",
    "OpRecord",
    "Record",
    "RecordEventRecord",
    "RecordStreamRecord",
    "Recording",
    "Span",
    "SpanRecord",
    "StreamLike",
    "SyncRecord",
    "TensorInfo",
    "WaitEventRecord",
    "WaitStreamRecord",
    "Where",
]
