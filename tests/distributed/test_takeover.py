"""Every root pipeline takes a model over from every other one left attached, on 2 gloo ranks.

A first pipeline runs its data to the end and is not detached (it stays alive,
as it would in a user's script); a second one then trains the same model to
the end of its own data.  The documented behaviour (:mod:`trec_pipelines.sparse.takeover`):
the second finds the first's forward wrappers on the sharded module, detaches
the first with a warning naming both, and trains exactly as the plain loop
does.  The reference is one plain run of both parts on a fresh model: the
plain loop over the first's batches (a forward under ``no_grad`` in eval mode
for an eval pass, which changes no weight), then over the second's.

Base and PT2 run the model's own forward and install no wrappers: after them
there is nothing to take over, and no take-over warning may be logged.  The
wrappers of ``StagedTrainPipeline`` + ``SparseDataDistUtil`` are the
``SparseDataDistUtil``'s (it rewrote the model and has ``detach()``), so that
is the name the warning must give for it.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch

import trec_pipelines
from trec_pipelines.pipelines.sparse_data_dist_util import SparseDataDistUtil
from trec_pipelines.pipelines.staged import PipelineStage, StagedTrainPipeline
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    Run,
    assert_runs_equal,
    make_batches,
    make_sharded,
    plain_loop,
    run_pipeline,
    weights,
)
from trec_pipelines.testing.references import kept

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 23


class StagedLoop:
    """``StagedTrainPipeline`` + ``SparseDataDistUtil`` (every stream None, as on
    CPU) behind a train pipeline's ``progress()``: each call takes the next
    prepared batch and trains it with the plain loop's four calls."""

    def __init__(self, dmp: torch.nn.Module, optimizer: Any) -> None:
        self._model, self._optimizer = dmp, optimizer
        self.sdd = SparseDataDistUtil(dmp, data_dist_stream=None)
        self.staged = StagedTrainPipeline(
            [
                PipelineStage("h2d", lambda batch: batch.to(DEVICE, non_blocking=True), None),
                self.sdd.start_sparse_data_dist_stage(),
            ]
        )

    def progress(self, it: Any) -> torch.Tensor:
        batch = self.staged.progress(it)
        if batch is None:
            raise StopIteration
        self._optimizer.zero_grad()
        loss, pred = self._model(batch)
        torch.sum(loss, dim=0).backward()
        self._optimizer.step()
        return pred


def _pt2(dmp: torch.nn.Module, optimizer: Any) -> Any:
    # Kept eager: compiling is slow here and the take-over happens before it would.
    config = trec_pipelines.TorchCompileConfig(compile_on_iter=1000)
    return trec_pipelines.TrainPipelinePT2(dmp, optimizer, DEVICE, compile_configs=config)


# name -> (dmp, optimizer) -> something with progress(it).  TrainPipelinePEC runs
# here on any torchrec: on a model without PEC modules (this DLRM) its PEC verbs do
# nothing; only PEC modules need torchrec >= 1.9 (see tests/distributed/test_pec.py).
PIPELINES: Dict[str, Callable[[torch.nn.Module, Any], Any]] = {
    "Base": lambda dmp, opt: trec_pipelines.TrainPipelineBase(dmp, opt, DEVICE),
    "PT2": _pt2,
    "SparseDist": lambda dmp, opt: trec_pipelines.TrainPipelineSparseDist(dmp, opt, DEVICE),
    "Staged": StagedLoop,
    "PEC": lambda dmp, opt: trec_pipelines.TrainPipelinePEC(dmp, opt, DEVICE),
    "Eval": lambda dmp, opt: trec_pipelines.EvalPipelineSparseDist(dmp, None, DEVICE),
}

# Whose wrappers a take-over finds after each pipeline (None: it installs none),
# and who takes the model over in each second pipeline.
WRAPPER_OWNER: Dict[str, Optional[str]] = {
    "Base": None,
    "PT2": None,
    "SparseDist": "TrainPipelineSparseDist",
    "Staged": "SparseDataDistUtil",
    "PEC": "TrainPipelinePEC",
    "Eval": "EvalPipelineSparseDist",
}
TAKER = {**WRAPPER_OWNER, "Base": "TrainPipelineBase", "PT2": "TrainPipelinePT2"}

TRAINERS = ["Base", "PT2", "SparseDist", "Staged", "PEC"]
PAIRS = list(itertools.product(TRAINERS + ["Eval"], TRAINERS))


def _reference(first: str, first_batches: List[Any], second_batches: List[Any]) -> tuple:
    """The plain runs of both parts on one fresh model: (first part, second part); the
    same for every second pipeline and every first one that trains (kept once per run)."""
    evaluates = first == "Eval"
    return kept(
        f"{__name__}._reference:DLRM;table_wise;{SEED}",
        (evaluates, first_batches, second_batches),
        lambda: _plain_runs(evaluates, first_batches, second_batches),
    )


def _plain_runs(evaluates: bool, first_batches: List[Any], second_batches: List[Any]) -> tuple:
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    if evaluates:
        dmp.eval()
        with torch.no_grad():
            first_run = Run([dmp(batch)[1] for batch in first_batches], weights(dmp))
        dmp.train()
    else:
        first_run = plain_loop(dmp, optimizer, first_batches)
    return first_run, plain_loop(dmp, optimizer, second_batches)


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=[f"{a}_then_{b}" for a, b in PAIRS])
def test_a_pipeline_left_attached_is_taken_over_and_training_equals_the_plain_loop(
    first: str, second: str, caplog: pytest.LogCaptureFixture
) -> None:
    first_batches = make_batches(3, seed=DATA_SEED)
    second_batches = make_batches(4, seed=DATA_SEED + 1)
    ref_first, ref_second = _reference(first, first_batches, second_batches)

    caplog.set_level(logging.WARNING, logger="trec_pipelines")
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    # Held to the end of the test: a collected pipeline's wrappers are orphans,
    # a different path (see trec_pipelines.sparse.takeover.strip_orphan).
    earlier = PIPELINES[first](dmp, optimizer)
    if first == "Eval":
        dmp.eval()
    ours_first = run_pipeline(earlier, first_batches, model=dmp)  # no detach()
    dmp.train()
    later = PIPELINES[second](dmp, optimizer)
    ours_second = run_pipeline(later, second_batches, model=dmp)

    assert_runs_equal(ref_first, ours_first, ("plain loop", first))
    assert_runs_equal(ref_second, ours_second, ("plain loop", f"{second} after {first}"))

    taken = [r.getMessage() for r in caplog.records if r.name == "trec_pipelines.sparse.takeover"]
    owner = WRAPPER_OWNER[first]
    if owner is None:
        assert taken == [], f"{first} leaves nothing to take over, yet: {taken}"
        return
    expected = f"{TAKER[second]}: the model is still attached to a {owner} "
    assert any(
        message.startswith(expected) and "detaching it and taking the model over" in message
        for message in taken
    ), f"no warning starting {expected!r}; take-over warnings: {taken}"
