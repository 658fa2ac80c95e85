"""What the fault tests inject, shared by the unit and the distributed tier."""

from __future__ import annotations

from typing import Any, Iterator, List

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


class FlakyIterator:
    """Iterates ``items``; ``next()`` number ``at`` raises :class:`Fault` and takes nothing."""

    def __init__(self, items: List[Any], at: int) -> None:
        self._it: Iterator[Any] = iter(items)
        self._at, self.calls = at, 0

    def __iter__(self) -> "FlakyIterator":
        return self

    def __next__(self) -> Any:
        call, self.calls = self.calls, self.calls + 1
        if call == self._at:
            raise Fault("injected in the data iterator")
        return next(self._it)
