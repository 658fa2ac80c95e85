"""Tapping a model's input dist: how long the training thread spends in it, and when it sends.

:func:`tap_input_dist` notes, on the calling thread only, the time spent
inside torchrec's ``input_dist`` of each sharded module ("issue") and inside
the waits of the input dist's awaitables ("wait") -- the part of the input
dist the thread did not hide, wherever a schedule puts it (a pipelined
forward waits for the tensors all-to-all inside its Forward verb; a plain
loop or Base runs the whole input dist inside the forward) -- and the moment
each all-to-all was issued with the bytes this rank sent in it.

The tap replaces a few torchrec methods and
``torch.distributed.all_to_all_single`` for the length of its block only;
nothing timed should run inside it.  Used by the benchmark's recorded epochs
and by :mod:`trec_pipelines.advise` (the hidden input-dist fraction).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator, List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAllSplitsAwaitable, KJTAllToAllTensorsAwaitable
from torchrec.distributed.embedding_sharding import (
    FusedKJTListSplitsAwaitable,
    KJTListAwaitable,
    KJTListSplitsAwaitable,
)
from torchrec.distributed.types import ShardedModule

# The awaitables of the input dist's two phases (and their list and fused forms).
INPUT_DIST_AWAITABLES: Tuple[type, ...] = (
    KJTAllToAllSplitsAwaitable,
    KJTAllToAllTensorsAwaitable,
    FusedKJTListSplitsAwaitable,
    KJTListSplitsAwaitable,
    KJTListAwaitable,
)


class InputDistTap:
    """What :func:`tap_input_dist` noted on one thread (perf_counter seconds)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.intervals: List[Tuple[str, float, float]] = []  # (kind, start, end)
        self.all_to_alls: List[Tuple[float, int]] = []  # (issued at, bytes sent)

    def timed(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` noting the time the tapped thread spends in it as ``kind``."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.thread:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.intervals.append((kind, start, time.perf_counter()))

        return wrapper

    def issued(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``dist.all_to_all_single`` noting when the tapped thread issued each one."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self.thread:
                sent = args[1] if len(args) > 1 else kwargs.get("input")
                nbytes = sent.numel() * sent.element_size() if isinstance(sent, torch.Tensor) else 0
                self.all_to_alls.append((time.perf_counter(), nbytes))
            return fn(*args, **kwargs)

        return wrapper


@contextlib.contextmanager
def _patched(owner: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """``owner.name`` replaced by ``make(original)`` for the block, restored after."""
    had_own = name in vars(owner)
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


@contextlib.contextmanager
def tap_input_dist(model: nn.Module) -> Iterator[InputDistTap]:
    """Note the calling thread's input-dist time and all-to-all issues in ``model``'s steps."""
    tap = InputDistTap()
    module_types = sorted(
        {type(m) for m in model.modules() if isinstance(m, ShardedModule)}, key=repr
    )
    with contextlib.ExitStack() as stack:
        for cls in module_types:
            stack.enter_context(_patched(cls, "input_dist", lambda fn: tap.timed("issue", fn)))
        for cls in INPUT_DIST_AWAITABLES:
            stack.enter_context(_patched(cls, "_wait_impl", lambda fn: tap.timed("wait", fn)))
        stack.enter_context(_patched(dist, "all_to_all_single", tap.issued))
        yield tap


__all__ = ["INPUT_DIST_AWAITABLES", "InputDistTap", "tap_input_dist"]
