"""A variant of your own: TrainPipelineSparseDist with each batch copied a step earlier.

TrainPipelineSparseDist copies a batch to the device one step before its input_dist
starts.  This variant copies it two steps before, so a slow host-to-device copy has two
steps' work to hide behind, at the cost of one more batch in device memory.  It changes
no step's timeline: the fill copies one batch more, and the class says it holds four.
"""

from __future__ import annotations

from typing import Any, Iterator

from trec_pipelines import In, Out, TrainPipelineSparseDist


class TrainPipelineCopyAhead(TrainPipelineSparseDist[In, Out], depth=4):
    """Four batches in flight right after a step's copy: ``cur`` trains, ``nxt`` is in
    input_dist, and the two newest are on the device or on their way there.

    ==========  ==============  ==============================================
    stream      slot            work
    ==========  ==============  ==============================================
    default     ``cur``         forward, backward, optimizer step
    data_dist   ``nxt``         input_dist
    memcpy      ``new``         host-to-device copy (the batch after the one
                                copied last step)
    ==========  ==============  ==============================================

    ``depth=4`` tells the core how many host batches a step may have pulled.
    """

    def fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        """Copy ``cur`` (with its input_dist) and ``nxt`` as the base does, then one
        batch more: from then on every step's copy is two steps ahead of its input_dist."""
        empty = not self.batches
        super().fill_pipeline(dataloader_iter)
        if empty and len(self.batches) == 2:
            self.enqueue_batch(dataloader_iter)
