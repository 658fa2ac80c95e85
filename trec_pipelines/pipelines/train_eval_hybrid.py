"""TrainEvalHybridPipelineBase: one SparseDist schedule that trains or evaluates by the model's mode."""

from __future__ import annotations

from typing import Any, Tuple

import torch
from torchrec.distributed.train_pipeline import In, Out

from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist


class TrainEvalHybridPipelineBase(TrainPipelineSparseDist[In, Out]):
    """SparseDist's schedule; each step trains or evaluates as ``model.training`` says.

    torchrec's experimental class (``experimental_pipelines``), with
    :class:`TrainPipelineSparseDist`'s constructor.  In training mode a step is
    SparseDist's: zero_grad, forward, backward, optimizer step.  In eval mode
    (``model.eval()``) it runs the forward only, under ``torch.no_grad()``,
    and returns its output; the next batches' copy and input dist overlap it
    as in training.  When an eval iterator ends, the eval batches still in
    flight are evaluated first (drained), then ``progress()`` raises
    ``StopIteration``; the next call, with a train iterator, goes on.

    Train then eval then train, on one pipeline::

        model.train()
        for _ in range(steps):
            pipeline.progress(train_it)
        model.eval()
        while True:
            try:
                predictions.append(pipeline.progress(eval_it))
            except StopIteration:
                break
        model.train()
        pipeline.progress(train_it)  # picks up where training stopped

    A fix: the train batches already in flight when the eval iterator is
    passed (two of them: copied, and input-distributed) are set aside with
    their input dist and trained when the train iterator comes back, as
    SparseDist does for any change of iterator (torchrec #3751).  torchrec's
    class evaluates them as the first eval steps instead, returning train
    batches' predictions as eval outputs, and never trains them.  Training
    alone (one iterator) equals torchrec's class bit for bit.
    """

    def _forward(self) -> Tuple[torch.Tensor, Any]:
        if self._model.training:
            return super()._forward()
        with torch.no_grad():
            return super()._forward()
