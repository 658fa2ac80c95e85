"""input_dist_group's choices and its no-process-group path (no ranks needed)."""

from __future__ import annotations

import pytest
import torch

import trec_pipelines
from tests.unit.fakes import TinyModel, optimizer_for
from trec_pipelines.assembly.options import resolve_options
from trec_pipelines.core import input_dist_group as idg
from trec_pipelines.sparse.input_dist import SplitsFusion


def test_the_choices_and_the_default() -> None:
    assert idg.INPUT_DIST_GROUPS == ("shared", "dedicated")
    assert idg.DEFAULT_INPUT_DIST_GROUP == "dedicated"
    cls = trec_pipelines.TrainPipelineSparseDist
    with pytest.raises(ValueError, match=r"^P: input_dist_group must be one of .*got 'own'"):
        resolve_options("P", cls, {"input_dist_group": "own"})
    assert resolve_options("P", cls, {})["input_dist_group"] == "dedicated"
    assert resolve_options("P", cls, {"input_dist_group": "shared"})["input_dist_group"] == "shared"


@pytest.mark.parametrize(
    "name",
    [
        "TrainPipelineSparseDist",
        "TrainPipelineFusedSparseDist",
        "TrainPipelineSemiSync",
        "PrefetchTrainPipelineSparseDist",
        "EvalPipelineSparseDist",
        "EvalPipelineFusedSparseDist",
        "TrainPipelinePEC",
    ],
)
def test_every_variant_that_pipelines_the_input_dist_takes_it(name: str) -> None:
    model = TinyModel()
    cls = getattr(trec_pipelines, name)
    with pytest.raises(ValueError, match="input_dist_group must be one of"):
        cls(model, optimizer_for(model), torch.device("cpu"), input_dist_group="own")
    pipeline = cls(model, optimizer_for(model), torch.device("cpu"), input_dist_group="shared")
    assert pipeline._pipelined.fusion.input_dist_group == "shared"
    assert (
        cls(model, optimizer_for(model), torch.device("cpu"))._pipelined.fusion.input_dist_group
        == "dedicated"
    )


def test_lite_keeps_the_models_group() -> None:
    model = TinyModel()
    pipeline = trec_pipelines.TrainPipelineSparseDistLite(
        model, optimizer_for(model), torch.device("cpu")
    )
    assert pipeline._pipelined.fusion.input_dist_group == "shared"


def test_without_a_process_group_there_is_nothing_to_make() -> None:
    assert idg.dedicated_groups([]) == {}
    fusion = SplitsFusion("dedicated")
    fusion.fuse([])
    assert fusion.fused and fusion.groups == {} and fusion.overrides == ()
    fusion.unfuse()
    assert not fusion.fused
    assert idg.release_input_dist_groups() == 0
