"""Task names: one per verb a schedule is built from, in table order."""

from __future__ import annotations

from typing import Tuple

H2D = "H2D"
INPUT_DIST_START = "InputDistStart"
INPUT_DIST_WAIT = "InputDistWait"
EMB_LOOKUP = "EmbLookup"
EMB_PREFETCH = "EmbPrefetch"
ZERO_GRAD = "ZeroGrad"
WAIT_BATCH = "WaitBatch"
FORWARD = "Forward"
BACKWARD = "Backward"
EMB_BACKWARD = "EmbBackward"
OPTIMIZER_STEP = "OptimizerStep"

TASKS: Tuple[str, ...] = (
    EMB_LOOKUP,
    ZERO_GRAD,
    WAIT_BATCH,
    FORWARD,
    BACKWARD,
    EMB_BACKWARD,
    OPTIMIZER_STEP,
    INPUT_DIST_START,
    INPUT_DIST_WAIT,
    EMB_PREFETCH,
    H2D,
)

