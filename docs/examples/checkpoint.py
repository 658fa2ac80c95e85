"""Checkpoint and resume with the batches in flight: one file per rank."""

from __future__ import annotations

from typing import Any, Iterator, Tuple

import torch
import torch.distributed as dist

from trec_pipelines import TrainPipelineSparseDist


def save(
    directory: str,
    pipeline: TrainPipelineSparseDist[Any, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Any,  # a torchdata StatefulDataLoader
) -> None:
    # Between two progress() calls, on every rank.  The pipeline's state first:
    # TrainPipelinePEC applies a gradient it deferred to the next step there.
    torch.save(
        {
            "pipeline": pipeline.state_dict(),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "loader": loader.state_dict(),
        },
        f"{directory}/rank{dist.get_rank()}.pt",
    )


def resume(
    directory: str,
    model: torch.nn.Module,  # built as before the checkpoint
    optimizer: torch.optim.Optimizer,
    loader: Any,
    device: torch.device,
) -> Tuple[TrainPipelineSparseDist[Any, Any], Iterator[Any]]:
    state = torch.load(f"{directory}/rank{dist.get_rank()}.pt", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    pipeline = TrainPipelineSparseDist(model, optimizer, device)  # or any train variant
    pipeline.load_state_dict(state["pipeline"])
    loader.load_state_dict(state["loader"])
    return pipeline, iter(loader)  # progress() trains the in-flight batches first
