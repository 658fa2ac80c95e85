"""The benchmark's model and data: a DLRM-style network over a sharded EmbeddingBagCollection.

* :class:`ModelSpec` holds the shapes (tables, arches, pooling, interaction);
  :func:`default_spec` is the model the issue asks for, :func:`tiny_spec` the
  one whose step is so cheap that the pipeline's own Python work dominates.
* :func:`make_batches` builds synthetic batches up front, so the timed loops
  measure training and not data generation.
* :func:`make_sharded` returns ``(dmp, optimizer)``: the model sharded over a
  process group, with the usual torchrec recipe (fused in-backward Adagrad for
  the embeddings, Adagrad for the dense part).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.crossnet import LowRankCrossNet
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from trec_pipelines.testing import devices

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
INTERACTIONS = ("concat", "dcn")


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of the benchmark model.

    Attributes:
        rows: rows of every embedding table.
        dims: one embedding dimension per table (the number of tables).
        pooling: mean ids per sample and feature; lengths are uniform in
            ``[0, 2 * pooling]``, so some bags are empty.  Unused with ``poolings``.
        dense_in: dense input features.
        dense_arch: hidden sizes of the bottom MLP (its last size feeds the interaction).
        over_arch: hidden sizes of the top MLP, before the final logit.
        poolings: fixed ids per sample of each table (every bag of table ``i``
            holds exactly ``poolings[i]`` ids, as in a multi-hot data set such
            as MLPerf's DLRM-DCNv2); empty: random lengths around ``pooling``.
        interaction: how the dense output and the pooled embeddings meet before
            the top MLP: ``"concat"`` (concatenated) or ``"dcn"`` (concatenated,
            then a low-rank DCNv2 cross network, as in MLPerf's DLRM-DCNv2).
        dcn_layers: cross layers of the ``"dcn"`` interaction.
        dcn_rank: rank of each cross layer's low-rank weight (``"dcn"``).
        stash_weights: mark every table ``stash_weights`` (the embedding-stash
            variants' contenders: what they move off a GPU between lookup and
            backward; nothing else reads it).
    """

    rows: int
    dims: Tuple[int, ...]
    pooling: int
    dense_in: int
    dense_arch: Tuple[int, ...]
    over_arch: Tuple[int, ...]
    stash_weights: bool = False
    poolings: Tuple[int, ...] = ()
    interaction: str = "concat"
    dcn_layers: int = 3
    dcn_rank: int = 64

    def __post_init__(self) -> None:
        if self.poolings and len(self.poolings) != len(self.dims):
            raise ValueError(
                f"poolings takes one bag size per table ({len(self.dims)}), got {len(self.poolings)}"
            )
        if self.poolings and min(self.poolings) < 1:
            raise ValueError(f"poolings must be positive, got {self.poolings}")
        if self.interaction not in INTERACTIONS:
            raise ValueError(
                f"interaction must be one of {', '.join(INTERACTIONS)}, got {self.interaction!r}"
            )
        if self.dcn_layers < 1 or self.dcn_rank < 1:
            raise ValueError(
                f"dcn_layers and dcn_rank must be >= 1, got {self.dcn_layers}, {self.dcn_rank}"
            )

    @property
    def ids_per_sample(self) -> float:
        """Ids per sample over every table (the mean with random lengths)."""
        return float(sum(self.poolings)) if self.poolings else float(self.pooling * len(self.dims))

    def lengths(self, batch_size: int, g: torch.Generator) -> torch.Tensor:
        """One batch's bag lengths, key-major (a KJT's layout): fixed per table with ``poolings``."""
        if self.poolings:
            return torch.tensor(self.poolings).repeat_interleave(batch_size)
        return torch.randint(0, 2 * self.pooling + 1, (len(self.dims) * batch_size,), generator=g)

    @property
    def features(self) -> List[str]:
        return [f"f{i}" for i in range(len(self.dims))]

    def table_configs(self) -> List[EmbeddingBagConfig]:
        return [
            EmbeddingBagConfig(
                name=f"t{i}",
                feature_names=[f"f{i}"],
                num_embeddings=self.rows,
                embedding_dim=dim,
                pooling=PoolingType.SUM,
                stash_weights=self.stash_weights,
            )
            for i, dim in enumerate(self.dims)
        ]


def tiny_spec() -> ModelSpec:
    """Two small tables and one-layer arches: a step costs well under a millisecond of compute."""
    return ModelSpec(rows=100, dims=(8, 8), pooling=2, dense_in=4, dense_arch=(8,), over_arch=(8,))


