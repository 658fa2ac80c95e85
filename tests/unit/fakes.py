"""A sharded module and a model that run with no process group.

``FakeShardedEBC`` splits its forward like a real sharded module: ``input_dist``
returns an awaitable of an awaitable of the KJT (standing in for the two
all-to-alls), ``compute_and_output_dist`` looks the ids up in a real
``nn.EmbeddingBag``.  Every call is appended to ``log`` so tests can check the
order in which a pipeline drove it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple, Type

import torch
from torch import nn
from torchrec.distributed.types import Awaitable, LazyNoWait, ShardedModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor
from torchrec.streamable import Multistreamable, Pipelineable

FEATURES = ["f0", "f1"]
DIM = 4
ROWS = 20


class _Ready(Awaitable[Any]):
    def __init__(self, value: Any) -> None:
        super().__init__()
        self._value = value

    def _wait_impl(self) -> Any:
        return self._value


class _Ctx(Multistreamable):
    def record_stream(self, stream: torch.Stream) -> None:
        pass


class FakeShardedEBC(ShardedModule[Any, Any, Any, _Ctx]):
    def __init__(self, log: List[Tuple[str, int]]) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="sum")
        self.log = log

    @property
    def unsharded_module_type(self) -> Type[nn.Module]:
        return nn.EmbeddingBag

    def create_context(self) -> _Ctx:
        return _Ctx()

    def input_dist(self, ctx: _Ctx, features: KeyedJaggedTensor) -> Awaitable[Awaitable[Any]]:
        self.log.append(("input_dist", int(features.values().sum())))
        return _Ready(_Ready(features))

    def compute(self, ctx: _Ctx, dist_input: KeyedJaggedTensor) -> torch.Tensor:
        self.log.append(("compute", int(dist_input.values().sum())))
        per_feature = []
        for key in FEATURES:
            jt = dist_input[key]
            per_feature.append(self.bag(jt.values(), offsets=jt.offsets()[:-1]))
        return torch.cat(per_feature, dim=1)

    def output_dist(self, ctx: _Ctx, output: torch.Tensor) -> LazyNoWait[KeyedTensor]:
        return LazyNoWait(
            KeyedTensor(keys=FEATURES, length_per_key=[DIM] * len(FEATURES), values=output)
        )


@dataclass
class Batch(Pipelineable):
    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense.record_stream(stream)
        self.sparse.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return self


@dataclass
class NestedBatch(Pipelineable):
    dense: torch.Tensor
    features: Dict[str, KeyedJaggedTensor]
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "NestedBatch":
        return NestedBatch(
            self.dense.to(device, non_blocking=non_blocking),
            {k: v.to(device, non_blocking=non_blocking) for k, v in self.features.items()},
            self.labels.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense.record_stream(stream)
        for kjt in self.features.values():
            kjt.record_stream(stream)
        self.labels.record_stream(stream)


class TinyModel(nn.Module):
    """dense + fake sharded EBC -> (per-sample loss, prediction)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.log: List[Tuple[str, int]] = []
        self.sparse = FakeShardedEBC(self.log)
        self.dense = nn.Linear(3, DIM)
        self.over = nn.Linear(DIM * (len(FEATURES) + 1), 1)

    def features(self, batch: Any) -> KeyedJaggedTensor:
        return batch.sparse

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        embedded = self.sparse(batch.sparse).values()
        return _head(self, embedded, batch)


class NestedModel(TinyModel):
    def forward(self, batch: NestedBatch) -> Tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        embedded = self.sparse(batch.features["ids"]).values()
        return _head(self, embedded, batch)


class ModifyingModel(TinyModel):
    """Permutes the KJT before the sharded module: cannot be pipelined."""

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        embedded = self.sparse(batch.sparse.permute([1, 0])).values()
        return _head(self, embedded, batch)


class TwiceModel(TinyModel):
    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        embedded = self.sparse(batch.sparse).values() + self.sparse(batch.sparse).values()
        return _head(self, embedded, batch)


def _head(
    model: TinyModel, embedded: torch.Tensor, batch: Any
) -> Tuple[torch.Tensor, torch.Tensor]:
    x = torch.cat([embedded, model.dense(batch.dense)], dim=1)
    logits = model.over(x).squeeze(1)
    loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
    return loss, logits.detach()


def make_batches(n: int, batch_size: int = 3, seed: int = 1, nested: bool = False) -> List[Any]:
    g = torch.Generator().manual_seed(seed)
    out: List[Any] = []
    for _ in range(n):
        lengths = torch.randint(0, 3, (len(FEATURES) * batch_size,), generator=g)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths)
        dense = torch.rand(batch_size, 3, generator=g)
        labels = torch.randint(0, 2, (batch_size,), generator=g).float()
        out.append(
            NestedBatch(dense, {"ids": kjt}, labels) if nested else Batch(dense, kjt, labels)
        )
    return out


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def plain_loop(model: nn.Module, batches: List[Any]) -> List[torch.Tensor]:
    """The non-pipelined reference: one batch at a time, fully synchronous."""
    optimizer = optimizer_for(model)
    outputs = []
    for batch in batches:
        optimizer.zero_grad()
        loss, pred = model(batch)
        torch.sum(loss, dim=0).backward()
        optimizer.step()
        outputs.append(pred)
    return outputs


def drain(pipeline: Any, iterator: Any, limit: int = 1000) -> List[Any]:
    outputs = []
    for _ in range(limit):
        try:
            outputs.append(pipeline.progress(iterator))
        except StopIteration:
            return outputs
    raise AssertionError(f"pipeline did not stop after {limit} steps")


def assert_same_training(
    ours: List[torch.Tensor], ref: List[torch.Tensor], model: nn.Module, ref_model: nn.Module
) -> None:
    assert len(ours) == len(ref), f"{len(ours)} steps, expected {len(ref)}"
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert torch.equal(a, b), f"output differs at step {step}"
    for (name, a), (_, b) in zip(
        model.state_dict().items(), ref_model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), f"weight {name} differs"


def sparse_dist_pipeline(model: nn.Module, **kwargs: Any) -> Any:
    from trec_pipelines import TrainPipelineSparseDist

    return TrainPipelineSparseDist(model, optimizer_for(model), torch.device("cpu"), **kwargs)


def base_pipeline(model: nn.Module, **kwargs: Any) -> Any:
    from trec_pipelines import TrainPipelineBase

    return TrainPipelineBase(model, optimizer_for(model), torch.device("cpu"), **kwargs)
