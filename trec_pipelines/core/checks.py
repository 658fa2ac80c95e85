"""Checks shared by the pipeline constructors."""

from __future__ import annotations

from typing import Any, Optional

import torch


def check_optimizer(optimizer: Optional[torch.optim.Optimizer], pipeline: str) -> None:
    if optimizer is None:
        raise ValueError(
            f"{pipeline} trains the model and needs its dense optimizer, got "
            "optimizer=None. Pass the optimizer over the model's non-fused "
            "parameters; for inference use EvalPipelineSparseDist."
        )


def check_device(device: Any, pipeline: str) -> torch.device:
    """``device`` as a ``torch.device``: what ``torch.device()`` accepts is accepted
    (``"cpu"``, ``"cuda:0"``, a ``torch.device``)."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, (str, int)) and not isinstance(device, bool):
        try:
            return torch.device(device)
        except RuntimeError as error:
            raise ValueError(
                f"{pipeline}: device {device!r} is not a device torch knows ({error}); "
                'pass e.g. "cpu", "cuda:0" or torch.device("cuda", 0)'
            ) from error
    raise TypeError(
        f"{pipeline}: device must be a torch.device or a string naming one, got "
        f'{type(device).__name__} ({device!r}); pass e.g. torch.device("cuda", 0)'
    )


def check_model_device(model: torch.nn.Module, device: torch.device, pipeline: str) -> None:
    """Raise when the model's parameters are not on the pipeline's device."""
    for param in model.parameters():
        if param.device.type == "meta":
            continue
        same_type = param.device.type == device.type
        same_index = device.index is None or param.device.index in (None, device.index)
        if not (same_type and same_index):
            raise ValueError(
                f"{pipeline}: the model's parameters are on {param.device} but the "
                f"pipeline's device is {device}. Move the model first (for "
                f"DistributedModelParallel pass device={device!r}), or build the "
                f"pipeline with device=torch.device({str(param.device)!r})."
            )
        return


def predictions(output: Any) -> Any:
    """What an eval pipeline returns for one forward: ``pred`` of a ``(loss, pred)``
    pair (any 2-tuple, as torchrec unpacks it), else the output itself, for a
    model that returns predictions only in eval mode (a tensor, dict, list)."""
    if isinstance(output, tuple) and len(output) == 2:
        return output[1]
    return output


def check_apply_jit(apply_jit: bool, pipeline: str) -> None:
    """Refuse ``apply_jit=True``: ours does not TorchScript the model, and says so."""
    if apply_jit:
        raise ValueError(
            f"{pipeline}: apply_jit=True (TorchScript the model's unsharded modules) is "
            "not supported by trec_pipelines; TorchScript is deprecated in PyTorch. Pass "
            "apply_jit=False, and to speed up the dense part compile it instead "
            "(torch.compile, or TrainPipelinePT2 / TrainPipelineSparseDistCompAutograd)."
        )
