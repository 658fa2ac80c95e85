"""A logged stand-in for ``torch.cuda``, for replaying a pipeline's stream calls.

Streams, a per-call current-stream stack and numbered events; every
``wait_stream``, ``wait_event`` and ``record`` is appended to ``log``.  It has
no ``synchronize``, so a pipeline that calls one fails.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator, List, Tuple

import torch


class _Stream:
    def __init__(self, log: List[Tuple[Any, ...]], name: str) -> None:
        self.log, self.name, self.device = log, name, torch.device("cuda")

    def wait_stream(self, other: "_Stream") -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: "_Event") -> None:
        self.log.append(("wait_event", self.name, event.number))


class _Event:
    def __init__(self, log: List[Tuple[Any, ...]], number: int) -> None:
        self.log, self.number = log, number

    def record(self, stream: _Stream) -> None:
        self.log.append(("record_event", stream.name, self.number))


class FakeCuda:
    """Stands in for ``torch.cuda`` (see the module docstring)."""

    def __init__(self, log: List[Tuple[Any, ...]]) -> None:
        self.log = log
        self.default = _Stream(log, "default")
        self._stack: List[_Stream] = []
        self._events = itertools.count()

    def Stream(self, priority: int = 0) -> _Stream:
        return _Stream(self.log, "unnamed")

    def current_stream(self) -> _Stream:
        return self._stack[-1] if self._stack else self.default

    @contextlib.contextmanager
    def stream(self, stream: _Stream) -> Iterator[None]:
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()

    def Event(self) -> _Event:
        return _Event(self.log, next(self._events))
