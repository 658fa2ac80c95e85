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
# TrainPipelinePEC (see trec_pipelines.sparse.pec_ops)
OVERLAP_DIST = "OverlapDist"
OL_LOOKUP = "OLLookup"
NOL_LOOKUP = "NOLLookup"
OL_GRAD_START = "OLGradStart"
OL_GRAD_APPLY = "OLGradApply"
NOL_GRAD_START = "NOLGradStart"
NOL_GRAD_APPLY = "NOLGradApply"
# The memory-stashing variants (see trec_pipelines.sparse.stashing)
STASH_RESTORE = "StashRestore"
STASH_WAIT = "StashWait"
OPT_STASH = "OptStash"

TASKS: Tuple[str, ...] = (
    EMB_LOOKUP,
    OL_LOOKUP,
    NOL_LOOKUP,
    ZERO_GRAD,
    WAIT_BATCH,
    FORWARD,
    BACKWARD,
    EMB_BACKWARD,
    OL_GRAD_START,
    OL_GRAD_APPLY,
    NOL_GRAD_START,
    NOL_GRAD_APPLY,
    STASH_WAIT,
    STASH_RESTORE,
    OPTIMIZER_STEP,
    OPT_STASH,
    INPUT_DIST_START,
    INPUT_DIST_WAIT,
    OVERLAP_DIST,
    EMB_PREFETCH,
    H2D,
)
