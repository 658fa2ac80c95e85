"""Shim that lets torchrec's stream-using pipelines run on CPU.

torchrec's Fused, SemiSync, Prefetch, EvalFused, Staged and CompAutograd
pipelines call ``Tensor.record_stream`` and ``torch.cuda.current_stream()``
even when the device is CPU, and crash.  torchrec 1.9 adds a stream-ordering
step before the embedding lookup (Fused, EvalFused, SemiSync) that reads
``stream.device``, which torch's CPU stream stand-in does not have.  Inside
:func:`torchrec_on_cpu`:

* ``Tensor.record_stream`` is a no-op for CPU tensors;
* ``torch.cuda.current_stream`` returns the CPU stream;
* ``torch.cpu.Stream.device`` is ``cpu`` (only where torch lacks it).

It exists only to get torchrec's results as a reference, in tests and in the
benchmark (where such results are labelled "(shimmed)"); trec_pipelines never
runs under it (tests and the benchmark check that the shim is off when ours
run).  A block entered inside another leaves the patches to the outer one.  Every test
that used it, and which patches were in force, is listed at the end of the
pytest run (see ``conftest.pytest_terminal_summary``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List

import torch

from trec_pipelines.testing import devices

_active = False
# How many times the shim was entered, for conftest's per-test bookkeeping.
_entries = 0

_CPU = torch.device("cpu")


def shim_active() -> bool:
    """True while :func:`torchrec_on_cpu` is patching torch."""
    return _active


def shim_entries() -> int:
    """How many ``torchrec_on_cpu()`` blocks have been entered so far."""
    return _entries


def patches() -> List[str]:
    """The patches :func:`torchrec_on_cpu` applies with the installed torch."""
    applied = [
        "Tensor.record_stream: no-op on CPU tensors",
        "torch.cuda.current_stream: returns the CPU stream",
    ]
    if _cpu_stream_needs_device():
        applied.append("torch.cpu.Stream.device: cpu (torchrec>=1.9 reads stream.device)")
    return applied


def _cpu_stream_needs_device() -> bool:
    return not hasattr(torch.cpu.Stream, "device")


@contextlib.contextmanager
def torchrec_on_cpu() -> Iterator[None]:
    """Patch the CUDA-only calls for the duration of a ``with`` block."""
    global _active, _entries
    if devices.on_gpu():  # torchrec's streams are real there: nothing to patch
        yield
        return
    _entries += 1
    if _active:  # entered inside another block: the outer one patches and restores
        yield
        return
    original_record_stream = torch.Tensor.record_stream
    original_current_stream = torch.cuda.current_stream
    patch_device = _cpu_stream_needs_device()

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if self.device.type == "cpu":
            return None
        return original_record_stream(self, stream)

    def current_stream(device: Any = None) -> Any:
        return torch.cpu.current_stream()

    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign,assignment,attr-defined,unused-ignore]
    torch.cuda.current_stream = current_stream  # type: ignore[method-assign,assignment,attr-defined,unused-ignore]
    if patch_device:
        torch.cpu.Stream.device = _CPU  # type: ignore[method-assign,assignment,attr-defined,unused-ignore]
    _active = True
    try:
        yield
    finally:
        _active = False
        torch.Tensor.record_stream = original_record_stream  # type: ignore[method-assign,assignment,attr-defined,unused-ignore]
        torch.cuda.current_stream = original_current_stream  # type: ignore[method-assign,assignment,attr-defined,unused-ignore]
        if patch_device:
            del torch.cpu.Stream.device  # type: ignore[method-assign,assignment,attr-defined,unused-ignore]
