"""Device streams and events: the only module that touches them, and a batch's way across them.

[Note: stream protocol]
Every pipeline runs its work on a few named streams (see :class:`StreamSet`).
On a device without streams (CPU) every side stream is ``None`` and each helper
here does nothing, so pipeline code never branches on the device type.

On a device with streams four rules keep the overlap correct:

1. A kernel on stream B that reads memory written on stream A runs after that
   write: B waited for A since (``wait_stream``, or an event recorded on A
   after the write), directly or through another stream (B waited for C after
   C waited for A).  A write likewise waits for other streams' earlier reads.
2. Memory allocated on stream A and used on stream B is ``record_stream``-ed on
   B before it is freed, unless A waits for B's use before issuing more work
   (only then could the allocator's reuse on A overtake B).  Parameters and
   buffers made before the pipeline are never freed under it: exempt.
3. An event is waited on only after it has been recorded; a wait on an
   unrecorded event orders nothing.
4. Each verb issues its kernels on the stream its recorder span names, or on
   a side stream that stream waits for before the verb ends (the forward
   finishing its input_dist on data_dist, where it was issued), in the
   variant's documented order.

A batch crosses to the device through :func:`copy_to_device` (on the memcpy
stream) and to the stream that uses it through :func:`wait_for_batch`.
:func:`hand_off` is rules 1 and 2 in one call, which is what nearly every
cross-stream hand-over in the pipelines needs.  Where the consumer must not
also wait for later work on the producer, an event recorded right after the
producing work replaces the ``wait_stream``.

The device module is looked up through :func:`device_module`, never hard-coded,
so a test can point it at a recording stand-in (see ``use_device_module``):
:mod:`trec_pipelines.testing` runs a pipeline on one and checks these rules
(``tests/unit/test_stream_protocol.py`` does it for every variant).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, List, Optional, Tuple, cast

import torch
from torchrec.streamable import Multistreamable, Pipelineable

# Devices whose runtime has streams we overlap on.
_STREAM_DEVICES = ("cuda", "mtia")

# A test may replace the device module (a recording stand-in); None = real one.
_device_module_override: Optional[Any] = None


def device_module(device: torch.device) -> Any:
    """The runtime module of ``device`` (``torch.cuda`` for CUDA, ...)."""
    if _device_module_override is not None:
        return _device_module_override
    return torch.get_device_module(device)


def has_streams(device: torch.device) -> bool:
    """True when ``device`` runs work asynchronously on streams."""
    return _device_module_override is not None or device.type in _STREAM_DEVICES


@contextlib.contextmanager
def use_device_module(module: Any) -> Iterator[None]:
    """Route every stream/event call through ``module`` (for tests)."""
    global _device_module_override
    previous = _device_module_override
    _device_module_override = module
    try:
        yield
    finally:
        _device_module_override = previous


@dataclass(frozen=True)
class StreamSet:
    """The side streams of one pipeline; ``None`` where a stream is not used.

    Attributes:
        memcpy: host-to-device copies of the batch, overlapped with compute.
        data_dist: the sparse ``input_dist`` all-to-alls, overlapped with compute.
        prefetch: embedding cache prefetch, overlapped with the forward.
        emb_lookup: the embedding lookup of the Fused variants, started before
            the dense forward.
    """

    memcpy: Optional[torch.Stream] = None
    data_dist: Optional[torch.Stream] = None
    prefetch: Optional[torch.Stream] = None
    emb_lookup: Optional[torch.Stream] = None


def new_stream(device: torch.device, priority: int = 0) -> Optional[torch.Stream]:
    """A new side stream on ``device``, or ``None`` where there are no streams."""
    if not has_streams(device):
        return None
    stream: torch.Stream = device_module(device).Stream(priority=priority)
    return stream


def make_streams(
    device: torch.device,
    *,
    memcpy: bool = False,
    data_dist: bool = False,
    prefetch: bool = False,
    emb_lookup: bool = False,
) -> StreamSet:
    """Build the side streams a pipeline asks for.

    Copies and all-to-alls feed the next steps' compute, so they get high
    priority (-1) like upstream; prefetch and lookup run at normal priority.
    Every stream must be a stream of its own (see :func:`check_distinct`).
    """
    made = StreamSet(
        memcpy=new_stream(device, priority=-1) if memcpy else None,
        data_dist=new_stream(device, priority=-1) if data_dist else None,
        prefetch=new_stream(device) if prefetch else None,
        emb_lookup=new_stream(device) if emb_lookup else None,
    )
    check_distinct(made, current_stream(device))
    return made


def check_distinct(made: StreamSet, default: Optional[torch.Stream]) -> None:
    """Raise when two roles got one stream, or a role got the default stream.

    A device's stream pool may hand out a stream it already gave (a small pool
    wraps around: seen on ROCm, torchrec PR #4396).  Two roles on one stream
    serialize what the schedule overlaps, and a role on the default stream
    turns each cross-stream wait into a no-op that orders nothing, so the
    handovers the schedule relies on silently stop protecting anything.
    """
    taken: List[Tuple[str, torch.Stream]] = [("default", default)] if default is not None else []
    for role in ("memcpy", "data_dist", "prefetch", "emb_lookup"):
        stream = getattr(made, role)
        if stream is None:
            continue
        for other_role, other in taken:
            if stream is other or stream == other:
                raise RuntimeError(
                    f"the device gave the pipeline's {role} stream and its {other_role} "
                    f"stream as one stream ({stream}): its stream pool wrapped around. "
                    "Build fewer pipelines (or other stream users) at once, or give the "
                    "device a larger stream pool, so every role has a stream of its own."
                )
        taken.append((role, stream))


def current_stream(device: torch.device) -> Optional[torch.Stream]:
    """The stream work is issued on now, or ``None`` where there are no streams."""
    if not has_streams(device):
        return None
    stream: torch.Stream = device_module(device).current_stream()
    return stream


def on_stream(stream: Optional[torch.Stream]) -> contextlib.AbstractContextManager[Any]:
    """Issue the enclosed work on ``stream``; a no-op for ``None``."""
    if stream is None:
        return contextlib.nullcontext()
    context: ContextManager[Any] = device_module(stream.device).stream(stream)
    return context


def wait_stream(waiter: Optional[torch.Stream], producer: Optional[torch.Stream]) -> None:
    """Make ``waiter`` wait for all work issued so far on ``producer``."""
    if waiter is None or producer is None or waiter == producer:
        return
    waiter.wait_stream(producer)


def record_stream(obj: Any, stream: Optional[torch.Stream]) -> None:
    """Tell the allocator ``obj`` (a Tensor or ``Multistreamable``) is used on ``stream``."""
    if stream is None or obj is None:
        return
    obj.record_stream(stream)


def record_stream_tree(obj: Any, stream: Optional[torch.Stream]) -> int:
    """:func:`record_stream` every Tensor / ``Multistreamable`` inside ``obj``,
    looking into lists, tuples and dicts (a postproc's output: a batch, a list
    of KJTs, ...); returns how many were recorded.  Anything else is skipped:
    the caller decides whether that can hide device memory."""
    if stream is None or obj is None:
        return 0
    if isinstance(obj, (list, tuple)):
        return sum(record_stream_tree(item, stream) for item in obj)
    if isinstance(obj, dict):
        return sum(record_stream_tree(item, stream) for item in obj.values())
    if isinstance(obj, torch.Tensor) or callable(getattr(obj, "record_stream", None)):
        obj.record_stream(stream)
        return 1
    return 0


def record_stream_held(obj: Any, stream: Optional[torch.Stream], depth: int = 6) -> int:
    """:func:`record_stream` every Tensor / ``Multistreamable`` that ``obj`` holds,
    looking through its attributes, lists, tuples and dicts ``depth`` levels deep;
    returns how many were recorded.

    For an awaitable issued on one stream and waited on another (an embedding
    lookup's output all-to-all): its ``wait()`` reads the buffers the issue
    allocated and then drops them, so they must be recorded on the waiting
    stream before the wait, while they can still be reached.  Tensors on
    another device type (host memory) are skipped; modules, streams and events
    are not looked into.
    """
    if stream is None:
        return 0
    return _record_held(obj, stream, depth, set())


def _record_held(obj: Any, stream: torch.Stream, depth: int, seen: set[int]) -> int:
    if obj is None or id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.device.type != stream.device.type:
            return 0  # host (or meta) memory: no stream of this device uses it
        obj.record_stream(stream)
        return 1
    # No getattr on anything else: a LazyAwaitable's __getattr__ would wait for it.
    if isinstance(obj, Multistreamable):
        obj.record_stream(stream)
        return 1
    if depth == 0 or isinstance(obj, (torch.nn.Module, torch.Stream, torch.Event, type)):
        return 0
    if isinstance(obj, (list, tuple)):
        items: Any = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        try:
            items = object.__getattribute__(obj, "__dict__").values()
        except AttributeError:  # no attributes of its own (slots, a C object)
            return 0
    return sum(_record_held(item, stream, depth - 1, seen) for item in items)


def hand_off(obj: Any, producer: Optional[torch.Stream]) -> None:
    """Hand ``obj``, made on ``producer``, to the current stream (rules 1 and 2)."""
    if producer is None:
        return
    consumer = device_module(producer.device).current_stream()
    wait_stream(consumer, producer)
    record_stream(obj, consumer)


def record_event(stream: Optional[torch.Stream]) -> Optional[torch.Event]:
    """An event recorded on ``stream`` now, or ``None`` where there are no streams."""
    if stream is None:
        return None
    event: torch.Event = device_module(stream.device).Event()
    event.record(stream)
    return event


def wait_event(stream: Optional[torch.Stream], event: Optional[torch.Event]) -> None:
    """Make ``stream`` wait for ``event``; a no-op when either is ``None``."""
    if stream is None or event is None:
        return
    stream.wait_event(event)


def describe(stream: Optional[torch.Stream], streams: StreamSet) -> str:
    """The role name of ``stream`` within ``streams`` ("default" otherwise)."""
    if stream is not None:
        for name in ("memcpy", "data_dist", "prefetch", "emb_lookup"):
            if getattr(streams, name) is stream:
                return name
    return "default"


__all__ = [
    "PIPELINEABLE",
    "StreamSet",
    "copy_to_device",
    "current_stream",
    "describe",
    "device_module",
    "hand_off",
    "has_streams",
    "make_streams",
    "new_stream",
    "not_pipelineable",
    "on_stream",
    "record_event",
    "record_stream",
    "record_stream_held",
    "record_stream_tree",
    "use_device_module",
    "wait_event",
    "wait_for_batch",
    "wait_stream",
]


# ------------------------------------------------- a batch on its way to the device


# What a pipeline can copy to the device and hand across streams.
PIPELINEABLE = (torch.Tensor, Pipelineable)


def not_pipelineable(batch: Any) -> TypeError:
    """The error for a ``batch`` that is not :data:`PIPELINEABLE`, naming the fix."""
    return TypeError(
        f"the data iterator yielded a {type(batch).__name__}, which is neither a "
        "torch.Tensor nor a torchrec.streamable.Pipelineable. Wrap the batch in a "
        "class that implements Pipelineable (to(device, non_blocking) and "
        "record_stream(stream)), for example a dataclass of tensors and "
        "KeyedJaggedTensors."
    )


def copy_to_device(
    batch: Any,
    device: torch.device,
    stream: Optional[torch.Stream],
    inplace: bool = False,
    blocking: bool = False,
) -> Any:
    """Host-to-device copy of ``batch`` issued on ``stream``.

    With ``inplace`` the batch allocates its device memory on the current stream
    and copies on ``stream`` itself (``data_copy_stream``), so the consumer
    needs no ``record_stream``.  ``blocking`` waits for the copy to finish.
    """
    if not isinstance(batch, PIPELINEABLE):
        raise not_pipelineable(batch)
    if blocking:
        return batch.to(device=device, non_blocking=False)
    if stream is None:  # no side stream (CPU): the copy runs where it is issued
        return batch.to(device=device, non_blocking=True)
    if inplace:
        # A batch class's own to() (Pipelineable's signature has no data_copy_stream).
        return cast(Any, batch).to(device=device, non_blocking=True, data_copy_stream=stream)
    with on_stream(stream):
        return batch.to(device=device, non_blocking=True)


def wait_for_batch(batch: Any, producer: Optional[torch.Stream], record: bool = True) -> None:
    """Make the current stream wait for ``batch``, produced on ``producer``."""
    if producer is None or batch is None:
        return
    if record:
        if not isinstance(batch, (torch.Tensor, Multistreamable)):
            raise TypeError(
                f"{type(batch).__name__} must implement Multistreamable.record_stream "
                "to cross streams"
            )
        hand_off(batch, producer)
    else:
        hand_off(None, producer)
