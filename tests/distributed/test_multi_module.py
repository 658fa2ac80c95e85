"""A model with three sharded modules: a weighted EBC, an EBC and an EmbeddingCollection.

Each reads its own KeyedJaggedTensor field; the last batch is shorter.  Checks
the splits fusion across modules, both embedding output kinds, and the FX ->
direct fallback on a forward FX cannot trace, against torchrec and the plain loop.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torchrec.distributed.train_pipeline as upstream
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipelineSemiSync as UpstreamSemiSync,
)
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

import trec_pipelines
from trec_pipelines.testing import devices, plans
from trec_pipelines.testing.dlrm import (
    FieldwiseBatch,
    Run,
    assert_runs_equal,
    current_group,
    run_pipeline,
    weights,
)
from trec_pipelines.testing.torchrec_cpu import torchrec_on_cpu

DEVICE = devices.device()


@dataclass
class Batch(FieldwiseBatch):
    dense: torch.Tensor
    user: KeyedJaggedTensor  # weighted
    item: KeyedJaggedTensor
    seq: KeyedJaggedTensor
    labels: torch.Tensor


class ThreeTowers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="u0", embedding_dim=8, num_embeddings=60, feature_names=["u0"]
                ),
                EmbeddingBagConfig(
                    name="u1", embedding_dim=8, num_embeddings=40, feature_names=["u1"]
                ),
            ],
            is_weighted=True,
            device=DEVICE,
        )
        self.item = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="i0", embedding_dim=16, num_embeddings=80, feature_names=["i0", "i1"]
                )
            ],
            device=DEVICE,
        )
        self.seq = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name="s0", embedding_dim=8, num_embeddings=50, feature_names=["s0"])
            ],
            device=DEVICE,
        )
        self.dense = nn.Sequential(nn.Linear(5, 8), nn.ReLU())
        self.over = nn.Linear(8 + 16 + 16 + 8 + 8, 1)

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        user, item, seq = self.user(batch.user), self.item(batch.item), self.seq(batch.seq)
        seq_summary = seq["s0"].values().sum(0, keepdim=True) * torch.ones_like(batch.dense[:, :1])
        x = torch.cat(
            [self.dense(batch.dense), item["i0"], item["i1"], user["u0"] + user["u1"], seq_summary],
            1,
        )
        logits = self.over(x).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()


class Untraceable(ThreeTowers):
    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        if float(batch.dense.sum()) > -1:  # data-dependent control flow
            return super().forward(batch)
        raise AssertionError


def make_batches(n: int = 7, batch_size: int = 6) -> List[Batch]:
    g = torch.Generator().manual_seed(5 + dist.get_rank())

    def kjt(
        keys: List[str], max_len: int, rows: int, size: int, weighted: bool = False
    ) -> KeyedJaggedTensor:
        lengths = torch.randint(0, max_len + 1, (len(keys) * size,), generator=g)
        values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
        w = torch.rand(int(lengths.sum()), generator=g) if weighted else None
        return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=w)

    out = []
    for k in range(n):
        size = batch_size if k < n - 1 else 3  # a short last batch
        out.append(
            Batch(
                torch.rand(size, 5, generator=g),
                kjt(["u0", "u1"], 3, 40, size, weighted=True),
                kjt(["i0", "i1"], 2, 80, size),
                kjt(["s0"], 4, 50, size),
                torch.randint(0, 2, (size,), generator=g).float(),
            )
        )
    return out


def build(sharding_type: str, cls: type = ThreeTowers) -> Tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = cls()
    for module in (model.user, model.item, model.seq):
        apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.2})
    pg = current_group()
    sharders = [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]
    constraints = {
        t: ParameterConstraints(sharding_types=[sharding_type]) for t in ("u0", "u1", "i0", "s0")
    }
    plan = plans.plan(model, sharders, pg, constraints)
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(pg), device=DEVICE, plan=plan, sharders=sharders
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda p: torch.optim.Adam(p, lr=0.01),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def plain(sharding_type: str, cls: type = ThreeTowers) -> Run:
    dmp, optimizer = build(sharding_type, cls)
    outputs = []
    for batch in make_batches():
        optimizer.zero_grad()
        loss, pred = dmp(batch)
        torch.sum(loss, dim=0).backward()
        optimizer.step()
        outputs.append(pred)
    return Run(outputs, weights(dmp))


def run(
    pipeline_cls: Any,
    sharding_type: str,
    shim: bool = False,
    cls: type = ThreeTowers,
    **kwargs: Any,
) -> Tuple[Run, Any]:
    dmp, optimizer = build(sharding_type, cls)
    pipeline = pipeline_cls(dmp, optimizer, DEVICE, **kwargs)
    with torchrec_on_cpu() if shim else contextlib.nullcontext():
        return run_pipeline(pipeline, make_batches(), model=dmp), pipeline


@pytest.mark.parametrize("sharding_type", ["table_wise", "column_wise"])
@pytest.mark.parametrize(
    "name,shim",
    [
        ("TrainPipelineBase", False),
        ("TrainPipelineSparseDist", False),
        ("TrainPipelineFusedSparseDist", True),
    ],
)
def test_three_sharded_modules_against_torchrec_and_plain_loop(
    name: str, shim: bool, sharding_type: str
) -> None:
    ref = plain(sharding_type)
    theirs, _ = run(getattr(upstream, name), sharding_type, shim=shim)
    ours, pipeline = run(getattr(trec_pipelines, name), sharding_type)
    assert_runs_equal(ref, theirs, ("plain_loop", "torchrec"))
    assert_runs_equal(ref, ours, ("plain_loop", "trec_pipelines"))
    if hasattr(pipeline, "rewrite_result"):
        assert sorted(pipeline.rewrite_result.names) == ["item", "seq", "user"]


@pytest.mark.parametrize("name", ["TrainPipelineSparseDistLite", "PrefetchTrainPipelineSparseDist"])
def test_three_sharded_modules_other_variants(name: str) -> None:
    assert_runs_equal(
        plain("table_wise"),
        run(getattr(trec_pipelines, name), "table_wise")[0],
        ("plain_loop", name),
    )


def test_three_sharded_modules_semi_sync_against_torchrec() -> None:
    theirs, _ = run(UpstreamSemiSync, "table_wise", shim=True, start_batch=2)
    ours, _ = run(trec_pipelines.TrainPipelineSemiSync, "table_wise", start_batch=2)
    assert_runs_equal(theirs, ours, ("torchrec", "trec_pipelines"))


def test_untraceable_forward_falls_back_to_direct_binding() -> None:
    ref = plain("table_wise", Untraceable)
    ours, pipeline = run(trec_pipelines.TrainPipelineSparseDist, "table_wise", cls=Untraceable)
    assert_runs_equal(ref, ours, ("plain_loop", "direct binding"))
    result = pipeline.rewrite_result
    assert result.strategy == "direct" and "Proxy" in (result.fallback_reason or "")
    assert sorted(result.names) == ["item", "seq", "user"]
