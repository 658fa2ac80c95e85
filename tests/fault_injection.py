"""What the fault tests inject, shared by the unit and the distributed tier."""

from __future__ import annotations

from typing import Any

import torch


class Fault(RuntimeError):
    """The injected failure: tests catch exactly this, never a real error."""


class FailingBackward(torch.autograd.Function):
    """Identity in the forward; raises :class:`Fault` when the backward reaches it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise Fault("injected in backward")
