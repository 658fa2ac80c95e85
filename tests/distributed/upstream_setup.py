"""Upstream's test setting, rebuilt on 2+ gloo ranks for the ``test_upstream_*`` files.

torchrec's own pipeline tests (``test_train_pipelines.py``) train its
``TestSparseNN`` (4 tables, 2 weighted tables, dense and over arches) on
``ModelInput`` batches, sharded by an EBC sharder held to one sharding type and
one kernel, and compare a pipelined copy with a non-pipelined one.  They run
on one GPU; here the same model and data run on every rank of the test's gloo
group, so the all-to-alls really move data.

    Setting(sharding_type, kernel).pair()  -> (reference dmp, its optimizer), (pipelined dmp, its optimizer)
    generate_data(n, batch_size, seed)     -> this rank's ModelInput batches
    non_pipelined(dmp, optimizer, batches) -> Run (per-step predictions + final weights)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.test_utils.emb_sharder import TestEBCSharder
from torchrec.distributed.test_utils.test_model import ModelInput, TestSparseNN
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import Run, current_group, weights

DEVICE = devices.device()
FUSED = EmbeddingComputeKernel.FUSED.value
NUM_FLOAT_FEATURES = 10


def tables() -> Tuple[List[EmbeddingBagConfig], List[EmbeddingBagConfig]]:
    """Upstream's tables: 4 unweighted (rows 100..400, dims 4..16), 2 weighted."""
    plain = [
        EmbeddingBagConfig(
            num_embeddings=(i + 1) * 100,
            embedding_dim=(i + 1) * 4,
            name=f"table_{i}",
            feature_names=[f"feature_{i}"],
        )
        for i in range(4)
    ]
    weighted = [
        EmbeddingBagConfig(
            num_embeddings=(i + 1) * 100,
            embedding_dim=(i + 1) * 4,
            name=f"weighted_table_{i}",
            feature_names=[f"weighted_feature_{i}"],
        )
        for i in range(2)
    ]
    return plain, weighted


def generate_data(num_batches: int = 5, batch_size: int = 1, seed: int = 0) -> List[ModelInput]:
    """This rank's batches: upstream's generator, seeded by ``seed`` and the rank."""
    plain, weighted = tables()
    rank = dist.get_rank()
    state = torch.random.get_rng_state()
    torch.manual_seed(seed * 1000 + rank * 7919 + 3)
    try:
        return [
            ModelInput.generate(
                tables=plain,
                weighted_tables=weighted,
                batch_size=batch_size,
                world_size=1,
                num_float_features=NUM_FLOAT_FEATURES,
            )[1][0]
            for _ in range(num_batches)
        ]
    finally:
        torch.random.set_rng_state(state)


def copy_state(src: Dict[str, Any], dst: Dict[str, Any]) -> None:
    """Make ``dst`` (a DMP state dict sharded by the same plan) equal ``src``."""
    for key, value in src.items():
        target = dst[key]
        if isinstance(value, ShardedTensor):
            for mine, theirs in zip(target.local_shards(), value.local_shards(), strict=True):
                mine.tensor.copy_(theirs.tensor)
        else:
            target.copy_(value)


@dataclass
class Setting:
    """One sharding type and kernel for every table, upstream's recipe otherwise."""

    sharding_type: str
    kernel: str = FUSED
    fused_params: Dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def model(self) -> nn.Module:
        plain, weighted = tables()
        torch.manual_seed(self.seed)
        return TestSparseNN(
            tables=plain,
            weighted_tables=weighted,
            num_float_features=NUM_FLOAT_FEATURES,
            dense_device=DEVICE,
            sparse_device=torch.device("meta"),
        )

    def shard(self, model: nn.Module) -> Tuple[DistributedModelParallel, torch.optim.Optimizer]:
        """Shard a copy of ``model``; SGD(lr=0.1) over the parameters that are not
        in a fused table (those are updated in the backward)."""
        sharder = TestEBCSharder(self.sharding_type, self.kernel, dict(self.fused_params))
        dmp = DistributedModelParallel(
            module=copy.deepcopy(model),
            env=ShardingEnv.from_process_group(current_group()),
            init_data_parallel=False,
            device=DEVICE,
            sharders=[sharder],  # type: ignore[list-item]
        )
        fused = set(DistributedModelParallel._sharded_parameter_names(dmp))
        dense = [p for name, p in dmp.named_parameters() if name not in fused]
        return dmp, torch.optim.SGD(dense, lr=0.1)

    def pair(self, n: int = 2) -> List[Tuple[DistributedModelParallel, torch.optim.Optimizer]]:
        """``n`` sharded copies of one model, with equal weights."""
        model = self.model()
        copies = [self.shard(model) for _ in range(n)]
        with torch.no_grad():
            for dmp, _ in copies[1:]:
                copy_state(copies[0][0].state_dict(), dmp.state_dict())
        return copies


def non_pipelined(model: nn.Module, optimizer: torch.optim.Optimizer, batches: List[Any]) -> Run:
    """Upstream's reference loop: zero_grad, forward, ``loss.backward()``, step."""
    outputs = []
    for batch in batches:
        optimizer.zero_grad()
        loss, pred = model(batch)
        loss.backward()
        optimizer.step()
        outputs.append(pred.detach().clone())
    return Run(outputs, weights(model))


def eval_loop(model: nn.Module, batches: List[Any]) -> Run:
    model.eval()
    with torch.no_grad():
        outputs = [model(batch)[1].detach().clone() for batch in batches]
    return Run(outputs, weights(model))


def optional_run(pipeline: Any, batches: List[Any], model: Optional[nn.Module] = None) -> Run:
    """Drive ``pipeline`` until StopIteration and check it stays stopped."""
    from trec_pipelines.testing.dlrm import run_pipeline

    it = iter(batches)
    run = run_pipeline(pipeline, it, model=model)
    try:
        pipeline.progress(it)
    except StopIteration:
        return run
    raise AssertionError("progress() after StopIteration returned a batch instead of raising again")
