"""Models with postproc modules, on the fake sharded module of :mod:`tests.unit.fakes`.

Every postproc here is ours: a small stand-in for what real models put between
the batch and a sharded module (a negative sampler or id hasher rewriting the
KJT, a feature selector, a dense rescaling).  Each counts its calls, so tests
can check it ran once per batch.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.unit.fakes import ROWS, Batch, TinyModel, _head


class HashIds(nn.Module):
    """Moves every id by a fixed offset (a buffer, not a parameter) and doubles
    the dense features: the sharded module and the dense part both read its output."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.tensor(7))
        self.calls = 0

    def forward(self, batch: Batch) -> Batch:
        self.calls += 1
        kjt = batch.sparse
        moved = KeyedJaggedTensor(
            keys=kjt.keys(), values=(kjt.values() + self.offset) % ROWS, lengths=kjt.lengths()
        )
        return Batch(batch.dense * 2.0, moved, batch.labels)


class LearnedScale(HashIds):
    """HashIds with a trainable parameter: must not run ahead."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, batch: Batch) -> Batch:
        out = super().forward(batch)
        return Batch(out.dense * self.scale, out.sparse, out.labels)


class AsList(nn.Module):
    """Wraps its KJT in a one-element list (as upstream's feature selectors return)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, kjt: KeyedJaggedTensor) -> List[KeyedJaggedTensor]:
        self.calls += 1
        return [KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths())]


class PostprocModel(TinyModel):
    """batch -> hash -> as_list -> [0] -> sparse; the dense part reads the hashed batch."""

    def __init__(self, hash_module: nn.Module | None = None, seed: int = 0) -> None:
        super().__init__(seed)
        self.hasher = hash_module if hash_module is not None else HashIds()
        self.as_list = AsList()

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        hashed = self.hasher(batch)
        embedded = self.sparse(self.as_list(hashed.sparse)[0]).values()
        return _head(self, embedded, hashed)


class DenseTenth(nn.Module):
    def forward(self, batch: Batch) -> torch.Tensor:
        return batch.dense * 0.1


class Mix(nn.Module):
    """Takes a list and a dict mixing constants, batch fields and another postproc's output."""

    def forward(self, batch: Batch, extra: List[Any], named: Dict[str, Any]) -> Batch:
        dense = batch.dense
        for value in list(extra) + list(named.values()):
            dense = dense + value
        return Batch(dense, batch.sparse, batch.labels)


class CollectionArgsModel(TinyModel):
    """tenth(batch) feeds mix(batch, [1, batch.dense, tenth], {...}), which feeds sparse."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.tenth = DenseTenth()
        self.mix = Mix()

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        tenth = self.tenth(batch)
        mixed = self.mix(
            batch, [1, batch.dense, tenth], {"one": 1, "dense": batch.dense, "tenth": tenth}
        )
        embedded = self.sparse(mixed.sparse).values()
        return _head(self, embedded, mixed)


class CalledTwiceModel(TinyModel):
    """The same postproc on two different inputs: one cached output can't serve both."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.hasher = HashIds()

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        once = self.hasher(batch)
        twice = self.hasher(once)
        embedded = self.sparse(twice.sparse).values()
        return _head(self, embedded, once)


class InlineEditModel(TinyModel):
    """The KJT is rebuilt inline (not in a module) before the postproc: nothing runs ahead."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.as_list = AsList()

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        kjt = batch.sparse
        rebuilt = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values(), kjt.lengths())
        embedded = self.sparse(self.as_list(rebuilt)[0]).values()
        return _head(self, embedded, batch)
