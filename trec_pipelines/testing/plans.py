"""Sharding plans for the distributed tier, made once per layout.

[Note: one plan per layout]
Most tests of the tier shard a model of the same few layouts (the same tables,
the same sharding type, the same world size), and torchrec's planner took
about a fifth of the tier's time: besides the search itself, the planner's
method logger formats ``repr(module)`` on every call, every weight of every
table printed in full, whatever the log level.  :func:`plan` makes the plan of
a layout once per process and hands every later build a deep copy of it.

The key is everything the planner reads: each embedding module's path, class
and table configs, the constraints, the sharders (class and fused params), the
world size and the device type.  The weights are not in it: a plan places
tables, it never reads their values.

A miss plans on each rank by itself (``planner.plan``), not on rank 0 with a
broadcast (``planner.collective_plan``): a test that fails on one rank before
it plans would otherwise leave the ranks' caches different, and the next test
of that layout would have one rank in the planner's broadcast while the other,
holding a plan already, had gone on to the model's own collectives.  The
planner is deterministic for the same inputs, so every rank makes the same
plan; were it not, the sharded model's construction would fail on the spot.
"""

import copy
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from trec_pipelines.testing import devices

_plans: Dict[Tuple[object, ...], ShardingPlan] = {}
_made = 0


def _layout(module: nn.Module) -> Tuple[Tuple[str, str, str], ...]:
    """Each embedding module's path, class and table configs (what the planner shards)."""
    found = []
    for path, sub in module.named_modules():
        for reader in ("embedding_bag_configs", "embedding_configs"):
            configs = getattr(sub, reader, None)
            if callable(configs):
                found.append((path, type(sub).__qualname__, repr(configs())))
                break
    return tuple(found)


def plan(
    module: nn.Module,
    sharders: List[ModuleSharder[nn.Module]],
    pg: dist.ProcessGroup,
    constraints: Optional[Dict[str, ParameterConstraints]] = None,
) -> ShardingPlan:
    """The plan ``EmbeddingShardingPlanner`` makes for ``module`` over ``pg`` on
    this device type (a copy of the one made for the same layout before, if any)."""
    global _made
    world_size = dist.get_world_size(pg)
    device_type = devices.device().type
    key = (
        _layout(module),
        repr(sorted((constraints or {}).items())),
        tuple((type(s).__qualname__, repr(getattr(s, "fused_params", None))) for s in sharders),
        world_size,
        device_type,
    )
    if key not in _plans:
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world_size, compute_device=device_type),
            constraints=constraints,
        )
        _plans[key] = planner.plan(module, sharders)
        _made += 1
    return copy.deepcopy(_plans[key])


def plans_made() -> int:
    """How many plans this process has made (the rest were copies)."""
    return _made
