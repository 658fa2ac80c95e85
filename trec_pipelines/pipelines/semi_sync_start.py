"""What SemiSync says when torchrec's ``start_batch`` keeps a run synchronous."""

from __future__ import annotations

import logging
from typing import Optional

logger: logging.Logger = logging.getLogger("trec_pipelines.pipelines.semi_sync")

# torchrec's default start_batch: shorter runs never leave the synchronous start.
TORCHREC_START_BATCH = 900


def say_synchronous_start(name: str, first_index: Optional[int], start_batch: int) -> None:
    """One INFO line when the first batch (``first_index``) trains synchronously.

    Until ``start_batch`` each lookup waits for the previous update, as
    SparseDist's does: a run shorter than that (torchrec's default is 900
    batches) trains bit for bit as SparseDist and nothing else shows it.
    """
    if first_index is None or first_index >= start_batch:
        return
    default = ", torchrec's default" if start_batch == TORCHREC_START_BATCH else ""
    logger.info(
        "%s: synchronous until batch %d (start_batch=%d%s): until then each batch is looked "
        "up after the previous batch's update, as TrainPipelineSparseDist trains; pass "
        "start_batch=0 (or another number) to overlap them sooner",
        name,
        start_batch,
        start_batch,
        default,
    )
