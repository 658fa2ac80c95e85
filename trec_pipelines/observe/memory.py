"""What a pipeline holds: the tensor storage reachable from it, by kind.

:func:`footprint` walks any object graph (a pipeline of ours or torchrec's,
with the locals of its running frames if asked) and adds up the bytes of
every tensor storage it can reach, each storage counted once however many
tensors view it, CPU and device alike.  The model and the optimizer are not
the pipeline's memory: ``nn.Module`` and ``Optimizer`` objects are not
entered, and storages given in ``skip`` (see :func:`owned_storages`) are
left out even when something else points at them.

[Note: memory kinds]
Each storage is attributed to one kind, from the attribute (or local
variable) names on the path that reached it:

* ``batch``: a name holding batches (``batches``, ``_cur_batch``, ``cur``,
  ``_batch_ip1``, the source's fetched-ahead ``_held``, a loader's or
  stage's ``_slot``/``_slots``, torchrec's ``_buffered`` (loader thread) and
  ``_stage_outputs``, ...);
* ``context``: per-batch contexts and what ``input_dist`` left in them
  (names containing ``context``, ``dist``, ``request``, ``awaitable``,
  ``prefetch``);
* ``embeddings``: lookup results and embedding tensors (``emb``, ``lookup``);
* ``other``: anything else (e.g. the losses and output ``progress()`` holds
  while it runs).

A kind is only refined downwards (other -> context -> embeddings; other ->
batch), so a context's field named ``..._batch_...`` stays context.  One
exception goes by type: a per-batch context reached under a batch's name (a
``progress()`` local ``cur = self.contexts[0]``) is context, not a batch.  Dict keys
never name a kind (they are module paths and feature names).  A storage
reached under several kinds goes to the first of ``KINDS``: on CPU the
input-dist output of a fake module may be the batch's own KJT, and it is the
batch that holds it.

Batches are counted as the outermost ``Pipelineable`` (or plain tensor)
under a ``batch`` name; two such objects sharing a storage are one batch (on
CPU a host batch and its "device" copy are the same memory).

[Note: memory places]
The ``batch`` kind is split by place, by the batch's role (on CPU both are
CPU tensors, so the device a tensor is on cannot say it):

* ``host batch``: a batch as the data iterator gave it, not copied to the
  device: what a batch source holds (an object with a ``host_batches()``
  method: the batches pulled ahead, those whose agreement is under way, those
  given back to retry a failed step), and any
  object passed in ``host_objects`` (the bench passes the batches it feeds a
  pipeline, so torchrec's classes are measured alike);
* ``device batch``: every other batch (copied to the device, or in the
  pipeline's device-side work).

The host copies a pipeline keeps of its in-flight batches, to retry a failed
step from them, are not batches here (their names are no batch holder's): on
CPU they share the device batches' storage, and once those are freed they
count as ``other`` (on a GPU, host memory).

A batch that shares a storage with a device batch is one device batch (on CPU
a copy may hand over the host batch's own tensors): only batches all of whose
objects are host batches are counted on the host.

What is not seen: memory held only by C++ objects (a collective's work
handle, the autograd graph's saved tensors behind a ``grad_fn``) and by
other threads' frames.
"""

from __future__ import annotations

import logging
import types
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torchrec.streamable import Pipelineable

BATCH, CONTEXT, EMBEDDINGS, OTHER = "batch", "context", "embeddings", "other"
# Attribution order when a storage is reached under several kinds.
KINDS: Tuple[str, ...] = (BATCH, CONTEXT, EMBEDDINGS, OTHER)
# The batch kind by place (see [Note: memory places]), then the other kinds.
HOST_BATCH, DEVICE_BATCH = "host batch", "device batch"
PLACES: Tuple[str, ...] = (HOST_BATCH, DEVICE_BATCH, CONTEXT, EMBEDDINGS, OTHER)

# (device, data pointer) of a storage: equal for every tensor viewing it.
StorageKey = Tuple[str, int]

_BATCH_NAMES = frozenset({"cur", "nxt", "new", "held", "_held", "batch"})
# Also batch holders: a loader's or stage's slot, torchrec's loader thread's
# ``_buffered`` and StagedTrainPipeline's ``_stage_outputs``.
_BATCH_WORDS = ("batch", "slot", "buffered", "stage_output")
_CONTEXT_WORDS = ("context", "dist", "request", "awaitable", "prefetch")
_EMBEDDING_WORDS = ("emb", "lookup")

# Never entered: not the pipeline's memory (model, optimizer, the user's data
# iterator) or holding no tensors (code, types, logging).  A loader thread
# object is entered: what it buffers is the pipeline's.
_OPAQUE = (
    torch.nn.Module,
    torch.optim.Optimizer,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.ModuleType,
    types.FrameType,
    type,
    weakref.ref,
    logging.Logger,
    BaseException,
    torch.device,
    torch.dtype,
    str,
    bytes,
    int,
    float,
    complex,
    bool,
)


