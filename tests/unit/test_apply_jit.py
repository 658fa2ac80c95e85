"""``apply_jit=True`` is refused with the fix, never accepted and ignored."""

from __future__ import annotations

import pytest
import torch

import trec_pipelines as tp
from tests.unit.fakes import TinyModel, optimizer_for

CPU = torch.device("cpu")

TAKING_APPLY_JIT = [
    "TrainPipelineSparseDist",
    "TrainPipelineSparseDistLite",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "PrefetchTrainPipelineSparseDist",
    "EvalPipelineSparseDist",
    "EvalPipelineFusedSparseDist",
    "TrainPipelineSparseDistCompAutograd",
]


@pytest.mark.parametrize("name", TAKING_APPLY_JIT)
def test_apply_jit_true_raises_with_the_fix(name: str) -> None:
    model = TinyModel()
    with pytest.raises(ValueError, match=r"apply_jit=True .* Pass apply_jit=False"):
        getattr(tp, name)(model, optimizer_for(model), CPU, apply_jit=True)


@pytest.mark.parametrize("name", TAKING_APPLY_JIT)
def test_apply_jit_false_builds(name: str) -> None:
    model = TinyModel()
    pipeline = getattr(tp, name)(model, optimizer_for(model), CPU, apply_jit=False)
    assert isinstance(pipeline, tp.TrainPipeline)


def test_sparse_data_dist_util_refuses_apply_jit_too() -> None:
    with pytest.raises(ValueError, match=r"apply_jit=True"):
        tp.SparseDataDistUtil(model=TinyModel(), data_dist_stream=None, apply_jit=True)
