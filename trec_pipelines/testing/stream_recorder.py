"""The stream recorder: run a pipeline on CPU, on a stand-in device with streams, and see
its stream protocol.

[Note: recording the stream protocol]
Inside ``with StreamRecorder() as recorder:`` every stream helper of
:mod:`trec_pipelines.core.streams` goes to a
:class:`~trec_pipelines.testing.stream_device.RecordingDevice`, a stand-in for
``torch.cuda`` (``streams.use_device_module``), so a pipeline built there
creates its side streams even with ``device=torch.device("cpu")``.  Tensors
stay on the CPU and every kernel runs at once; what is simulated is only the
ordering a GPU would see.  The recorder writes one record per event
(:data:`~trec_pipelines.testing.stream_records.Record`), in the order the CPU
issued them:

* every aten op, seen by a ``TorchDispatchMode`` in the recording thread and
  in every thread started during the recording, attributed to that thread's
  current (stand-in) stream, with the storages it reads, writes and allocates;
* every ``wait_stream``, event ``record``/wait and ``synchronize``;
* every ``record_stream`` (``torch.Tensor.record_stream`` is replaced by a
  logger for the duration: a CPU tensor cannot record a stand-in stream;
  torchrec's KJT/JaggedTensor/KeyedTensor call the tensor one);
* the free of a storage that was allocated on one stream and used on another
  (noticed before the next record, through a weak reference);
* the schedule recorder's spans and ``progress()`` calls, so each record
  knows the pipeline step and task it belongs to.

Tensors are identified by their storage: a view is its base, an in-place op
writes the storage.  A storage first seen as an input (the host batch, the
parameters, anything made before the recording) is *external*: it has no
producer, and only writes made during the recording are checked against it.

To model the host-to-device copy, ``.to(device)`` of an external tensor
(host memory) makes a copy (``copy=True``) while recording, so the device
batch is new memory allocated on the stream the copy was issued on, as on a
GPU.  A tensor made during the recording is "on the device" already, and
``.to(device)`` of it stays a no-op.

The recorder never changes what the pipeline computes, and no pipeline code
knows it is there: it only sees a device module with streams.
:func:`trec_pipelines.testing.stream_checker.check_stream_protocol` replays
the records against the rules of ``[Note: stream protocol]``
(:mod:`trec_pipelines.core.streams`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Set,
    Tuple,
    TypeVar,
)

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trec_pipelines.core import streams
from trec_pipelines.observe.recorder import Recordable, ScheduleRecorder
from trec_pipelines.testing.stream_checker import assert_stream_protocol, check_stream_protocol

# The stand-in device is also importable from here, where it was first defined.
from trec_pipelines.testing.stream_device import (
    RecordingDevice,
    RecordingEvent,
    RecordingStream,
)

# The record types are also importable from here, where they were first defined.
from trec_pipelines.testing.stream_records import (
    FreeRecord,
    OpRecord,
    Record,
    RecordEventRecord,
    RecordStreamRecord,
    Span,
    SpanRecord,
    SyncRecord,
    TensorInfo,
    WaitEventRecord,
    WaitStreamRecord,
    Where,
)

CPU = torch.device("cpu")

# ------------------------------------------------------------ the recorder


class _OpRecordingMode(TorchDispatchMode):
    """Reports every aten op (after it ran) to the recorder."""

    def __init__(self, recorder: "StreamRecorder") -> None:
        super().__init__()
        self._recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._recorder._op(func, args, kwargs, out)
        return out


@dataclass
class _Storage:
    sid: int
    ref: StorageWeakRef


# Ops that read only their inputs' metadata (shape, dtype, device), not the data.
def _reads_no_data(func: Any) -> bool:
    name = func._schema.name.split("::")[-1]
    return (
        name.endswith("_like") or name.startswith("new_") or name in ("empty_strided", "lift_fresh")
    )


def _is_view(func: Any) -> bool:
    schema = func._schema
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    return not writes and any(r.alias_info is not None for r in schema.returns)


def _device_argument(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """True when a ``Tensor.to(...)`` call names a device."""
    if "device" in kwargs and kwargs["device"] is not None:
        return True
    return bool(args) and isinstance(args[0], (torch.device, str, int))


_active: Optional["StreamRecorder"] = None

# A pipeline given to StreamRecorder.watch, handed back as the same type.
_Watched = TypeVar("_Watched", bound=Recordable)


class StreamRecorder:
    """Records the stream protocol of everything run inside ``with StreamRecorder() as r:``.

    Build the pipeline inside the ``with`` (its streams come from the
    stand-in device), and the model outside it (its parameters are then
    external and need no hand-off).  Call :meth:`watch` on the pipeline so its
    verbs are recorded too.  Then check the records with :meth:`check` or
    :meth:`assert_protocol`.

    Example::

        model = MyModel()  # before the recording: parameters are external
        with StreamRecorder() as recorder:
            pipeline = recorder.watch(TrainPipelineSparseDist(model, opt, torch.device("cpu")))
            for _ in range(4):
                pipeline.progress(it)
        recorder.assert_protocol()

    ``host_memory``: tensors that stay in host memory when the model runs on
    a real device, though everything is on the CPU here (fbgemm's embedding
    kernels keep their learning rate in a host tensor, ``learning_rate_tensor``,
    on every device: see :func:`host_memory_of`).  An op that touches only
    these (and what it makes of them) runs on the host in program order, so it
    is not a kernel of any stream and is left out of the record.

    Attributes:
        device: the :class:`RecordingDevice` the pipeline's streams come from.
        records: everything recorded, in the order the CPU issued it.
        tensors: storage number -> the first tensor seen on that storage.
    """

    def __init__(
        self, device: torch.device = CPU, *, host_memory: Iterable[torch.Tensor] = ()
    ) -> None:
        self.device = RecordingDevice(self, device)
        self.records: List[Record] = []
        self.tensors: Dict[int, TensorInfo] = {}
        self._lock = threading.RLock()
        self._storages: Dict[int, _Storage] = {}
        self._storage_numbers = itertools.count(1)
        self._refs: Dict[int, StorageWeakRef] = {}
        self._alloc_stream: Dict[int, RecordingStream] = {}
        # Storages allocated on one stream and used on another: their frees are recorded.
        self._watched: Dict[int, StorageWeakRef] = {}
        self._spans: Dict[int, List[Span]] = {}  # thread ident -> open spans
        self._call = -1
        self._recording = False
        self._stack: Optional[contextlib.ExitStack] = None
        # Storages that stay in host memory on a real device: work on them alone
        # runs on the CPU, in program order, on no stream.
        self._host_memory: Set[int] = set()
        for tensor in host_memory:
            sid, _ = self._storage(tensor, external=True)
            if sid is not None:
                self._host_memory.add(sid)

    # ------------------------------------------------------------- public

    def watch(self, pipeline: _Watched) -> _Watched:
        """Turn on ``pipeline``'s schedule recording (its verbs become spans); returns it.

        Read ``pipeline.schedule_actions`` only after the recording: it
        synchronizes on the timing events, which would be recorded as
        synchronization points.
        """
        side_streams = getattr(pipeline, "_streams", None)
        if isinstance(side_streams, streams.StreamSet) and side_streams == streams.StreamSet():
            raise ValueError(
                f"{type(pipeline).__name__} has no side streams: it was built outside the "
                "recording. Build it inside `with StreamRecorder():` so that its streams "
                "come from the recording device."
            )
        pipeline.enable_schedule_recording()
        return pipeline

    @property
    def spans(self) -> List[Span]:
        """Every recorded span, in the order the verbs started."""
        return [r.span for r in self.records if isinstance(r, SpanRecord) and r.enter]

    def check(self, schedule: Optional[List[Any]] = None, **options: Any) -> List[Any]:
        """The protocol violations of the records (see ``check_stream_protocol``)."""
        return check_stream_protocol(self, schedule, **options)

    def assert_protocol(self, schedule: Optional[List[Any]] = None, **options: Any) -> None:
        """Raise ``StreamProtocolError`` listing every violation (see ``assert_stream_protocol``)."""
        assert_stream_protocol(self, schedule, **options)

    # ------------------------------------------------------ enter / exit

    def __enter__(self) -> "StreamRecorder":
        global _active
        if _active is not None:
            raise RuntimeError(
                "a StreamRecorder is already recording and recordings do not nest: leave "
                "the first `with StreamRecorder()` block before starting another"
            )
        _active = self
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(streams.use_device_module(self.device))

            def record_stream(tensor: torch.Tensor, stream: Any) -> None:
                self._tensor_record_stream(tensor, stream)

            patches = [
                (torch.Tensor, "record_stream", record_stream),
                (torch.Tensor, "to", self._tensor_to(torch.Tensor.to)),
                (ScheduleRecorder, "span", self._span_hook(ScheduleRecorder.span)),
                (
                    ScheduleRecorder,
                    "begin_call",
                    self._begin_call_hook(ScheduleRecorder.begin_call),
                ),
                (threading.Thread, "run", self._thread_run(threading.Thread.run)),
            ]
            for owner, name, value in patches:
                stack.enter_context(_patched(owner, name, value))
            self._recording = True
            stack.callback(self._stop)
            stack.enter_context(_OpRecordingMode(self))
        except BaseException:
            stack.close()
            _active = None
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        global _active
        assert self._stack is not None
        try:
            with self._lock:
                self._poll_frees()  # what the run dropped last is part of the record
        finally:
            self._stack.close()
            self._stack = None
            _active = None

    def _stop(self) -> None:
        with self._lock:
            self._recording = False

    # ---------------------------------------------------------- helpers

    def _where(self) -> Where:
        thread = threading.current_thread()
        open_spans = self._spans.get(thread.ident or 0)
        span = open_spans[-1] if open_spans else None
        name = "main" if thread is threading.main_thread() else thread.name
        return Where(len(self.records), name, span, self._call)

    def _append(self, make: Callable[[Where], Record]) -> None:
        """Note any frees, then append the record ``make`` builds."""
        with self._lock:
            if not self._recording:
                return
            self._poll_frees()
            self.records.append(make(self._where()))

    def _poll_frees(self) -> None:
        for sid, ref in list(self._watched.items()):
            if ref.expired():
                del self._watched[sid]
                self.records.append(FreeRecord(self._where(), sid))

    def _storage(self, tensor: torch.Tensor, external: bool) -> Tuple[Optional[int], bool]:
        """``(storage number, first seen now)``, or ``(None, False)`` for a tensor without storage."""
        if tensor.device.type == "meta" or tensor.is_sparse or isinstance(tensor, FakeTensor):
            return None, False
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None, False  # a tensor subclass or fake tensor without real storage
        key = storage._cdata
        known = self._storages.get(key)
        # A weak reference keeps the storage object's address, so a live key is never reused.
        if known is not None and not known.ref.expired():
            return known.sid, False
        sid = next(self._storage_numbers)
        ref = StorageWeakRef(storage)
        self._storages[key] = _Storage(sid, ref)
        self._refs[sid] = ref
        self.tensors[sid] = TensorInfo(sid, tuple(tensor.shape), tensor.dtype, external)
        return sid, True

    def _is_host(self, tensor: torch.Tensor) -> bool:
        """True for memory not produced during the recording (the host batch, parameters)."""
        with self._lock:
            try:
                key = tensor.untyped_storage()._cdata
            except (RuntimeError, NotImplementedError):
                return False
            known = self._storages.get(key)
            if known is None or known.ref.expired():
                return True
            return self.tensors[known.sid].external

    # ------------------------------------------------------------- ops

    def _op(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> None:
        with self._lock:
            if not self._recording:
                return
            schema = func._schema
            if schema.name.startswith("profiler::"):
                return  # record_function markers: no device work
            self._poll_frees()
            stream = self.device.current_stream()
            reads_data = not _reads_no_data(func) and not _is_view(func)
            fresh_inputs = schema.name in ("aten::lift_fresh", "aten::lift_fresh_copy")
            reads: List[int] = []
            writes: List[int] = []
            allocs: List[int] = []
            for position, argument in enumerate(schema.arguments):
                if argument.kwarg_only or position >= len(args):
                    value = kwargs.get(argument.name)
                else:
                    value = args[position]
                tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
                written = argument.alias_info is not None and argument.alias_info.is_write
                for tensor in tensors:
                    sid, new = self._storage(tensor, external=not fresh_inputs)
                    if sid is None:
                        continue
                    if new and fresh_inputs:
                        # torch.tensor(data): memory made for this call, on this stream
                        allocs.append(sid)
                        continue
                    if written:
                        writes.append(sid)
                    if reads_data and not (written and argument.name.startswith("out")):
                        reads.append(sid)
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    sid, new = self._storage(tensor, external=False)
                    if sid is not None and new:
                        allocs.append(sid)
            touched = reads + writes
            if touched and self._host_memory.issuperset(touched):
                # Host work (a fill_ or clone of fbgemm's learning-rate tensor): not a kernel.
                self._host_memory.update(allocs)
                return
            for sid in allocs:
                self._alloc_stream[sid] = stream
            for sid in itertools.chain(reads, writes):
                allocated_on = self._alloc_stream.get(sid)
                if (
                    allocated_on is not None
                    and allocated_on is not stream
                    and sid not in self._watched
                ):
                    self._watched[sid] = self._refs[sid]
            self.records.append(
                OpRecord(
                    self._where(),
                    stream,
                    str(func),
                    tuple(dict.fromkeys(reads)),
                    tuple(dict.fromkeys(writes)),
                    tuple(dict.fromkeys(allocs)),
                )
            )

    # ------------------------------------------------- stream and events

    def _wait_stream(self, stream: RecordingStream, producer: RecordingStream) -> None:
        self._append(lambda where: WaitStreamRecord(where, stream, producer))

    def _record_event(self, event: RecordingEvent, stream: RecordingStream) -> None:
        def make(where: Where) -> Record:
            event.recorded = True
            event._tick = where.index
            return RecordEventRecord(where, stream, event)

        self._append(make)

    def _wait_event(self, stream: RecordingStream, event: RecordingEvent) -> None:
        self._append(lambda where: WaitEventRecord(where, stream, event))

    def _synchronize(
        self, stream: Optional[RecordingStream] = None, event: Optional[RecordingEvent] = None
    ) -> None:
        self._append(lambda where: SyncRecord(where, stream, event))

    def _tensor_record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        with self._lock:
            if not self._recording:
                return
            sid, _ = self._storage(tensor, external=True)
        if sid is not None:
            self._append(lambda where: RecordStreamRecord(where, sid, stream))

    def _tensor_to(self, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        recorder = self

        def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            # Host memory moved "to the device" is a copy (see the module note).
            if (
                recorder._recording
                and len(args) < 4  # copy not given positionally
                and not kwargs.get("copy", False)
                and _device_argument(args, kwargs)
                and recorder._is_host(tensor)
            ):
                kwargs["copy"] = True
            return original(tensor, *args, **kwargs)

        return to

    # ----------------------------------------------- spans and threads

    def _span_hook(self, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self

        @contextlib.contextmanager
        def span(
            schedule: ScheduleRecorder,
            task: str,
            batch: Optional[int],
            stream: str,
            thread: str = "main",
        ) -> Iterator[None]:
            with original(schedule, task, batch, stream, thread):
                action = schedule.actions[-1]
                for role, named in schedule.streams.items():
                    # A side stream nobody named takes the name of its role.
                    if isinstance(named, RecordingStream) and not named.named:
                        named.name, named.named = role, True
                role_stream = schedule.streams.get(stream) or recorder.device.stream_named(stream)
                opened = Span(
                    action.call,
                    task,
                    batch,
                    stream,
                    thread,
                    role_stream if isinstance(role_stream, RecordingStream) else None,
                )
                recorder._open_span(opened)
                try:
                    yield
                finally:
                    recorder._close_span(opened)

        return span

    def _open_span(self, span: Span) -> None:
        with self._lock:
            if not self._recording:
                return
            self._poll_frees()
            self.records.append(SpanRecord(self._where(), span, True))
            self._spans.setdefault(threading.get_ident(), []).append(span)

    def _close_span(self, span: Span) -> None:
        with self._lock:
            open_spans = self._spans.get(threading.get_ident(), [])
            if open_spans and open_spans[-1] is span:
                open_spans.pop()
                if self._recording:
                    self._poll_frees()
                    self.records.append(SpanRecord(self._where(), span, False))

    def _begin_call_hook(self, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self

        def begin_call(schedule: ScheduleRecorder) -> None:
            original(schedule)
            with recorder._lock:
                recorder._call = schedule.call

        return begin_call

    def _thread_run(self, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self

        def run(thread: threading.Thread) -> None:
            # A thread started while recording records its ops too (the dispatch
            # mode is per thread); it starts on the default stream.
            if not recorder._recording:
                original(thread)
                return
            with _OpRecordingMode(recorder):
                original(thread)

        return run


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``owner.name`` for the duration; restore (or remove) it afterwards."""
    had = name in owner.__dict__
    previous = owner.__dict__.get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, previous)
        else:
            delattr(owner, name)


