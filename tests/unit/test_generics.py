"""Every pipeline class is generic over its input and output, as torchrec's are.

Users annotate with ``TrainPipelineSparseDist[Batch, torch.Tensor]``; after the
import swap that must still be valid Python.
"""

from __future__ import annotations

import typing
from typing import Any, List, Optional

import pytest
import torch
import torchrec.distributed.train_pipeline.pipeline_stage as upstream_stage
import torchrec.distributed.train_pipeline.train_pipelines as upstream
from torchrec.distributed.train_pipeline import In, Out, TrainPipeline

import trec_pipelines
from trec_pipelines.pipelines.staged import StageOut

PIPELINES: List[str] = [
    "TrainPipelineBase",
    "TrainPipelinePT2",
    "TrainPipelineSparseDist",
    "TrainPipelineSparseDistLite",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "PrefetchTrainPipelineSparseDist",
    "EvalPipelineSparseDist",
    "EvalPipelineFusedSparseDist",
    "StagedTrainPipeline",
    "TrainPipelineSparseDistCompAutograd",
]


@pytest.mark.parametrize("name", PIPELINES + ["SparseDataDistUtil"])
def test_same_number_of_type_parameters_as_torchrec(name: str) -> None:
    ours = getattr(trec_pipelines, name)
    theirs = getattr(upstream_stage if name == "SparseDataDistUtil" else upstream, name)
    assert len(ours.__parameters__) == len(theirs.__parameters__) > 0, name
    args = (torch.Tensor, Any)[: len(ours.__parameters__)]
    alias = ours[args if len(args) > 1 else args[0]]
    assert typing.get_origin(alias) is ours
    assert typing.get_args(alias) == args


@pytest.mark.parametrize("name", PIPELINES)
def test_parameters_reach_the_torchrec_base(name: str) -> None:
    """``TrainPipeline[In, Out]`` sits in the bases with our type variables."""
    cls = getattr(trec_pipelines, name)
    bases = [b for k in cls.__mro__ for b in getattr(k, "__orig_bases__", ())]
    train_pipeline = [b for b in bases if typing.get_origin(b) is TrainPipeline]
    assert train_pipeline, f"{name} does not derive from TrainPipeline[...]"
    expected = (In, Optional[StageOut]) if name == "StagedTrainPipeline" else (In, Out)
    assert typing.get_args(train_pipeline[0]) == expected


def test_subscripted_alias_in_annotations_and_isinstance() -> None:
    alias = trec_pipelines.TrainPipelineSparseDist[Any, torch.Tensor]

    def build() -> "trec_pipelines.TrainPipelineSparseDist[Any, torch.Tensor]":
        raise NotImplementedError

    hints = typing.get_type_hints(
        build, globalns={"trec_pipelines": trec_pipelines, "Any": Any, "torch": torch}
    )
    assert hints["return"] == alias
    assert issubclass(
        trec_pipelines.TrainPipelineFusedSparseDist, trec_pipelines.TrainPipelineSparseDist
    )
    assert issubclass(trec_pipelines.TrainPipelineSparseDist, TrainPipeline)


def test_pec_is_generic_over_in_and_out() -> None:
    """torchrec 1.9.2's PEC pipeline is a ``TrainPipelineSparseDist[In, Out]``; ours too, on every stack."""
    pec = trec_pipelines.TrainPipelinePEC
    assert pec.__parameters__ == (In, Out)
    alias = pec[Any, torch.Tensor]
    assert typing.get_origin(alias) is pec and typing.get_args(alias) == (Any, torch.Tensor)
