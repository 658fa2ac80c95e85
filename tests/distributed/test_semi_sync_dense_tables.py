"""TrainPipelineSemiSync with data-parallel tables, against a plain semi-sync loop.

Semi-sync looks each batch's fused tables up a step ahead, before the
previous batch's update; a table with the ``dense`` kernel (every
``data_parallel`` table) is looked up in its own batch's forward, after the
previous update, and so trains synchronously, like the dense parameters
(``trec_pipelines/sparse/deferred_lookup.py``).

The reference is a plain loop written for exactly that: the same DLRM with its
tables split over two collections, ``ebc`` (the fused tables, sharded as in
the pipeline's plan) and ``ebc_sync`` (the dense-kernel ones, likewise); the
loop looks ``ebc`` up for batch ``i+1`` before batch ``i``'s backward (from
``start_batch`` on; before that, at the top of ``i+1``), feeds the model
those embeddings as detached leaves, and sends their gradients back after the
dense backward, as semi-sync does; ``ebc_sync`` is looked up in the model's
forward.  Same seed, same batches: every step's output and the final weights
must be bit for bit the same (a sum over 2 or 4 ranks of the same values in
the same bucket order, so at 4 ranks too).  Every collective runs on the per-test
group (``current_group()``), whose timeout (conftest's ``PG_TIMEOUT``) bounds
a test that would hang.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    table_wise,
)
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingEnv, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedTensor

from trec_pipelines.pipelines.semi_sync import TrainPipelineSemiSync
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DENSE_LR,
    DLRM,
    EMB_LR,
    Run,
    _copy_into,
    assert_runs_equal,
    current_group,
    make_batches,
    run_pipeline,
    table_configs,
    weights,
)

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 5
N_BATCHES = 7


def _dense_optimizer(dmp: nn.Module) -> KeyedOptimizerWrapper:
    """Adagrad over every parameter without a fused optimizer: the dense part and
    the dense-kernel tables (the recipe torchrec documents)."""
    return KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=DENSE_LR),
    )


def _unsharded_dlrm() -> Tuple[DLRM, Dict[str, torch.Tensor]]:
    torch.manual_seed(SEED)
    model = DLRM()
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _shard(
    model: nn.Module, state: Dict[str, torch.Tensor], plan: Optional[ShardingPlan]
) -> DistributedModelParallel:
    """``model`` with fused Adagrad on its tables, sharded by ``plan`` (None: the planner's)."""
    for module in model.modules():
        if isinstance(module, EmbeddingBagCollection):
            apply_optimizer_in_backward(torch.optim.Adagrad, module.parameters(), {"lr": EMB_LR})
    dmp = DistributedModelParallel(
        module=model,
        env=ShardingEnv.from_process_group(current_group()),
        device=DEVICE,
        plan=plan,
        sharders=[EmbeddingBagCollectionSharder()],
    )
    with torch.no_grad():
        _copy_into(dmp.state_dict(), state)
    return dmp


class SplitDLRM(DLRM):
    """DLRM with its fused tables in ``ebc`` and its dense-kernel ones in ``ebc_sync``.

    The forward reads ``ebc``'s embeddings from ``ahead`` (looked up by the loop)
    and looks ``ebc_sync`` up itself.
    """

    def __init__(self, sync_tables: List[str]) -> None:
        super().__init__()
        configs = table_configs()
        fused = [c for c in configs if c.name not in sync_tables]
        # No collection when every table is dense-kernel (the planner may choose so).
        self.ebc = EmbeddingBagCollection(fused) if fused else None  # type: ignore[assignment]
        self.ebc_sync = EmbeddingBagCollection([c for c in configs if c.name in sync_tables])
        self.ahead: Optional[KeyedTensor] = None

    def forward(self, batch: Any) -> Any:
        ahead = self.ahead.to_dict() if self.ahead is not None else {}
        together = {**ahead, **self.ebc_sync(batch.sparse).to_dict()}
        keys = list(together)
        pooled = KeyedTensor.from_tensor_list(keys, [together[k] for k in keys])
        return self._head(batch.dense, pooled, batch.labels)


def _split_state(state: Dict[str, torch.Tensor], sync_tables: List[str]) -> Dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        table = key.split(".")[2] if key.startswith("ebc.") else None
        out[key.replace("ebc.", "ebc_sync.", 1) if table in sync_tables else key] = value
    return out


def plain_semi_sync_loop(
    ebc_plan: EmbeddingModuleShardingPlan, batches: List[Any], start_batch: int
) -> Run:
    """The reference (see the module docstring), sharded table by table as ``ebc_plan``."""
    sync_tables = sorted(t for t, s in ebc_plan.items() if s.compute_kernel == "dense")
    _, state = _unsharded_dlrm()
    model = SplitDLRM(sync_tables)
    plans = {
        "ebc": {t: s for t, s in ebc_plan.items() if t not in sync_tables},
        "ebc_sync": {t: s for t, s in ebc_plan.items() if t in sync_tables},
    }
    plan = ShardingPlan(
        {name: EmbeddingModuleShardingPlan(tables) for name, tables in plans.items() if tables}
    )
    dmp = _shard(model, _split_state(state, sync_tables), plan)
    optimizer = _dense_optimizer(dmp)
    # None when every table is dense-kernel: then nothing is looked up ahead.
    ebc = dmp.module.ebc if len(sync_tables) < len(ebc_plan) else None
    looked_up: Dict[int, KeyedTensor] = {}
    outputs = []
    for i, batch in enumerate(batches):
        optimizer.zero_grad()
        pooled, leaf = None, None
        if ebc is not None:
            # Before start_batch, batch i is looked up after batch i-1's update.
            pooled = looked_up.pop(i) if i in looked_up else ebc(batch.sparse).wait()
            leaf = pooled.values().detach().requires_grad_()
            model.ahead = KeyedTensor(pooled.keys(), pooled.length_per_key(), leaf)
        loss, out = dmp(batch)
        model.ahead = None
        if ebc is not None and i >= start_batch and i + 1 < len(batches):
            looked_up[i + 1] = ebc(batches[i + 1].sparse).wait()  # before i's update
        torch.sum(loss, dim=0).backward()
        if pooled is not None and leaf is not None:
            torch.autograd.backward([pooled.values()], [leaf.grad])  # the fused update
        optimizer.step()
        outputs.append(out.detach().clone())
    final = {key.replace("ebc_sync.", "ebc.", 1): value for key, value in weights(dmp).items()}
    return Run(outputs, final)


def pipeline_run(
    plan: Optional[ShardingPlan], batches: List[Any], start_batch: int
) -> Tuple[DistributedModelParallel, Run]:
    model, state = _unsharded_dlrm()
    dmp = _shard(model, state, plan)
    pipeline = TrainPipelineSemiSync(
        dmp, _dense_optimizer(dmp), DEVICE, start_batch=start_batch, strict=True
    )
    return dmp, run_pipeline(pipeline, batches, model=dmp)


def _ebc_plan(dmp: DistributedModelParallel) -> EmbeddingModuleShardingPlan:
    plan = dmp.plan.plan["ebc"]
    assert isinstance(plan, EmbeddingModuleShardingPlan)
    return plan


def test_the_planners_data_parallel_tables_train_synchronously() -> None:
    """DistributedModelParallel plans the four small tables itself, and picks
    data_parallel for some: the first trap of a new user."""
    batches = make_batches(N_BATCHES, seed=DATA_SEED)
    dmp, ours = pipeline_run(None, batches, start_batch=0)
    plan = _ebc_plan(dmp)
    kinds = {t: s.sharding_type for t, s in plan.items()}
    assert "data_parallel" in kinds.values(), kinds
    ref = plain_semi_sync_loop(plan, batches, start_batch=0)
    assert len(ours) == N_BATCHES
    assert_runs_equal(ref, ours, ("plain semi-sync loop", "TrainPipelineSemiSync"))
    if any(s.compute_kernel != "dense" for s in plan.values()):
        # Semi-sync took effect on the fused tables: the synchronous loop differs.
        sync = plain_semi_sync_loop(plan, batches, start_batch=N_BATCHES)
        assert any(not torch.equal(a, b) for a, b in zip(sync, ours, strict=True))


@pytest.mark.parametrize("start_batch", [0, 2])
def test_table_wise_and_data_parallel_tables_in_one_module(start_batch: int) -> None:
    """An explicit plan: t1 and t3 table_wise (fused, semi-sync), t0 and t2
    data_parallel (dense, synchronous), in one collection."""
    world = dist.get_world_size(current_group())
    model, _ = _unsharded_dlrm()
    ebc_plan = construct_module_sharding_plan(
        model.ebc,
        {
            "t0": data_parallel(),
            "t1": table_wise(rank=0, compute_kernel="fused"),
            "t2": data_parallel(),
            "t3": table_wise(rank=world - 1, compute_kernel="fused"),
        },
        world_size=world,
        local_size=world,
        device_type=DEVICE.type,
    )
    batches = make_batches(N_BATCHES, seed=DATA_SEED)
    _, ours = pipeline_run(ShardingPlan({"ebc": ebc_plan}), batches, start_batch)
    ref = plain_semi_sync_loop(ebc_plan, batches, start_batch)
    assert_runs_equal(ref, ours, ("plain semi-sync loop", "TrainPipelineSemiSync"))
    # Semi-sync took effect: the plain synchronous loop differs from some step on.
    sync = plain_semi_sync_loop(ebc_plan, batches, start_batch=N_BATCHES)
    assert any(not torch.equal(a, b) for a, b in zip(sync, ours, strict=True))


def test_a_group_mixing_dense_and_fused_kernels_is_refused() -> None:
    """Two column_wise tables, one with the dense kernel: refused at the first
    batch, with the tables and what to change."""
    world = dist.get_world_size(current_group())
    model, state = _unsharded_dlrm()
    ebc_plan = construct_module_sharding_plan(
        model.ebc,
        {
            "t0": data_parallel(),
            "t1": column_wise(ranks=[0, world - 1], compute_kernel="dense"),
            "t2": data_parallel(),
            "t3": column_wise(ranks=[0, world - 1], compute_kernel="fused"),
        },
        world_size=world,
        local_size=world,
        device_type=DEVICE.type,
    )
    dmp = _shard(model, state, ShardingPlan({"ebc": ebc_plan}))
    pipeline = TrainPipelineSemiSync(dmp, _dense_optimizer(dmp), DEVICE, start_batch=0)
    with pytest.raises(ValueError, match=r"column_wise tables \['t1'\] \(dense kernel\)"):
        pipeline.progress(iter(make_batches(3, seed=DATA_SEED)))
