"""The storage walker behind the memory ledger: dedup, cycles, skips, kinds, KJT."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Dict, List

import torch
from torch import nn
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from trec_pipelines.core.streams import use_device_module
from trec_pipelines.observe.memory import (
    BATCH,
    CONTEXT,
    EMBEDDINGS,
    OTHER,
    device_memory,
    footprint,
    format_bytes,
    owned_storages,
    refine,
)


def nbytes(*tensors: torch.Tensor) -> int:
    """The reference: numel x element size of tensors that each own their storage."""
    return sum(t.numel() * t.element_size() for t in tensors)


class Holder:
    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


def test_each_storage_counted_once_however_many_views() -> None:
    base = torch.zeros(100)  # 400 bytes
    holder = Holder(a=base, b=base[10:20], c=base.view(10, 10), d=[base, base[::2]])
    held = footprint(holder)
    assert held.total == 400
    assert held.storages == 1


def test_distinct_storages_add_up() -> None:
    a, b = torch.zeros(10), torch.ones(3, dtype=torch.int64)
    assert footprint(Holder(x=a, y={"k": (b,)})).total == nbytes(a, b)


def test_cycles_terminate_and_count_once() -> None:
    t = torch.zeros(8)
    first, second = Holder(t=t), Holder()
    first.other, second.other = second, first
    loop: List[Any] = [t]
    loop.append(loop)
    second.loop = loop
    held = footprint(first)
    assert held.total == nbytes(t) and held.storages == 1


def test_model_and_optimizer_are_not_the_pipelines() -> None:
    model = nn.Linear(10, 10)
    optimizer = torch.optim.Adagrad(model.parameters())
    model(torch.ones(2, 10)).sum().backward()
    optimizer.step()  # creates state
    batch = torch.ones(4, 10)
    pipeline = Holder(_model=model, _optimizer=optimizer, batches=deque([batch]))
    held = footprint(pipeline)
    assert held.total == nbytes(batch)
    assert held.bytes_by_kind[BATCH] == nbytes(batch)


def test_skipped_storages_are_left_out_even_when_pointed_at_directly() -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.Adagrad(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    state_sum = optimizer.state[model.weight]["sum"]
    batch = torch.ones(3)
    # The pipeline keeps its own references to a parameter and to optimizer state.
    pipeline = Holder(weights=[model.weight, model.bias], acc=state_sum, batch=batch)
    assert footprint(pipeline).total == nbytes(model.weight, model.bias, state_sum, batch)
    skip = owned_storages(model, optimizer)
    assert footprint(pipeline, skip=skip).total == nbytes(batch)


def test_kjt_jagged_and_keyed_tensors_are_walked() -> None:
    values = torch.arange(6)
    lengths = torch.tensor([1, 2, 0, 3])
    weights = torch.rand(6)
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=values, lengths=lengths, weights=weights)
    offsets = kjt.offsets()  # cached inside the KJT: the KJT now holds it too
    jt = JaggedTensor(values=torch.rand(5), lengths=torch.tensor([2, 3]))
    kt = KeyedTensor(keys=["x"], length_per_key=[4], values=torch.rand(2, 4))
    held = footprint(Holder(kjt=kjt, jt=jt, kt=kt))
    assert held.total == nbytes(
        values, lengths, weights, offsets, jt.values(), jt.lengths(), kt.values()
    )


class _Pending(Awaitable[Any]):
    def __init__(self, payload: Any) -> None:
        super().__init__()
        self._payload = payload

    def _wait_impl(self) -> Any:
        return self._payload


@dataclass
class _Ctx:
    index: int = 0
    input_dist_tensors_requests: Dict[str, Any] = field(default_factory=dict)
    embedding_tensors: List[List[torch.Tensor]] = field(default_factory=list)


class _Slotted:
    __slots__ = ("payload",)

    def __init__(self, payload: torch.Tensor) -> None:
        self.payload = payload


def test_kinds_follow_the_names_on_the_path() -> None:
    batch = torch.zeros(10)
    dist_out = torch.zeros(20)
    emb = torch.zeros(30)
    extra = torch.zeros(40)
    context = _Ctx(
        input_dist_tensors_requests={"sparse.embedding_bags": _Pending(_Slotted(dist_out))},
        embedding_tensors=[[emb]],
    )
    pipeline = Holder(batches=deque([batch]), contexts=deque([context]), _scratch=extra)
    held = footprint(pipeline)
    assert held.bytes_by_kind == {BATCH: 40, CONTEXT: 80, EMBEDDINGS: 120, OTHER: 160}


def test_refine_only_moves_down() -> None:
    assert refine(OTHER, "batches") == BATCH
    assert refine(CONTEXT, "batch_size_per_rank") == CONTEXT  # a context's field stays context
    assert refine(CONTEXT, "embedding_a2a_requests") == EMBEDDINGS
    assert refine(BATCH, "module_contexts") == BATCH
    assert refine(OTHER, "_cur_batch") == BATCH and refine(OTHER, "cur") == BATCH
    assert refine(OTHER, "_held") == BATCH


def test_a_storage_reached_as_batch_and_as_context_is_the_batch() -> None:
    shared = torch.zeros(16)
    pipeline = Holder(contexts=[_Ctx(input_dist_tensors_requests={"m": shared})], batches=[shared])
    held = footprint(pipeline)
    assert held.bytes_by_kind[BATCH] == 64 and held.bytes_by_kind[CONTEXT] == 0


@dataclass
class _Batch:
    dense: torch.Tensor
    sparse: KeyedJaggedTensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "_Batch":
        return _Batch(self.dense.to(device), self.sparse.to(device))


def _batch(n: int) -> _Batch:
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.arange(n), lengths=torch.tensor([n]))
    return _Batch(torch.zeros(n), kjt)


def test_batches_are_counted_by_shared_storage() -> None:
    from torchrec.streamable import Pipelineable

    Pipelineable.register(_Batch)  # the walker counts Pipelineable objects as batches
    one, two = _batch(3), _batch(5)
    one_copy = one.to(torch.device("cpu"))  # a new object over the same storages on CPU
    held = footprint(Holder(batches=[one, two], _held=[one_copy]))
    assert held.batches == 2
    assert held.bytes_by_kind[BATCH] == nbytes(
        one.dense,
        one.sparse.values(),
        one.sparse.lengths(),
        two.dense,
        two.sparse.values(),
        two.sparse.lengths(),
    )


def test_frame_locals_are_walked_with_their_names() -> None:
    cur = torch.zeros(6)
    losses = torch.zeros(2)
    pipeline = Holder()
    held = footprint(pipeline, frames=[{"self": pipeline, "cur": cur, "losses": losses}])
    assert held.bytes_by_kind[BATCH] == 24 and held.bytes_by_kind[OTHER] == 8 and held.batches == 1


def test_iterators_and_functions_are_not_entered() -> None:
    data = [torch.zeros(100)]
    pipeline = Holder(_iterator=iter(data), _gen=(t for t in data), _fn=lambda: data)
    assert footprint(pipeline).total == 0


def test_walk_stops_at_max_objects() -> None:
    held = footprint(Holder(items=[Holder(t=torch.zeros(1)) for _ in range(50)]), max_objects=10)
    assert held.truncated


class _StubDevice:
    """Just the allocator counters of a device module."""

    def memory_allocated(self, device: torch.device) -> int:
        return 1000

    def max_memory_allocated(self, device: torch.device) -> int:
        return 3000

    def max_memory_reserved(self, device: torch.device) -> int:
        return 4096


def test_device_counters_come_from_the_device_module() -> None:
    assert device_memory(torch.device("cpu")) is None
    with use_device_module(_StubDevice()):
        counters = device_memory(torch.device("cuda"))
    assert counters is not None
    assert (counters.allocated, counters.max_allocated, counters.max_reserved) == (1000, 3000, 4096)


def test_format_bytes() -> None:
    assert [format_bytes(v) for v in (None, 512, 2048, 3 * 2**20)] == [
        "-",
        "512 B",
        "2.0 KiB",
        "3.0 MiB",
    ]


def test_none_and_empty_tensors_hold_nothing() -> None:
    held = footprint(Holder(a=None, b=torch.empty(0), c=torch.empty(3, device="meta")))
    assert held.total == 0 and held.storages == 0


def test_a_loader_thread_s_buffered_batch_is_the_pipeline_s() -> None:
    import threading

    class Loader(threading.Thread):  # the shape of torchrec's DataLoadingThread
        def __init__(self, batch: torch.Tensor) -> None:
            super().__init__(daemon=True)
            self._buffered = batch

    batch = torch.zeros(12)
    held = footprint(Holder(_batch_loader=Loader(batch)))
    assert held.bytes_by_kind[BATCH] == nbytes(batch) and held.batches == 1


def test_a_context_reached_under_a_batch_name_is_context_and_no_batch() -> None:
    """PEC's progress() holds ``cur = self.contexts[0]``: the KJTs its input dist
    left there are the context's, not batches in flight."""
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.arange(6), lengths=torch.tensor([6]))
    context = _Ctx(input_dist_tensors_requests={"m": kjt})
    held = footprint(Holder(cur=context, nxt=context))
    assert held.batches == 0
    assert held.bytes_by_kind[CONTEXT] == nbytes(kjt.values(), kjt.lengths())
    assert held.bytes_by_kind[BATCH] == 0
