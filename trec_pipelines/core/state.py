"""Where a training step is, for code that recovers from a failed step."""

from __future__ import annotations

import enum


@enum.unique
class PipelineState(enum.Enum):
    """The phase of a training step: between steps, in forward, in backward.

    Our pipelines do not set it; it is offered with torchrec's names and values
    (``IDLE`` 0, ``CALL_FWD`` 1, ``CALL_BWD`` 2, ``UNKNOWN`` 3) for code that
    stores or compares them.
    """

    IDLE = 0
    CALL_FWD = 1
    CALL_BWD = 2
    UNKNOWN = 3

    def __str__(self) -> str:
        return self.name