def host_memory_of(model: torch.nn.Module) -> List[torch.Tensor]:
    """The tensors of ``model`` that stay in host memory on a real device: each
    fbgemm embedding kernel's ``learning_rate_tensor`` (a CPU tensor on every
    device; the fused optimizer's ``zero_grad()`` and ``step()`` write it, the
    lookup reads it).  Pass them as ``StreamRecorder(host_memory=...)``."""
    found: List[torch.Tensor] = []
    seen: Set[int] = set()
    todo: List[Any] = [model]
    while todo:  # submodules, also those a sharded module keeps in plain lists
        module = todo.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        tensor = module.__dict__.get("learning_rate_tensor")
        if isinstance(tensor, torch.Tensor):
            found.append(tensor)
        for value in module.__dict__.values():
            for item in (
                value.values()
                if isinstance(value, dict)
                else value
                if isinstance(value, (list, tuple))
                else [value]
            ):
                if isinstance(item, torch.nn.Module):
                    todo.append(item)
    return found


def active_recorder() -> Optional[StreamRecorder]:
    """The recorder currently recording, if any."""
    return _active


__all__ = [
    "FreeRecord",
    "OpRecord",
    "Record",
    "RecordEventRecord",
    "RecordStreamRecord",
    "RecordingDevice",
    "RecordingEvent",
    "RecordingStream",
    "Span",
    "SpanRecord",
    "StreamRecorder",
    "SyncRecord",
    "TensorInfo",
    "WaitEventRecord",
    "WaitStreamRecord",
    "Where",
    "active_recorder",
    "host_memory_of",
]
