"""Compiler config values held for a ``with`` and put back on exit.

The compiled pipelines (PT2, SparseDistCompAutograd) need a few dynamo,
functorch and inductor settings while their compiled code runs, and must leave
the user's config alone otherwise.  They enter them every step, so
:class:`HeldSettings` resolves the entries once and sets and restores plain
attributes; ``config.patch`` would build a context-manager class per call.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Tuple


def _fresh(value: Any) -> Any:
    # A list setting is copied so that nobody's list is shared or mutated.
    return list(value) if isinstance(value, list) else value


class HeldSettings:
    """``(config module, name, value)`` entries, set by :meth:`held` for a ``with``."""

    def __init__(self, entries: List[Tuple[Any, str, Any]]) -> None:
        self.entries = list(entries)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        previous = [(config, name, getattr(config, name)) for config, name, _ in self.entries]
        try:
            for config, name, value in self.entries:
                setattr(config, name, _fresh(value))
            yield
        finally:
            for config, name, value in previous:
                setattr(config, name, value)

    def current(self) -> Dict[str, Any]:
        """``"module.name" -> value now`` of every entry (for checks)."""
        return {
            f"{config.__name__}.{name}": _fresh(getattr(config, name))
            for config, name, _ in self.entries
        }
