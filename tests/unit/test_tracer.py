"""Tracer against torchrec's: the same leaves and the same traced calls."""

from __future__ import annotations

from typing import Any, List

import pytest
import torch
from torch import nn
from torchrec.distributed.train_pipeline import Tracer as UpstreamTracer

from trec_pipelines import Tracer


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        self.c = nn.Sequential(nn.Linear(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def called_modules(tracer: Any) -> List[str]:
    graph = tracer.trace(Model())
    return [str(node.target) for node in graph.nodes if node.op == "call_module"]


@pytest.mark.parametrize("leaves", [None, ["b"], ["b", "c"]])
def test_traces_the_same_module_calls(leaves: Any) -> None:
    assert called_modules(Tracer(leaves)) == called_modules(UpstreamTracer(leaves))


@pytest.mark.parametrize("name", ["b", "b.0", "bb", "b0", "c.0.x", "a"])
def test_extended_leaves_match(name: str) -> None:
    module = nn.Identity()
    ours = Tracer(["b", "c.0"], extend_leaf_fqn=True)
    theirs = UpstreamTracer(["b", "c.0"], extend_leaf_fqn=True)
    assert ours.is_extended_leaf_modules(module, name) == theirs.is_extended_leaf_modules(
        module, name
    )
    assert ours.is_leaf_module(module, name) == theirs.is_leaf_module(module, name)
