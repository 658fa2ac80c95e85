"""Eval over uneven shards: every rank scores all of its own batches (``uneven_data="pad"``).

Each rank holds a different number of eval batches.  A rank whose data ended
runs padding steps (its own last batch again, output thrown away) until every
rank's has, so its ``progress()`` returns exactly its own batches' outputs and
then raises ``StopIteration``.  References: each rank's batches run alone
through the unsharded model, and a plain (non-pipelined) eval loop over the
sharded model in which a rank out of data runs its last batch again (the
padding written out by hand).  Every case runs the model on a process group
whose collectives time out after 20 s, so a rank left waiting fails the test
instead of hanging it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

import pytest
import torch
import torch.distributed as dist

import trec_pipelines
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    Run,
    assert_runs_equal,
    make_batches,
    make_sharded,
    plain_loop,
    run_pipeline,
)
from trec_pipelines.testing.references import kept

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 7
TIMEOUT = timedelta(seconds=20)

Factory = Callable[..., Any]


def _eval(name: str, **kwargs: Any) -> Factory:
    return lambda dmp, **extra: getattr(trec_pipelines, name)(dmp, None, DEVICE, **kwargs, **extra)


EVAL: Dict[str, Factory] = {
    "EvalPipelineSparseDist": _eval("EvalPipelineSparseDist"),
    "EvalPipelineSparseDist+thread": _eval("EvalPipelineSparseDist", loader_thread=True),
    "EvalPipelineFusedSparseDist": _eval("EvalPipelineFusedSparseDist"),
    "EvalPipelineFusedSparseDist+prefetch": _eval(
        "EvalPipelineFusedSparseDist", enable_embedding_lookup_prefetch=True
    ),
    "EvalPipelineCPUSparse": _eval("EvalPipelineCPUSparse"),
}

# Batches per rank (rank r takes entry r % 4): 2 ranks use the first two.
COUNTS = {"5_vs_3": [5, 3, 4, 2], "3_vs_5": [3, 5, 1, 4], "1_vs_4": [1, 4, 2, 6]}


def _count(counts: Sequence[int]) -> int:
    return counts[dist.get_rank() % len(counts)]


def _all(value: int, group: dist.ProcessGroup) -> List[Optional[int]]:
    gathered: List[Optional[int]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def _unsharded(batches: Sequence[Any]) -> List[torch.Tensor]:
    """Each batch run alone through the unsharded model (the weights make_sharded copies)."""
    torch.manual_seed(SEED)
    model = DLRM().to(DEVICE).eval()
    with torch.no_grad():
        return [model(b)[1] for b in batches]


def _plain_padded_eval(model: torch.nn.Module, batches: Sequence[Any], steps: int) -> Run:
    """The non-pipelined eval loop, ``steps`` forwards on every rank: a rank out of
    data runs its last batch again and keeps none of those outputs."""
    model.eval()
    outputs = []
    with torch.no_grad():
        for step in range(steps):
            out = model(batches[min(step, len(batches) - 1)])[1]
            if step < len(batches):
                outputs.append(out.detach().clone())
    return Run(outputs, {})


def _assert_close(ours: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], what: str) -> None:
    assert len(ours) == len(ref), f"{what}: {len(ours)} outputs, expected {len(ref)}"
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{what}: batch {step}")


@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
@pytest.mark.parametrize("name", list(EVAL))
def test_every_rank_scores_all_its_own_batches(name: str, counts: List[int]) -> None:
    short = dist.new_group(backend=devices.backend(), timeout=TIMEOUT)
    batches = make_batches(_count(counts), seed=DATA_SEED)
    dmp, _ = make_sharded(DLRM, "table_wise", seed=SEED, pg=short)
    dmp.eval()
    pipeline = EVAL[name](dmp)
    ours = run_pipeline(pipeline, batches, model=dmp)
    assert _all(len(ours), short) == _all(len(batches), short)
    _assert_close(ours, _unsharded(batches), f"{name} against the unsharded model")
    steps = max(c for c in _all(len(batches), short) if c is not None)
    # The same for every pipeline: scored once per run.
    plain = kept(
        f"{__name__}._plain_padded_eval:DLRM;table_wise;{SEED}",
        (batches, steps),
        lambda: _plain_padded_eval(
            make_sharded(DLRM, "table_wise", seed=SEED, pg=short)[0], batches, steps
        ),
        pg=short,
    )
    assert_runs_equal(plain, Run(ours, {}), ("plain padded eval", name))
    assert pipeline.unused_batches == 0
    # The next epoch starts afresh, uneven the other way round.
    again = make_batches(_count(counts[::-1]), seed=DATA_SEED + 1)
    _assert_close(run_pipeline(pipeline, again, model=dmp), _unsharded(again), f"{name}, epoch 2")


@pytest.mark.parametrize("name", list(EVAL))
def test_padding_without_the_pull_ahead(name: str) -> None:
    """``agree_ahead=False`` (each pull agreed as it is made) pads the same way."""
    short = dist.new_group(backend=devices.backend(), timeout=TIMEOUT)
    batches = make_batches(_count(COUNTS["5_vs_3"]), seed=DATA_SEED)
    dmp, _ = make_sharded(DLRM, "table_wise", seed=SEED, pg=short)
    dmp.eval()
    pipeline = EVAL[name](dmp, agree_ahead=False)
    ours = run_pipeline(pipeline, batches, model=dmp)
    _assert_close(ours, _unsharded(batches), f"{name} with agree_ahead=False")
    assert pipeline.unused_batches == 0


@pytest.mark.parametrize("name", list(EVAL))
def test_stop_policy_ends_every_rank_at_the_shortest(name: str) -> None:
    """``uneven_data="stop"``: the old policy, every rank stops where the first ends."""
    short = dist.new_group(backend=devices.backend(), timeout=TIMEOUT)
    batches = make_batches(_count(COUNTS["5_vs_3"]), seed=DATA_SEED)
    shortest = min(c for c in _all(len(batches), short) if c is not None)
    dmp, _ = make_sharded(DLRM, "table_wise", seed=SEED, pg=short)
    dmp.eval()
    pipeline = EVAL[name](dmp, uneven_data="stop")
    ours = run_pipeline(pipeline, batches, model=dmp)
    assert _all(len(ours), short) == [shortest] * dist.get_world_size()
    _assert_close(ours, _unsharded(batches[:shortest]), f"{name} with uneven_data='stop'")
    # A longer rank pulled one batch past the shortest end before it learnt of it.
    assert pipeline.unused_batches == (0 if len(batches) == shortest else 1)


@pytest.mark.parametrize("name", list(EVAL))
def test_a_rank_without_batches_stops_every_rank_with_an_error(name: str) -> None:
    """Rank 1 has no eval batch: nothing to pad with, so every rank raises, at once."""
    short = dist.new_group(backend=devices.backend(), timeout=TIMEOUT)
    batches = make_batches(0 if dist.get_rank() == 1 else 3, seed=DATA_SEED)
    dmp, _ = make_sharded(DLRM, "table_wise", seed=SEED, pg=short)
    dmp.eval()
    pipeline = EVAL[name](dmp)
    with pytest.raises(RuntimeError, match="has no batch at all in this epoch.*uneven_data='stop'"):
        run_pipeline(pipeline, batches, model=dmp)
    dist.barrier(group=short)


@pytest.mark.parametrize("name", ["EvalPipelineSparseDist", "EvalPipelineFusedSparseDist"])
def test_uneven_eval_mid_training(name: str) -> None:
    """Train (stopping at the shortest rank), evaluate uneven shards (padding), train
    again: the same as the plain loops, with a train pipeline and an eval pipeline
    sharing the model."""
    short = dist.new_group(backend=devices.backend(), timeout=TIMEOUT)
    rank = dist.get_rank()
    train = make_batches(5 if rank == 0 else 4, seed=DATA_SEED)
    evaluation = make_batches(_count(COUNTS["5_vs_3"]), seed=DATA_SEED + 5)
    more = make_batches(3, seed=DATA_SEED + 9)
    steps = max(c for c in _all(len(evaluation), short) if c is not None)

    ref_dmp, ref_optimizer = make_sharded(DLRM, "table_wise", seed=SEED, pg=short)
    ref_first = plain_loop(ref_dmp, ref_optimizer, train[:4])
    ref_eval = _plain_padded_eval(ref_dmp, evaluation, steps)
    ref_rest = plain_loop(ref_dmp, ref_optimizer, more)

    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED, pg=short)
    trainer = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    evaluator = EVAL[name](dmp)
    first = run_pipeline(trainer, train, model=dmp)  # stops at the shortest rank (4)
    assert trainer.unused_batches == (1 if rank == 0 else 0)
    dmp.eval()
    evaluated = run_pipeline(evaluator, evaluation, model=dmp)
    dmp.train()
    rest = run_pipeline(trainer, more, model=dmp)

    assert_runs_equal(ref_first, first, ("plain_loop", "training"))
    assert_runs_equal(ref_eval, Run(evaluated, {}), ("plain padded eval", name))
    assert len(evaluated) == len(evaluation)
    assert_runs_equal(ref_rest, rest, ("plain_loop", "training after the eval"))


def test_hybrid_evaluates_with_the_training_policy() -> None:
    """TrainEvalHybridPipelineBase keeps stopping at the shortest rank in eval mode (see
    the what-happens-when guide): every rank stops in step, with its first batches."""
    short = dist.new_group(backend=devices.backend(), timeout=TIMEOUT)
    batches = make_batches(_count(COUNTS["5_vs_3"]), seed=DATA_SEED)
    shortest = min(c for c in _all(len(batches), short) if c is not None)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED, pg=short)
    dmp.eval()
    pipeline = trec_pipelines.TrainEvalHybridPipelineBase(dmp, optimizer, DEVICE)
    ours = run_pipeline(pipeline, batches, model=dmp)
    assert _all(len(ours), short) == [shortest] * dist.get_world_size()
    _assert_close(ours, _unsharded(batches[:shortest]), "TrainEvalHybridPipelineBase, eval mode")
