"""The quickstart: one epoch with a pipeline, then what it pipelined."""

from __future__ import annotations

from typing import Any, Iterable, List

import torch

from trec_pipelines import TrainPipelineSparseDist


def train_one_epoch(
    model: torch.nn.Module,  # a DistributedModelParallel
    optimizer: torch.optim.Optimizer,
    dataloader: Iterable[Any],
    device: torch.device,
) -> List[Any]:
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    outputs = []
    it = iter(dataloader)
    while True:
        try:
            outputs.append(pipeline.progress(it))
        except StopIteration:
            break
    print(pipeline.rewrite_result.report())  # what was pipelined, and why not
    return outputs