@dataclass
class Batch(Pipelineable):
    """Dense features, the sparse ids as one KJT, and binary labels."""

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    # Make new tensors in to() even for the batch's own device, as a real
    # host-to-device copy does (the memory-options measurement; see
    # benchmarks/memory.py).  Off, to() on CPU hands over these very tensors.
    copying: bool = False

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        if self.copying:
            sparse = self.sparse
            return Batch(
                dense=self.dense.to(device=device, copy=True),
                sparse=KeyedJaggedTensor.from_lengths_sync(
                    keys=sparse.keys(),
                    values=sparse.values().to(device=device, copy=True),
                    lengths=sparse.lengths().to(device=device, copy=True),
                ),
                labels=self.labels.to(device=device, copy=True),
            )
        return Batch(
            dense=self.dense.to(device=device, non_blocking=non_blocking),
            sparse=self.sparse.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense.record_stream(stream)
        self.sparse.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return Batch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory())


def make_batches(spec: ModelSpec, n: int, batch_size: int, seed: int, rank: int) -> List[Batch]:
    """``n`` synthetic batches for ``rank`` (ranks get different data, as in real training)."""
    g = torch.Generator().manual_seed(seed * 100_003 + rank * 7919 + batch_size)
    batches = []
    for _ in range(n):
        lengths = spec.lengths(batch_size, g)
        values = torch.randint(0, spec.rows, (int(lengths.sum()),), generator=g)
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=spec.features, values=values, lengths=lengths.int()
        )
        batches.append(
            Batch(
                dense=torch.randn(batch_size, spec.dense_in, generator=g),
                sparse=sparse,
                labels=torch.randint(0, 2, (batch_size,), generator=g).float(),
            )
        )
    return batches


def _mlp(sizes: Sequence[int], last_activation: bool) -> nn.Sequential:
    layers: List[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP on the dense features, pooled embeddings, top MLP to one logit.

    The interaction (``spec.interaction``) joins the bottom MLP's output and
    the pooled embeddings: concatenated, or concatenated and crossed by a
    low-rank DCNv2 cross network (torchrec's ``LowRankCrossNet``).

    ``forward(batch)`` returns ``(loss, logits)``: the per-sample BCE loss
    (pipelines backprop ``sum(loss)``) and the detached logits.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.features = spec.features
        # On the meta device: DistributedModelParallel allocates and initialises
        # each rank's shards.  Tables built on the CPU stayed alive after
        # sharding, with the Adagrad state apply_optimizer_in_backward gives
        # them (torch keeps every such parameter in a map whose values point
        # back at it): ~230 MB per contender, too much for a 24 GB machine
        # running every variant in one process.
        self.ebc = EmbeddingBagCollection(tables=spec.table_configs(), device=torch.device("meta"))
        self.dense_arch = _mlp((spec.dense_in, *spec.dense_arch), last_activation=True)
        over_in = spec.dense_arch[-1] + sum(spec.dims)
        self.cross: Optional[nn.Module] = (
            LowRankCrossNet(over_in, num_layers=spec.dcn_layers, low_rank=spec.dcn_rank)
            if spec.interaction == "dcn"
            else None
        )
        self.over_arch = _mlp((over_in, *spec.over_arch, 1), last_activation=False)

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.sparse).to_dict()
        x = torch.cat([self.dense_arch(batch.dense)] + [pooled[f] for f in self.features], dim=1)
        if self.cross is not None:
            x = self.cross(x)
        logits = self.over_arch(x).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(
            logits, batch.labels, reduction="none"
        )
        return loss, logits.detach()


def make_sharded(
    spec: ModelSpec,
    sharding_type: str,
    pg: dist.ProcessGroup,
    seed: int = 0,
    emb_lr: float = 0.05,
    dense_lr: float = 0.01,
) -> Tuple[DistributedModelParallel, CombinedOptimizer]:
    """``(dmp, optimizer)``: :class:`DLRM` sharded over ``pg``, every table ``sharding_type``.

    Embeddings train with a fused in-backward Adagrad (the TBE kernel updates
    them inside backward); the dense parameters with an Adagrad stepped by
    ``optimizer.step()``.  The tables are initialised by the sharding (from
    the table configs, under ``seed``): two calls with one seed build equal
    models.
    """
    if sharding_type not in SHARDING_TYPES:
        raise ValueError(f"sharding_type must be one of {SHARDING_TYPES}, got {sharding_type!r}")
    torch.manual_seed(seed)
    model = DLRM(spec)
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": emb_lr})
    kernel = "dense" if sharding_type == "data_parallel" else "fused"
    constraints = {
        config.name: ParameterConstraints(sharding_types=[sharding_type], compute_kernels=[kernel])
        for config in spec.table_configs()
    }
    sharders = [EmbeddingBagCollectionSharder()]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(pg), compute_device=devices.device().type),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, sharders, pg)
    dmp = DistributedModelParallel(
        module=model,
        env=ShardingEnv.from_process_group(pg),
        device=devices.device(),
        plan=plan,
        sharders=sharders,
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=dense_lr),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])
