"""Where a training step is, for code that recovers from a failed step."""

from __future__ import annotations

import enum


@enum.unique
class PipelineState(enum.Enum):
    """The phase of a training step: between steps, in forward, in backward.

    torchrec's names and values (``IDLE`` 0, ``CALL_FWD`` 1, ``CALL_BWD`` 2,
    ``UNKNOWN`` 3).  A pipeline's ``_state`` holds torchrec's own members (code
    written against torchrec compares it with them); each member here compares
    equal to torchrec's of the same name, and hashes alike, so code that imports
    this one instead reads ``_state`` the same way.
    """

    IDLE = 0
    CALL_FWD = 1
    CALL_BWD = 2
    UNKNOWN = 3

    def __str__(self) -> str:
        return self.name

    def __eq__(self, other: object) -> bool:
        if isinstance(other, enum.Enum) and type(other).__name__ == "PipelineState":
            return self.name == other.name and self.value == other.value
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)
