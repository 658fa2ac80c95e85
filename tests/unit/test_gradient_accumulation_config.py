"""GradientAccumulationConfig and the optimizer schedule, without a process group."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
from torchrec.distributed.train_pipeline import GradientAccumulationConfig as UpstreamConfig

from trec_pipelines import GradientAccumulationConfig, GradientAccumulationWrapper


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"num_steps": 4}, {"is_enabled": True}, {"num_steps": 1, "num_warmup_steps": 3}],
)
def test_config_matches_torchrec(kwargs: Dict[str, Any]) -> None:
    ours, theirs = GradientAccumulationConfig(**kwargs), UpstreamConfig(**kwargs)
    assert (ours.is_enabled, ours.num_steps, ours.num_warmup_steps) == (
        theirs.is_enabled,
        theirs.num_steps,
        theirs.num_warmup_steps,
    )


@pytest.mark.parametrize("kwargs", [{"num_steps": 0}, {"num_warmup_steps": 0}])
def test_config_rejects_what_torchrec_rejects(kwargs: Dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        UpstreamConfig(**kwargs)
    with pytest.raises(ValueError, match="pass 1 or more"):
        GradientAccumulationConfig(**kwargs)


class LoggingOptimizer(torch.optim.SGD):
    def __init__(self, log: List[str]) -> None:
        super().__init__([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        self.log = log

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.log.append("zero_grad")

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.log.append("step")


class CountingPipeline:
    """Calls zero_grad and step like a training pipeline; stops after ``n`` calls."""

    def __init__(self, optimizer: Any, n: int) -> None:
        self._optimizer = optimizer
        self.left = n

    def progress(self, dataloader_iter: Any) -> int:
        if self.left == 0:
            raise StopIteration
        self.left -= 1
        self._optimizer.zero_grad()
        self._optimizer.step()
        return self.left


def test_steps_at_window_ends_and_once_more_for_the_last_partial_window() -> None:
    log: List[str] = []
    optimizer = LoggingOptimizer(log)
    pipeline = CountingPipeline(optimizer, 5)
    model = torch.nn.Linear(1, 1)  # no DDP: nothing to all-reduce
    wrapped = GradientAccumulationWrapper(
        pipeline, optimizer, model, GradientAccumulationConfig(num_steps=2)
    )
    steps = []
    while True:
        try:
            wrapped.progress(iter(()))
        except StopIteration:
            break
        steps.append(list(log))
        log.clear()
    # Calls 0..4: the real zero_grad on calls 0, 2, 4; step on calls 1, 3; flush after call 4.
    assert steps == [["zero_grad"], ["step"], ["zero_grad"], ["step"], ["zero_grad"]]
    assert log == ["step", "zero_grad"]
    assert wrapped.current_step == 5 and wrapped.left == 0  # read through to the pipeline
