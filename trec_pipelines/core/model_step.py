"""The model's calls in a step: the forward (checked, under autocast), the backward, the optimizer step.

Each pipeline's ``progress()`` calls the model three times: the forward
(the core's ``_call_forward``, :meth:`~trec_pipelines.assembly.pipeline.PipelineCore._call_forward`,
under :meth:`Precision.autocast`), the backward of the
summed losses and the optimizer step (:meth:`Precision.backward` and
:meth:`Precision.step`, through the grad scaler when there is one).

[Note: mixed precision]
torchrec's pipelines have no autocast or loss scaling; users override
``_backward`` to add a ``GradScaler``.  Ours take two options
(:mod:`trec_pipelines.assembly.options`):

* ``autocast_dtype``: each training forward runs under
  ``torch.autocast(device_type, dtype)`` on the pipeline's device, as a plain
  loop would write ``with torch.autocast(...): loss, out = model(batch)``.
  Work a pipeline issues outside the forward (an input_dist, a lookup run
  ahead by Fused or SemiSync, a prefetch) is not under it; the sharded
  embedding kernels run in their own precision either way.
* ``grad_scaler``: the backward scales the summed loss
  (``scaler.scale(loss).backward()``) and the optimizer steps through the
  scaler (``scaler.step(optimizer)``: unscale, skip the step when a gradient
  is inf or nan; then ``scaler.update()``), as the plain loop's recipe.  With
  ``DistributedDataParallel`` the dense gradients are all-reduced before the
  check, so an overflow on one rank is an overflow on every rank: every rank
  skips the same step.

A scaler is refused with in-backward optimizers (the fused optimizers of
sharded tables, FBGEMM's TBE kernels, or torch's
``_apply_optimizer_in_backward`` on any parameter): :func:`refuse_scaled_in_backward`.
Such an optimizer updates its parameter inside the backward, from the
gradient as it arrives, which the scaler has multiplied by its scale (65536
by default): SGD steps that many times too far, and an adaptive optimizer
(Adagrad, Adam), which mostly divides the scale out, still mixes gradients
of different scales once the scale grows or backs off, and its ``eps`` no
longer means what it says.  Dividing
that gradient by the scale at the embeddings' output (an autograd function at
the lookup's boundary) would fix the size, but not the other half of the
recipe, skipping the step whose gradients overflow: the fused update runs
during the backward, before ``scaler.step`` has seen the dense gradients or
any other rank's, and the rows and optimizer state it wrote cannot be put
back afterwards without a copy of every table touched (a zero gradient is no
substitute: Adam moves on one, and so does weight decay).  So the
combination would train silently wrong whenever a step overflows.  With
``bfloat16`` (the dtype for CPUs, and the usual one on recent GPUs) no scaler
is needed; with ``float16``, keep the scaler and give the tables a dense
optimizer (``data_parallel`` with the ``dense`` kernel, the one torchrec's
planner offers for it, their weights in the optimizer the pipeline steps
through the scaler).

The hooks torchrec's subclasses override (``_backward``,
``_optimizer_step``) call :class:`Precision`, so a subclass that overrides
them replaces this (see ``[Note: subclass hooks]``).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, List, Optional

import torch


def in_backward_parameters(model: torch.nn.Module) -> List[str]:
    """The names of ``model``'s parameters that an optimizer updates inside the backward.

    A sharded table with a fused kernel marks its parameters so on every rank
    (with an empty optimizer where the rank holds no shard of it), so every
    rank gives the same answer.
    """
    return [
        name
        for name, param in model.named_parameters()
        if getattr(param, "_in_backward_optimizers", None)
    ]


def refuse_scaled_in_backward(
    model: torch.nn.Module, scaler: Optional[torch.amp.GradScaler], pipeline: str
) -> None:
    """Raise ``ValueError`` when ``scaler`` would scale an in-backward optimizer's gradient.

    See ``[Note: mixed precision]``.
    """
    if scaler is None or not scaler.is_enabled():
        return  # a disabled scaler (GradScaler(enabled=False)) scales nothing
    names = in_backward_parameters(model)
    if not names:
        return
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    raise ValueError(
        f"{pipeline}: grad_scaler cannot be used with in-backward (fused) optimizers, "
        f"and {len(names)} parameter(s) have one ({shown}). They are updated inside "
        f"the backward from the scaled gradient (scale {scaler.get_scale()}), before the "
        "scaler can find an inf or nan and skip the step, and a fused update cannot be "
        "undone after it. Either use autocast_dtype=torch.bfloat16 without a scaler "
        "(bfloat16 has float32's range: no loss scaling is needed), or keep the scaler "
        "and give these tables a dense optimizer: shard them data_parallel with the "
        "dense kernel (ParameterConstraints(sharding_types=['data_parallel'], "
        "compute_kernels=['dense'])) and put their weights in the optimizer you pass, "
        "which steps through the scaler."
    )


class Precision:
    """A pipeline's autocast and loss scaler (either may be None: plain precision).

    With ``model``, a scaler over a model with in-backward optimizers is refused
    (:func:`refuse_scaled_in_backward`).
    """

    def __init__(
        self,
        device: torch.device,
        autocast_dtype: Optional[torch.dtype],
        scaler: Optional[torch.amp.GradScaler],
        *,
        model: Optional[torch.nn.Module] = None,
        pipeline: str = "pipeline",
    ) -> None:
        if model is not None:
            refuse_scaled_in_backward(model, scaler, pipeline)
        self._device_type = device.type
        self._dtype = autocast_dtype
        self.scaler = scaler

    def autocast(self) -> ContextManager[object]:
        """Where the training forward runs."""
        if self._dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device_type, dtype=self._dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """The backward of the step's (summed) loss, scaled when there is a scaler."""
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step, through the scaler when there is one."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()
