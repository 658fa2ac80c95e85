"""A :class:`~trec_pipelines.testing.dlrm_net.SpecDLRM` at any shapes: its synthetic data and its sharded build.

* :func:`make_spec_batches` builds synthetic batches up front (the tests' :class:`Batch`),
  so a timed loop measures training and not data generation;
* :func:`make_spec_sharded` returns ``(dmp, optimizer)``: the model sharded over a
  process group with the usual torchrec recipe (fused in-backward Adagrad for the
  embeddings, Adagrad for the dense part), its tables initialised by the sharding.

The benchmark builds its models with these; the tests' small DLRM has its own
helpers in :mod:`trec_pipelines.testing.dlrm` (same network, weights copied in).
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import (  # type: ignore[attr-defined]
    _apply_optimizer_in_backward as apply_optimizer_in_backward,
)
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ModuleSharder, ShardingEnv
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import Batch
from trec_pipelines.testing.dlrm_net import SpecDLRM
from trec_pipelines.testing.dlrm_spec import SHARDING_TYPES, ModelSpec


def make_spec_batches(
    spec: ModelSpec, n: int, batch_size: int, seed: int, rank: int
) -> List[Batch]:
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


def make_spec_sharded(
    spec: ModelSpec,
    sharding_type: str,
    pg: dist.ProcessGroup,
    seed: int = 0,
    emb_lr: float = 0.05,
    dense_lr: float = 0.01,
) -> Tuple[DistributedModelParallel, CombinedOptimizer]:
    """``(dmp, optimizer)``: :class:`SpecDLRM` sharded over ``pg``, every table ``sharding_type``.

    Embeddings train with a fused in-backward Adagrad (the TBE kernel updates
    them inside backward); the dense parameters with an Adagrad stepped by
    ``optimizer.step()``.  The tables are initialised by the sharding (from
    the table configs, under ``seed``): two calls with one seed build equal
    models.
    """
    if sharding_type not in SHARDING_TYPES:
        raise ValueError(f"sharding_type must be one of {SHARDING_TYPES}, got {sharding_type!r}")
    torch.manual_seed(seed)
    # The tables on the meta device: DistributedModelParallel allocates and
    # initialises each rank's shards.  Tables built on the CPU stay alive after
    # sharding, with the Adagrad state apply_optimizer_in_backward gives them
    # (torch keeps every such parameter in a map whose values point back at
    # it): too much memory for a machine running every variant in one process.
    model = SpecDLRM(spec, table_device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": emb_lr})
    kernel = "dense" if sharding_type == "data_parallel" else "fused"
    constraints = {
        config.name: ParameterConstraints(sharding_types=[sharding_type], compute_kernels=[kernel])
        for config in spec.table_configs()
    }
    sharders: List[ModuleSharder[nn.Module]] = [EmbeddingBagCollectionSharder()]  # type: ignore[list-item]
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


__all__ = ["make_spec_batches", "make_spec_sharded"]
