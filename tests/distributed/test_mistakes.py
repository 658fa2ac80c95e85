"""Newcomers' mistakes on a sharded model: a clear error naming the fix, on every
rank at the same batch (a rank left waiting would fail by the group's timeout),
and once fixed, training equals the plain loop.  The unit tier
(tests/unit/test_mistakes.py) has a row per mistake; here, those whose checks
meet the ranks' collectives."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.distributed as dist

import trec_pipelines
from trec_pipelines.core.errors import ForwardOutputError
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
# A rank left waiting fails the test at this group's timeout instead of hanging it.
LIMIT_S = 20

VARIANTS: Dict[str, Dict[str, Any]] = {
    "TrainPipelineBase": {},
    "TrainPipelineSparseDist": {},
    "TrainPipelineSemiSync": {"start_batch": 100},  # synchronous: the plain loop is its oracle
    "TrainPipelineFusedSparseDist": {},
}

# What the broken forward returns, from the model's (loss, pred); how the message names it.
MISTAKES: Dict[str, tuple[Callable[[Any, Any, Any], Any], str]] = {
    "bare_loss": (lambda loss, pred, batch: loss, "a 0-d (scalar) tensor alone"),
    "dict": (
        lambda loss, pred, batch: {"loss": loss, "pred": pred},
        "a dict with keys ['loss', 'pred']",
    ),
    "triple": (lambda loss, pred, batch: (loss, pred, batch.labels), "a tuple of 3 elements"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_forward_without_the_pair_raises_on_every_rank_and_the_fix_trains(
    name: str, mistake: str
) -> None:
    group = dist.new_group(backend=devices.backend(), timeout=timedelta(seconds=LIMIT_S))
    batches = make_batches(5, seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED, pg=group)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED, pg=group)
    pipeline = getattr(trec_pipelines, name)(dmp, optimizer, DEVICE, **VARIANTS[name])
    wrong, described = MISTAKES[mistake]
    original = dmp.module.forward

    def broken(batch: Any) -> Any:
        loss, pred = original(batch)
        return wrong(loss, pred, batch)

    dmp.module.forward = broken
    it = iter(batches)
    with pytest.raises(ForwardOutputError) as raised:
        pipeline.progress(it)
    assert str(raised.value).startswith(
        f"{name}: the model's forward returned {described}, but a training pipeline "
        "needs torchrec's pair (losses, output)"
    )
    assert "custom_model_fwd" in str(raised.value)
    assert not getattr(raised.value, "__notes__", [])  # the model's mistake: no retry offered
    # Every rank raised at the same batch: fixed, the next progress() trains it.
    dmp.module.forward = original
    outputs: List[torch.Tensor] = []
    while True:
        try:
            outputs.append(_snapshot(pipeline.progress(it)))
        except StopIteration:
            break
    assert_runs_equal(ref, Run(outputs, weights(dmp)), ("plain loop", name))


def test_a_list_is_refused_before_any_collective_on_every_rank() -> None:
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    batches = make_batches(3, seed=DATA_SEED)
    with pytest.raises(TypeError, match=r"Pass an iterator: it = iter\(batches\)"):
        pipeline.progress(batches)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    outputs: List[torch.Tensor] = []
    it = iter(batches)
    while True:
        try:
            outputs.append(_snapshot(pipeline.progress(it)))
        except StopIteration:
            break
    assert_runs_equal(ref, Run(outputs, weights(dmp)), ("plain loop", "after the fix"))
