"""Checks shared by the pipeline constructors."""

from __future__ import annotations

from typing import Any, List, Optional, Sized

import torch

from trec_pipelines.core.errors import ForwardOutputError

# How to build the dense optimizer torchrec's way, for messages.
_DENSE_OPTIMIZER = (
    "KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())), "
    "lambda params: torch.optim.SGD(params, lr=0.1))"
)


def check_optimizer(
    optimizer: Optional[torch.optim.Optimizer],
    pipeline: str,
    model: Optional[torch.nn.Module] = None,
) -> None:
    """Refuse ``optimizer=None``, and an optimizer over no parameters when ``model``
    has trainable parameters that no in-backward (fused) optimizer updates."""
    if optimizer is None:
        raise ValueError(
            f"{pipeline} trains the model and needs its dense optimizer, got "
            "optimizer=None. Pass the optimizer over the model's non-fused "
            "parameters; for inference use EvalPipelineSparseDist."
        )
    groups = getattr(optimizer, "param_groups", None)
    if model is None or not isinstance(groups, list):
        return
    if any(len(group.get("params", ())) for group in groups):
        return
    dense = _dense_trainable(model)
    if dense:
        shown = ", ".join(repr(name) for name in dense[:3])
        more = f" and {len(dense) - 3} more" if len(dense) > 3 else ""
        raise ValueError(
            f"{pipeline}: the optimizer holds no parameters, so the model's {len(dense)} "
            f"trainable parameter(s) that no fused optimizer updates ({shown}{more}) would "
            "never change. Build the optimizer over them, e.g. "
            f"{_DENSE_OPTIMIZER}, after wrapping the model in DistributedModelParallel "
            "and from the wrapped model's parameters (a generator of parameters can be "
            "read only once)."
        )


def _dense_trainable(model: torch.nn.Module) -> List[str]:
    """The names of ``model``'s trainable parameters with no in-backward optimizer."""
    return [
        name
        for name, param in model.named_parameters()
        if param.requires_grad and not hasattr(param, "_in_backward_optimizers")
    ]


def check_iterator(dataloader_iter: Any) -> None:
    """Refuse what ``progress()`` cannot pull from: an iterable that is not an iterator.

    Called when a new iterator is passed (not at every step).
    """
    if hasattr(type(dataloader_iter), "__next__"):
        return
    kind = type(dataloader_iter).__name__
    if isinstance(dataloader_iter, torch.utils.data.DataLoader):
        raise TypeError(
            "progress() takes an iterator, got a DataLoader (an iterable, not "
            "an iterator). Pass iter(dataloader), once per epoch: "
            "it = iter(dataloader), then progress(it) until it raises StopIteration."
        )
    if hasattr(type(dataloader_iter), "__iter__"):
        size = f" ({len(dataloader_iter)} items)" if isinstance(dataloader_iter, Sized) else ""
        raise TypeError(
            f"progress() takes an iterator, got a {kind}{size}: an iterable, not an "
            "iterator. Pass an iterator: it = iter(batches), then progress(it) until it "
            "raises StopIteration."
        )
    raise TypeError(
        f"progress() takes an iterator of batches, got a {kind}. Pass "
        "iter(dataloader) (or iter(batches) for a list of batches)."
    )


def _describe(output: Any) -> str:
    if output is None:
        return "None"
    if isinstance(output, torch.Tensor):
        shape = "a 0-d (scalar)" if output.dim() == 0 else f"a {tuple(output.shape)}"
        return f"{shape} tensor alone"
    if isinstance(output, dict):
        return f"a dict with keys {sorted(map(str, output))}"
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} of {len(output)} elements"
    return f"a {type(output).__name__}"


def forward_output_error(output: Any, pipeline: str) -> ForwardOutputError:
    """The error for a forward that did not return ``(losses, output)``."""
    return ForwardOutputError(
        f"{pipeline}: the model's forward returned {_describe(output)}, but a training "
        "pipeline needs torchrec's pair (losses, output): it backpropagates "
        "torch.sum(losses, dim=0) and progress() returns output. Return e.g. "
        "(loss, (loss.detach(), logits)) from the forward (torchrec's DLRMTrain returns "
        "(loss, (loss.detach(), logits, labels))), or pass custom_model_fwd= a function "
        "of the batch that returns the pair."
    )


def check_forward_output(output: Any, pipeline: str) -> Any:
    """``output`` if it is a ``(losses, output)`` pair (a 2-tuple or 2-list), else raise
    :class:`~trec_pipelines.core.errors.ForwardOutputError` naming the fix."""
    if isinstance(output, (tuple, list)) and len(output) == 2:
        return output
    raise forward_output_error(output, pipeline)


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


def unsharded_model_note(model: torch.nn.Module, pipeline: str) -> str:
    """What to tell the user of a pipeline whose model has no sharded module.

    Not an error: torchrec's pipelines train such a model too, unpipelined.
    Embedding modules torchrec could shard (an unwrapped ``EmbeddingBagCollection``)
    are named, with the fix.
    """
    from torchrec.modules.embedding_modules import (
        EmbeddingBagCollection,
        EmbeddingCollection,
    )

    tables = [
        name or "the model"
        for name, module in model.named_modules()
        if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection))
    ]
    head = (
        f"{pipeline}: the model has no ShardedModule, so there is no input_dist to "
        "pipeline; it trains unpipelined, as torchrec's class does (a plain loop with "
        "the H2D copy overlapped)."
    )
    if tables:
        return (
            f"{head} Its embedding module(s) {', '.join(repr(t) for t in tables[:3])} "
            "are not sharded: wrap the model in DistributedModelParallel "
            "(DistributedModelParallel(model, device=device)) before building the "
            "pipeline, so their input_dist is pipelined."
        )
    return f"{head} For a model without embedding tables TrainPipelineBase does the same."
