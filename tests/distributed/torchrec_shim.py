"""Test-only shim that lets torchrec 1.8.0's stream-using pipelines run on CPU.

torchrec's Fused, SemiSync, Prefetch, EvalFused, Staged and CompAutograd
pipelines call ``Tensor.record_stream`` and ``torch.cuda.current_stream()``
even when the device is CPU, and crash.  Inside :func:`torchrec_on_cpu`:

* ``Tensor.record_stream`` is a no-op for CPU tensors;
* ``torch.cuda.current_stream`` returns the CPU stream.

It exists only to get torchrec's results as a reference; trec_pipelines never
runs under it (tests check that the shim is off when ours run).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

_active = False


def shim_active() -> bool:
    return _active


@contextlib.contextmanager
def torchrec_on_cpu() -> Iterator[None]:
    global _active
    original_record_stream = torch.Tensor.record_stream
    original_current_stream = torch.cuda.current_stream

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if self.device.type == "cpu":
            return None
        return original_record_stream(self, stream)

    def current_stream(device: Any = None) -> Any:
        return torch.cpu.current_stream()

    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]
    torch.cuda.current_stream = current_stream  # type: ignore[assignment]
    _active = True
    try:
        yield
    finally:
        _active = False
        torch.Tensor.record_stream = original_record_stream  # type: ignore[method-assign]
        torch.cuda.current_stream = original_current_stream  # type: ignore[assignment]
