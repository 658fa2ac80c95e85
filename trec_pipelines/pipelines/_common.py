"""Checks shared by the pipeline constructors."""

from __future__ import annotations

from typing import Optional

import torch


def check_optimizer(optimizer: Optional[torch.optim.Optimizer], pipeline: str) -> None:
    if optimizer is None:
        raise ValueError(
            f"{pipeline} trains the model and needs its dense optimizer, got "
            "optimizer=None. Pass the optimizer over the model's non-fused "
            "parameters; for inference use EvalPipelineSparseDist."
        )


def check_device(device: torch.device, pipeline: str) -> torch.device:
    if not isinstance(device, torch.device):
        raise TypeError(
            f"{pipeline}: device must be a torch.device, got {type(device).__name__} "
            f"({device!r}); pass torch.device({device!r})"
        )
    return device
