"""Our PipelineState reads torchrec's: a pipeline's ``_state`` holds torchrec's members."""

from __future__ import annotations

import pytest
from torchrec.distributed.train_pipeline.types import PipelineState as TorchrecState

from trec_pipelines import PipelineState


@pytest.mark.parametrize("name", [m.name for m in TorchrecState])
def test_each_member_equals_torchrecs_of_the_same_name_both_ways(name: str) -> None:
    ours, theirs = PipelineState[name], TorchrecState[name]
    assert ours == theirs and theirs == ours
    assert ours.value == theirs.value
    assert {theirs: name}[ours] == name  # hashes alike: usable as each other's keys


def test_members_of_different_names_differ() -> None:
    assert PipelineState.IDLE != TorchrecState.CALL_FWD
    assert TorchrecState.CALL_BWD != PipelineState.CALL_FWD
    assert PipelineState.IDLE != 0  # equal to torchrec's members, not to their values
