"""The bench's DLRM as a ``build`` for ``trec_pipelines.advise``.

    python -m trec_pipelines.advise --build benchmarks.advise_build:build

``build`` is the default bench model (``BenchConfig()``'s shapes, table-wise,
its learning rates) at batch ``BATCH_SIZE`` per rank, as ``make bench`` builds
it; ``tiny`` is the bench's tiny model (the overhead table's).  Batch size and
count come from ``TREC_ADVISE_BATCH_SIZE`` / ``TREC_ADVISE_BATCHES`` when set.
Both shard over the default process group and make this rank's batches with
the bench's seeds, so advise and the bench time the same model on the same data.
"""

from __future__ import annotations

import os
from typing import Any, List, Tuple

import torch.distributed as dist
from torch import nn

from benchmarks.settings.config import BenchConfig
from trec_pipelines.testing.dlrm import Batch
from trec_pipelines.testing.dlrm_sharded import make_spec_batches, make_spec_sharded
from trec_pipelines.testing.dlrm_spec import ModelSpec, tiny_spec

BATCH_SIZE = int(os.environ.get("TREC_ADVISE_BATCH_SIZE", "4096"))
BATCHES = int(os.environ.get("TREC_ADVISE_BATCHES", "25"))


def _build(spec: ModelSpec, batch_size: int, batches: int) -> Tuple[nn.Module, Any, List[Batch]]:
    cfg = BenchConfig()
    pg = dist.group.WORLD
    assert pg is not None, "advise starts the process group before calling build()"
    model, optimizer = make_spec_sharded(
        spec, cfg.sharding_type, pg, cfg.seed, cfg.emb_lr, cfg.dense_lr
    )
    return model, optimizer, make_spec_batches(spec, batches, batch_size, cfg.seed, dist.get_rank())


def build() -> Tuple[nn.Module, Any, List[Batch]]:
    """The default bench model, ``BATCHES`` batches of ``BATCH_SIZE`` per rank."""
    return _build(BenchConfig().model_spec(), BATCH_SIZE, BATCHES)


def tiny() -> Tuple[nn.Module, Any, List[Batch]]:
    """The bench's tiny model (the overhead table's), ``BATCHES`` batches of 32 per rank."""
    return _build(tiny_spec(), int(os.environ.get("TREC_ADVISE_BATCH_SIZE", "32")), BATCHES)
