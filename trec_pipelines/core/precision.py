"""Mixed precision of a training step, without subclassing.

[Note: mixed precision]
torchrec's pipelines have no autocast or loss scaling; users override
``_backward`` to add a ``GradScaler``.  Ours take two options
(:mod:`trec_pipelines.core.options`):

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

The fused (in-backward) embedding optimizers of sharded tables are left as
they are: they update each table during the backward, from the gradient
that reaches it, which a scaler has multiplied by its scale, and nothing
unscales it or skips it.  A plain loop with a scaler does the same.  With
``bfloat16`` (the dtype for CPUs, and the usual one on recent GPUs) no scaler
is needed; with ``float16`` and a scaler, give the fused optimizers a learning
rate meant for the scaled gradient, or keep the embedding optimizers unfused.

The hooks torchrec's subclasses override (``_backward``,
``_optimizer_step``) call :class:`Precision`, so a subclass that overrides
them replaces this (see ``[Note: subclass hooks]``).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

import torch


class Precision:
    """A pipeline's autocast and loss scaler (either may be None: plain precision)."""

    def __init__(
        self,
        device: torch.device,
        autocast_dtype: Optional[torch.dtype],
        scaler: Optional[torch.amp.GradScaler],
    ) -> None:
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

    def backward_per_sample(self, losses: torch.Tensor) -> None:
        """The backward of the per-sample losses summed over the batch (what torchrec's
        pipelines do), scaled when there is a scaler."""
        self.backward(torch.sum(losses, dim=0))

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step, through the scaler when there is one."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()
