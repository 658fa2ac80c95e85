"""TrainEvalHybridPipelineBase: one SparseDist schedule that trains or evaluates by the model's mode."""

from __future__ import annotations

from typing import Any, Tuple

import torch
from torchrec.distributed.train_pipeline import In, Out

from trec_pipelines.assembly.options import SparseDistTrainOptions, takes_options
from trec_pipelines.core.subclass_hooks import Refused
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist


@takes_options(SparseDistTrainOptions)
class TrainEvalHybridPipelineBase(TrainPipelineSparseDist[In, Out]):
    """SparseDist's schedule; each step trains or evaluates as ``model.training`` says.

    ==========  =======  ==========================================================
    stream      slot     work
    ==========  =======  ==========================================================
    default     ``cur``  training: zero_grad, wait, forward, backward, step;
                         eval: wait, forward under ``torch.no_grad()``
    data_dist   ``nxt``  input_dist
    memcpy      ``new``  host-to-device copy
    ==========  =======  ==========================================================

    torchrec's experimental class (``experimental_pipelines``), with
    :class:`TrainPipelineSparseDist`'s constructor and slots; in both modes the
    next batches' copy and input dist overlap ``cur``'s step.

    In training mode a step is SparseDist's.  In eval mode (``model.eval()``)
    it runs the forward only, under ``torch.no_grad()``, and returns its
    output.  When an eval iterator ends, the eval batches still in flight are
    evaluated first, then ``progress()`` raises ``StopIteration``; the next
    call, with a train iterator, goes on.  The train batches in flight when the
    eval iterator is passed (two: one copied, one input-distributed) are set
    aside with their input dist and trained when the train iterator comes
    back, as SparseDist does for any change of iterator.  Training alone (one
    iterator) equals torchrec's class bit for bit.

    Differences from torchrec: :ref:`the migration guide <migrating-hybrid>` (docs/guides/migrating.md).

    Example (train, then eval, then train again, on one pipeline)::

        model.train()
        for _ in range(steps):
            pipeline.progress(train_it)
        model.eval()
        predictions.append(pipeline.progress(eval_it))  # one batch a call, until StopIteration
        model.train()
        pipeline.progress(train_it)  # picks up where training stopped

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
    """

    _traits = TrainPipelineSparseDist._traits.updated(
        hooks={
            "_prepare_pipeline_step": Refused(
                "it pre-pulls the next host batch and drains eval batches by torchrec's own state; "
                "here the batches are pulled at the top of each step and an iterator switch parks "
                "the other mode's batches",
                "_next_batch(dataloader_iter) to filter or transform batches",
            ),
        },
    )

    def _forward(self) -> Tuple[torch.Tensor, Any]:
        if self._model.training:
            return super()._forward()
        with torch.no_grad():
            return super()._forward()
