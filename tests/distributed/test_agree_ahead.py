"""``agree_ahead=False``: the ranks still agree on every pull, with no host batch
pulled ahead for it (see the memory guide and [Note: agreeing on each batch])."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

import trec_pipelines
from trec_pipelines.observe.memory import footprint, owned_storages
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    Run,
    _snapshot,
    assert_runs_equal,
    make_batches,
    make_sharded,
    weights,
)
from trec_pipelines.testing.references import plain_loop_of

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 7

PIPELINES: Dict[str, Callable[..., Any]] = {
    "TrainPipelineSparseDist": lambda dmp, opt, **kw: trec_pipelines.TrainPipelineSparseDist(
        dmp, opt, DEVICE, **kw
    ),
    "TrainPipelineBase": lambda dmp, opt, **kw: trec_pipelines.TrainPipelineBase(
        dmp, opt, DEVICE, **kw
    ),
    "TrainPipelineFusedSparseDist": lambda dmp, opt, **kw: (
        trec_pipelines.TrainPipelineFusedSparseDist(dmp, opt, DEVICE, **kw)
    ),
}


def _run_measuring(
    pipeline: Any, batches: List[Any], model: torch.nn.Module
) -> Tuple[Run, List[int]]:
    """Drive ``pipeline`` to the end of its data; the run, and after each step the
    host batches it held (pulled from the iterator, not yet copied)."""
    skip = owned_storages(model, getattr(pipeline, "_optimizer", None))
    it = iter(batches)
    outputs: List[Any] = []
    host: List[int] = []
    for _ in range(len(batches) + 8):
        try:
            out = pipeline.progress(it)
        except StopIteration:
            break
        outputs.append(_snapshot(out))
        host.append(footprint(pipeline, skip, host_objects=batches).host_batches)
    return Run(outputs, weights(model)), host


@pytest.mark.parametrize("name", list(PIPELINES))
def test_uneven_data_stops_every_rank_together_with_no_batch_pulled_ahead(name: str) -> None:
    """The last rank has 4 batches, the others 6.  With ``agree_ahead=False`` every
    rank still ends after 4 steps as the plain loop over the common 4 does, and
    holds no host batch after any step; with the default one is held ahead.  The
    model's group times out after 20 s, so a rank left waiting fails the test."""
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    short = dist.new_group(backend=devices.backend(), timeout=timedelta(seconds=20))
    batches = make_batches(4 if rank == last else 6, seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches[:4], seed=SEED, pg=short)
    held: Dict[bool, List[int]] = {}
    for ahead in (False, True):
        dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED, pg=short)
        pipeline = PIPELINES[name](dmp, optimizer, agree_ahead=ahead)
        assert pipeline._source.agree_ahead is ahead and pipeline._agreement is not None
        ours, held[ahead] = _run_measuring(pipeline, batches, dmp)
        steps: List[Optional[int]] = [None] * dist.get_world_size()
        dist.all_gather_object(steps, len(ours), group=short)
        assert steps == [4] * len(steps), f"agree_ahead={ahead}: stopped after {steps} steps"
        assert_runs_equal(ref, ours, ("plain_loop[:4]", f"{name}(agree_ahead={ahead})"))
        if not ahead:
            # Every pull was agreed as it was made: no exchange carried a code.
            assert pipeline._agreement.carried_pulls == 0
    assert held[False] == [0] * 4, f"host batches held after each step: {held[False]}"
    assert max(held[True]) == 1, f"host batches held after each step: {held[True]}"
