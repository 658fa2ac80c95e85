"""Benchmark-only shim that lets torchrec 1.8.0's stream-using pipelines run on CPU.

torchrec's Fused, SemiSync, Prefetch, EvalFused, Staged and CompAutograd
pipelines call ``Tensor.record_stream`` and ``torch.cuda.current_stream()``
even when the device is CPU, and crash there.  While :func:`torchrec_on_cpu`
is active:

* ``Tensor.record_stream`` does nothing for a CPU tensor (there is no caching
  allocator to tell), and
* ``torch.cuda.current_stream`` answers with the CPU stream, and
* ``torch.cpu.Stream.device`` is ``cpu`` where torch lacks it (torchrec 1.9's
  stream ordering before the embedding lookup reads ``stream.device``).

Only torchrec's classes ever run inside it, and their results are labelled
"(shimmed)"; the benchmark checks that the shim is off whenever one of ours runs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from tests import devices

_active = False


def shim_active() -> bool:
    """True while :func:`torchrec_on_cpu` is patching torch."""
    return _active


@contextlib.contextmanager
def torchrec_on_cpu() -> Iterator[None]:
    """Patch the CUDA-only calls for the duration of a ``with`` block."""
    global _active
    if _active or devices.on_gpu():  # re-entered (the outer block patches), or real streams
        yield
        return
    real_record_stream = torch.Tensor.record_stream
    real_current_stream = torch.cuda.current_stream
    patch_device = not hasattr(torch.cpu.Stream, "device")

    def record_stream(tensor: torch.Tensor, stream: Any) -> None:
        if tensor.device.type != "cpu":
            real_record_stream(tensor, stream)

    def current_stream(device: Any = None) -> Any:
        return torch.cpu.current_stream()

    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]
    torch.cuda.current_stream = current_stream  # type: ignore[assignment]
    if patch_device:
        torch.cpu.Stream.device = torch.device("cpu")  # type: ignore[attr-defined]
    _active = True
    try:
        yield
    finally:
        _active = False
        torch.Tensor.record_stream = real_record_stream  # type: ignore[method-assign]
        torch.cuda.current_stream = real_current_stream  # type: ignore[assignment]
        if patch_device:
            del torch.cpu.Stream.device  # type: ignore[attr-defined]
