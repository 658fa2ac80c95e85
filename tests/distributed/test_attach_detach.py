"""detach() / attach() on 2 gloo ranks, with and without a pipelined postproc.

Our adaptation of upstream's ``TrainPipelineAttachDetachTest``
(``test_model_detach_during_train``, ``test_model_detach_after_train``; GPU-only
there): train, detach, check the model has its own forwards back (sharded
modules and postproc) and predicts like the reference, then let ``progress()``
attach it again and train on; every step must equal the plain loop, and
torchrec's own class where it runs on CPU (SparseDist; its SemiSync calls
``record_stream`` with a CPU stream and fails, so there the plain loop alone).
Then the same with the detach at every point of an epoch, for every variant.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import pytest
import torch
import torchrec.distributed.train_pipeline as upstream
from torch import nn

import trec_pipelines
from tests.distributed.postproc_models import (
    DEVICE,
    AddNegatives,
    Batch,
    build,
    make_batches,
    plain_step,
)
from trec_pipelines.model.postproc import PipelinedPostproc
from trec_pipelines.sparse.forwards import (
    EmbeddingPipelinedForward,
    PipelinedForward,
    PrefetchPipelinedForward,
)
from trec_pipelines.testing.dlrm import Run, assert_runs_equal, weights

WRAPPER = {
    trec_pipelines.TrainPipelineSparseDist: PipelinedForward,
    trec_pipelines.TrainPipelineSparseDistLite: PipelinedForward,
    trec_pipelines.TrainPipelineSemiSync: EmbeddingPipelinedForward,
    trec_pipelines.TrainPipelineFusedSparseDist: EmbeddingPipelinedForward,
    trec_pipelines.PrefetchTrainPipelineSparseDist: PrefetchPipelinedForward,
}


def _towers(dmp: nn.Module) -> List[nn.Module]:
    return [dmp.module.ebc, dmp.module.webc]


def _assert_wrapped(dmp: nn.Module, cls: Any, with_postproc: bool) -> None:
    for tower in _towers(dmp):
        assert isinstance(tower.forward, WRAPPER[cls]), type(tower.forward)
    if with_postproc:
        assert isinstance(dmp.module.postproc.forward, PipelinedPostproc)


def _assert_detached(dmp: nn.Module, with_postproc: bool) -> None:
    for tower in _towers(dmp):
        assert "forward" not in tower.__dict__, type(tower.forward)
    if with_postproc:
        assert isinstance(dmp.module.postproc, AddNegatives)
        assert "forward" not in dmp.module.postproc.__dict__


def _predict(dmp: nn.Module, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        return dmp(batch)[1]


class Lockstep:
    """The pipeline under test and the plain loop, one step at a time."""

    def __init__(self, cls: Any, layout: str, ours: bool, **kwargs: Any) -> None:
        self.ref, self.ref_opt = build(layout)
        self.dmp, optimizer = build(layout)
        self.pipeline = cls(self.dmp, optimizer, DEVICE, pipeline_postproc=True, **kwargs)
        self.ours = ours
        self.outputs: List[torch.Tensor] = []

    def step(self, it: Any, batch: Batch) -> None:
        expected = plain_step(self.ref, self.ref_opt, batch)
        got = self.pipeline.progress(it).detach().clone()
        assert torch.equal(got, expected), (
            f"step {len(self.outputs)}: output differs from the plain loop"
        )
        self.outputs.append(got)

    def check_detached_predicts_like_reference(self, batch: Batch) -> None:
        model = self.pipeline.detach()
        assert model is self.dmp
        if self.ours:
            _assert_detached(self.dmp, self.with_postproc)
        assert torch.equal(_predict(model, batch), _predict(self.ref, batch))

    @property
    def with_postproc(self) -> bool:
        return hasattr(self.dmp.module, "postproc")

    def finish(self, it: Any) -> Run:
        with pytest.raises(StopIteration):
            self.pipeline.progress(it)
        assert_runs_equal(
            Run([], weights(self.ref)), Run([], weights(self.dmp)), ("plain_loop", "pipeline")
        )
        return Run(self.outputs, weights(self.dmp))


CASES = [
    pytest.param(upstream.TrainPipelineSparseDist, False, id="torchrec-SparseDist"),
    pytest.param(trec_pipelines.TrainPipelineSparseDist, True, id="SparseDist"),
    pytest.param(trec_pipelines.TrainPipelineSemiSync, True, id="SemiSync"),
]


@pytest.mark.parametrize("with_postproc", [True, False], ids=["postproc", "no_postproc"])
@pytest.mark.parametrize("cls,ours", CASES)
def test_detach_during_training_then_progress_attaches_again(
    cls: Any, ours: bool, with_postproc: bool
) -> None:
    data = make_batches(7)
    run = Lockstep(cls, "shared" if with_postproc else "plain", ours)
    it = iter(data)
    for i in range(3):
        run.step(it, data[i])
    if ours:
        _assert_wrapped(run.dmp, cls, with_postproc)
    run.check_detached_predicts_like_reference(data[3])
    for i in range(3, 7):
        run.step(it, data[i])  # the first one attaches again
    if ours:
        _assert_wrapped(run.dmp, cls, with_postproc)
    run.finish(it)


@pytest.mark.parametrize("with_postproc", [True, False], ids=["postproc", "no_postproc"])
@pytest.mark.parametrize("cls,ours", CASES)
def test_detach_after_the_epoch_then_a_new_epoch_attaches_again(
    cls: Any, ours: bool, with_postproc: bool
) -> None:
    data = make_batches(7)
    run = Lockstep(cls, "shared" if with_postproc else "plain", ours)
    it = iter(data)
    for batch in data:
        run.step(it, batch)
    with pytest.raises(StopIteration):
        run.pipeline.progress(it)
    if ours and with_postproc:
        assert isinstance(run.dmp.module.postproc.forward, PipelinedPostproc)
    for batch in data[:2]:
        run.check_detached_predicts_like_reference(batch)
    more = make_batches(4, seed=23)
    it = iter(more)
    for batch in more:
        run.step(it, batch)
    if ours:
        _assert_wrapped(run.dmp, cls, with_postproc)
    run.finish(it)


VARIANTS: List[Tuple[Any, dict]] = [
    (trec_pipelines.TrainPipelineSparseDist, {}),
    (trec_pipelines.TrainPipelineSparseDistLite, {}),
    (trec_pipelines.TrainPipelineFusedSparseDist, {}),
    (trec_pipelines.TrainPipelineSemiSync, {}),
    (trec_pipelines.PrefetchTrainPipelineSparseDist, {}),
]


@pytest.mark.parametrize("attach_by", ["attach", "progress"])
@pytest.mark.parametrize("detach_at", [0, 1, 4, 7])
@pytest.mark.parametrize("cls,kwargs", VARIANTS, ids=[v[0].__name__ for v in VARIANTS])
def test_detach_attach_at_any_point_trains_every_batch_once(
    cls: Any, kwargs: dict, detach_at: int, attach_by: str
) -> None:
    """Detach after ``detach_at`` steps (0: before the first, 7: after the last),
    predict with the detached model, attach (explicitly, or by the next
    ``progress()``), train to the end: each postproc ran once per batch."""
    data = make_batches(7)
    run = Lockstep(cls, "shared_then_keep", True, **kwargs)
    it = iter(data)
    for batch in data[:detach_at]:
        run.step(it, batch)
    model = run.pipeline.detach()
    for tower in _towers(model):
        assert "forward" not in tower.__dict__
    assert all(
        "forward" not in model.module.get_submodule(n).__dict__
        for n in ("postproc", "keep_ids", "keep_scored")
    )
    assert torch.equal(_predict(model, data[0]), _predict(run.ref, data[0]))
    if attach_by == "attach":
        run.pipeline.attach()
    for batch in data[detach_at:]:
        run.step(it, batch)
    assert [p.fqn for p in run.pipeline._pipelined_postprocs] == [
        "postproc",
        "keep_ids",
        "keep_scored",
    ]
    assert len(run.pipeline._pipelined_modules) == 2
    run.finish(it)
    # The detached prediction ran it once more, the rest once per batch.
    assert run.dmp.module.postproc.calls == len(data) + 1
