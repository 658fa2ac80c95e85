"""Where the distributed tests and the benchmark run: device and backend.

``TREC_DEVICE`` in the environment chooses:

* ``auto`` (or unset): CUDA with NCCL where a GPU is present, else CPU with gloo;
* ``cpu``: CPU with gloo, even on a GPU host;
* ``cuda``: CUDA with NCCL, an error where no GPU is present.

On CUDA each rank takes the GPU of its ``LOCAL_RANK`` (torchrun's).  The
process groups that only carry small host-side agreements (the test harness's
barriers use torchrun's store, not a group) are not affected.

``make test-gpu`` sets ``TREC_DEVICE=cuda``; ``make test`` leaves it unset.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

ENV = "TREC_DEVICE"
CHOICES = ("auto", "cpu", "cuda")


@functools.lru_cache(maxsize=None)
def device_type() -> str:
    """``"cpu"`` or ``"cuda"``, as ``TREC_DEVICE`` asks (see the module docstring)."""
    wanted = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if wanted not in CHOICES:
        raise ValueError(f"{ENV}={wanted!r}: expected one of {', '.join(CHOICES)}")
    has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if wanted == "cuda" and not has_gpu:
        raise RuntimeError(
            f"{ENV}=cuda but torch sees no GPU (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}); unset {ENV} to run on the CPU"
        )
    if wanted == "auto":
        return "cuda" if has_gpu else "cpu"
    return wanted


def on_gpu() -> bool:
    """Whether the tests and the benchmark run on CUDA."""
    return device_type() == "cuda"


def device() -> torch.device:
    """This rank's device: ``cpu``, or ``cuda:<LOCAL_RANK>``."""
    if not on_gpu():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def backend() -> str:
    """The collective backend for the model's process groups."""
    return "nccl" if on_gpu() else "gloo"


def bind() -> torch.device:
    """Make this rank's device current (on CUDA) and return it; call before
    ``init_process_group``."""
    here = device()
    if here.type == "cuda":
        torch.cuda.set_device(here)
    return here


def cpu_only(reason: str) -> Any:
    """A pytest mark skipping a test that checks CPU-only behaviour (torchrec's
    crashes on CPU, say) when the tier runs on CUDA."""
    import pytest

    return pytest.mark.skipif(on_gpu(), reason=f"checks CPU-only behaviour: {reason}")