def _is_batch_context(obj: Any) -> bool:
    """A pipeline's per-batch context (ours or torchrec's): it has their input-dist field."""
    return hasattr(obj, "input_dist_tensors_requests")


def refine(kind: str, name: str) -> str:
    """The kind of what is reached through attribute (or local) ``name`` from ``kind``."""
    if kind == BATCH or kind == EMBEDDINGS:
        return kind
    lowered = name.lower()
    if any(word in lowered for word in _EMBEDDING_WORDS):
        return EMBEDDINGS
    if kind == CONTEXT:
        return kind
    if any(word in lowered for word in _CONTEXT_WORDS):
        return CONTEXT
    if lowered in _BATCH_NAMES or any(word in lowered for word in _BATCH_WORDS):
        return BATCH
    return kind


def storage_of(tensor: torch.Tensor) -> Optional[Tuple[StorageKey, int]]:
    """``(key, bytes)`` of a strided tensor's storage; None when it has none."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, functional wrappers
        return None
    nbytes = storage.nbytes()
    if nbytes == 0 or tensor.device.type == "meta":
        return None
    return (str(storage.device), storage.data_ptr()), nbytes


def _inner_tensors(tensor: torch.Tensor) -> List[torch.Tensor]:
    """The tensors a tensor's memory lives in (itself, or a wrapper's parts)."""
    local_shards = getattr(type(tensor), "local_shards", None)
    if local_shards is not None:  # a (deprecated) ShardedTensor: its local shards hold the memory
        return [shard.tensor for shard in tensor.local_shards()]  # type: ignore[attr-defined]
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        out: List[torch.Tensor] = []
        for name in names:
            out += _inner_tensors(getattr(tensor, name))
        return out
    if tensor.layout == torch.sparse_coo:
        return [tensor._indices(), tensor._values()]
    if tensor.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        return []  # compressed layouts: not held by pipelines; not counted
    return [tensor]


def owned_storages(*owners: Any) -> Set[StorageKey]:
    """Storages of the parameters, buffers and optimizer state of ``owners``.

    Pass the model and optimizer: :func:`footprint` then never counts them,
    even when a pipeline points at one of their tensors directly.
    """
    keys: Set[StorageKey] = set()

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            for inner in _inner_tensors(value):
                found = storage_of(inner)
                if found is not None:
                    keys.add(found[0])
        elif isinstance(value, dict):
            for item in value.values():
                add(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                add(item)

    for owner in owners:
        if owner is None:
            continue
        if isinstance(owner, torch.nn.Module):
            for tensor in list(owner.parameters()) + list(owner.buffers()):
                add(tensor)
        elif isinstance(owner, torch.optim.Optimizer):
            for group in owner.param_groups:
                add(group.get("params", []))
            for state in owner.state.values():
                add(state)
        else:
            add(owner)
    return keys


@dataclass(frozen=True)
class Footprint:
    """The tensor storage reachable from one object, at one moment.

    Attributes:
        bytes_by_kind: bytes per kind (every kind of :data:`KINDS` present).
        storages: distinct storages counted.
        batches: distinct in-flight batches (see the module docstring).
        batch_storages: the storage keys of each of those batches.
        truncated: True when the walk stopped at ``max_objects``.
        host_batch_bytes: the part of ``bytes_by_kind["batch"]`` held in host
            batches (see ``[Note: memory places]``).
        host_batches: how many of ``batches`` are host batches.
    """

    bytes_by_kind: Dict[str, int]
    storages: int
    batches: int
    batch_storages: Tuple[FrozenSet[StorageKey], ...] = ()
    truncated: bool = False
    host_batch_bytes: int = 0
    host_batches: int = 0

    @property
    def total(self) -> int:
        return sum(self.bytes_by_kind.values())

    @property
    def device_batches(self) -> int:
        """Batches copied to the device (or in its work): ``batches`` less the host ones."""
        return self.batches - self.host_batches

    @property
    def bytes_by_place(self) -> Dict[str, int]:
        """Bytes per place of :data:`PLACES`: the batches split into host and device."""
        by_place = {
            HOST_BATCH: self.host_batch_bytes,
            DEVICE_BATCH: self.bytes_by_kind.get(BATCH, 0) - self.host_batch_bytes,
        }
        by_place.update({k: self.bytes_by_kind.get(k, 0) for k in KINDS if k != BATCH})
        return by_place


def _children(obj: Any) -> Iterable[Tuple[Optional[str], Any]]:
    """``(name or None, child)`` for each reference ``obj`` holds that may lead to tensors."""
    if isinstance(obj, dict):
        return ((None, v) for v in list(obj.values()))
    if isinstance(obj, (list, tuple, deque, set, frozenset)):
        return ((None, v) for v in list(obj))
    out: List[Tuple[Optional[str], Any]] = []
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        out += list(attrs.items())
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot in ("__dict__", "__weakref__"):
                continue
            value = getattr(obj, slot, None)
            if value is not None:
                out.append((slot, value))
    return out


def _opaque(obj: Any) -> bool:
    if obj is None or isinstance(obj, _OPAQUE):
        return True
    # An iterator (a generator, a DataLoader iterator) is the user's data, not the pipeline's.
    return hasattr(type(obj), "__next__")


def _host_holder(obj: Any) -> bool:
    """Whether ``obj`` holds host batches and lists them (a batch source)."""
    return callable(getattr(type(obj), "host_batches", None))


def footprint(
    root: object,
    skip: Iterable[StorageKey] = (),
    frames: Iterable[Dict[str, Any]] = (),
    skip_objects: Iterable[Any] = (),
    max_objects: int = 200_000,
    host_objects: Iterable[Any] = (),
) -> Footprint:
    """The storage reachable from ``root`` (and from ``frames``' local variables), by kind.

    Args:
        root: the object to walk (a pipeline); entered with kind ``other``.
        skip: storages never counted (:func:`owned_storages` of model and optimizer).
        frames: local-variable dicts of the running calls of ``root`` (``self``
            is ignored); each local's name picks its kind like an attribute's.
        skip_objects: objects never entered (the recorder walking its own pipeline).
        max_objects: stop after entering this many objects (``truncated`` is then set).
        host_objects: batches known to be host batches wherever they are
            reached (see ``[Note: memory places]``).
    """
    skipped = set(skip)
    host_ids = {id(o) for o in host_objects}
    opaque_ids = {id(o) for o in skip_objects}
    kinds_of: Dict[StorageKey, Set[str]] = {}
    nbytes_of: Dict[StorageKey, int] = {}
    owner_storages: Dict[int, Set[StorageKey]] = {}
    # (object, kind, id of the batch object it belongs to or None)
    stack: List[Tuple[Any, str, Optional[int]]] = [(root, OTHER, None)]
    for local_vars in frames:
        for local, value in local_vars.items():
            if local != "self" and value is not root:
                stack.append((value, refine(OTHER, local), None))
    seen: Set[Tuple[int, str, Optional[int]]] = set()
    keep_alive: List[Any] = []  # ids stay unique while the walk runs
    entered = 0
    truncated = False
    while stack:
        obj, kind, owner = stack.pop()
        if _opaque(obj) or id(obj) in opaque_ids:
            continue
        if kind == BATCH and owner is None and _is_batch_context(obj):
            kind = CONTEXT  # a batch's context under a batch's name (PEC's local ``cur``)
        if kind == BATCH and owner is None and isinstance(obj, (Pipelineable, torch.Tensor)):
            owner = id(obj)
            owner_storages.setdefault(owner, set())
        marker = (id(obj), kind, owner)
        if marker in seen:
            continue
        seen.add(marker)
        keep_alive.append(obj)
        entered += 1
        if entered > max_objects:
            truncated = True
            break
        if _host_holder(obj):
            for held in obj.host_batches():
                host_ids.add(id(held))
                keep_alive.append(held)
                stack.append((held, BATCH, None))
        if isinstance(obj, torch.Tensor):
            _count_tensor(obj, kind, owner, skipped, nbytes_of, kinds_of, owner_storages)
            continue
        for name, child in _children(obj):
            stack.append((child, kind if name is None else refine(kind, name), owner))
    return _summarise(kinds_of, nbytes_of, owner_storages, host_ids, truncated)


def _count_tensor(
    obj: torch.Tensor,
    kind: str,
    owner: Optional[int],
    skipped: Set[StorageKey],
    nbytes_of: Dict[StorageKey, int],
    kinds_of: Dict[StorageKey, Set[str]],
    owner_storages: Dict[int, Set[StorageKey]],
) -> None:
    """Note each storage under ``obj`` (not skipped): its bytes, its kind, its batch."""
    for inner in _inner_tensors(obj):
        found = storage_of(inner)
        if found is None or found[0] in skipped:
            continue
        key, nbytes = found
        nbytes_of[key] = nbytes
        kinds_of.setdefault(key, set()).add(kind)
        if owner is not None:
            owner_storages[owner].add(key)


def _summarise(
    kinds_of: Dict[StorageKey, Set[str]],
    nbytes_of: Dict[StorageKey, int],
    owner_storages: Dict[int, Set[StorageKey]],
    host_ids: Set[int],
    truncated: bool,
) -> Footprint:
    """The footprint of the storages found: each counted once, under its first kind."""
    by_kind = {k: 0 for k in KINDS}
    for key, kinds in kinds_of.items():
        by_kind[next(k for k in KINDS if k in kinds)] += nbytes_of[key]
    groups = _batch_groups(owner_storages, host_ids)
    host_groups = [g for g, host in groups if host]
    host_bytes = sum(
        nbytes_of[key]
        for group in host_groups
        for key in group
        if next(k for k in KINDS if k in kinds_of[key]) == BATCH
    )
    return Footprint(
        by_kind,
        len(nbytes_of),
        len(groups),
        tuple(g for g, _ in groups),
        truncated,
        host_bytes,
        len(host_groups),
    )


def _batch_groups(
    owner_storages: Dict[int, Set[StorageKey]], host_ids: Set[int]
) -> List[Tuple[FrozenSet[StorageKey], bool]]:
    """Merge batch objects that share a storage; one group per batch, with
    whether every object in it is a host batch (see [Note: memory places])."""
    groups: List[Tuple[Set[StorageKey], bool]] = []
    for owner, storages in owner_storages.items():
        merged, host = set(storages), owner in host_ids
        rest: List[Tuple[Set[StorageKey], bool]] = []
        for group, group_host in groups:
            if group & merged:
                merged |= group
                host = host and group_host
            else:
                rest.append((group, group_host))
        groups = rest + [(merged, host)]
    return [(frozenset(g), host) for g, host in groups if g]


def pipeline_frames(root: object, start: Optional[types.FrameType]) -> List[Dict[str, Any]]:
    """The local variables of every running method of ``root`` from ``start`` outwards."""
    out: List[Dict[str, Any]] = []
    frame = start
    while frame is not None:
        local_vars = frame.f_locals
        if local_vars.get("self") is root:
            out.append(dict(local_vars))
        frame = frame.f_back
    return out


@dataclass(frozen=True)
class DeviceMemory:
    """The device allocator's own counters (CUDA and the like; None on CPU)."""

    allocated: int
    max_allocated: int
    max_reserved: int


def device_memory(device: Optional[torch.device]) -> Optional[DeviceMemory]:
    """The allocator counters of ``device``, through its device module; None without one."""
    from trec_pipelines.core.streams import device_module, has_streams

    if device is None or not has_streams(device):
        return None
    module = device_module(device)
    if not hasattr(module, "max_memory_allocated"):
        return None
    return DeviceMemory(
        allocated=int(module.memory_allocated(device)),
        max_allocated=int(module.max_memory_allocated(device)),
        max_reserved=int(module.max_memory_reserved(device)),
    )


def rss_bytes() -> Optional[int]:
    """This process's resident memory now (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_rss_bytes() -> Optional[int]:
    """This process's peak resident memory so far (``getrusage``; None where unavailable)."""
    try:
        import resource
    except ImportError:
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


@dataclass
class PeakTracker:
    """The largest :class:`Footprint` seen over repeated measurements (by total)."""

    peak: Optional[Footprint] = None
    peak_by_kind: Dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    max_batches: int = 0
    samples: int = 0
    # Each place's own largest bytes, and the most host and device batches, over the samples.
    peak_by_place: Dict[str, int] = field(default_factory=lambda: {p: 0 for p in PLACES})
    max_host_batches: int = 0
    max_device_batches: int = 0

    def add(self, measured: Footprint) -> None:
        self.samples += 1
        if self.peak is None or measured.total > self.peak.total:
            self.peak = measured
        for kind, nbytes in measured.bytes_by_kind.items():
            self.peak_by_kind[kind] = max(self.peak_by_kind.get(kind, 0), nbytes)
        for place, nbytes in measured.bytes_by_place.items():
            self.peak_by_place[place] = max(self.peak_by_place.get(place, 0), nbytes)
        self.max_batches = max(self.max_batches, measured.batches)
        self.max_host_batches = max(self.max_host_batches, measured.host_batches)
        self.max_device_batches = max(self.max_device_batches, measured.device_batches)


def format_bytes(nbytes: Optional[float]) -> str:
    """``1.5 MiB``, ``12.0 KiB``, ``512 B``; ``-`` for None."""
    if nbytes is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


__all__ = [
    "BATCH",
    "CONTEXT",
    "DEVICE_BATCH",
    "DeviceMemory",
    "EMBEDDINGS",
    "Footprint",
    "HOST_BATCH",
    "KINDS",
    "OTHER",
    "PLACES",
    "PeakTracker",
    "device_memory",
    "footprint",
    "format_bytes",
    "owned_storages",
    "peak_rss_bytes",
    "pipeline_frames",
    "refine",
    "rss_bytes",
    "storage_of",
]
