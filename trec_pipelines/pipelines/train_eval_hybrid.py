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
        while True:
            try:
                predictions.append(pipeline.progress(eval_it))
            except StopIteration:
                break
        model.train()
        pipeline.progress(train_it)  # picks up where training stopped

    torchrec's parameters, in torchrec's order:

    Args:
        model: The model: its forward takes a batch on ``device`` and, in a training pipeline,
            returns ``(losses, output)`` (the eval pipelines also take a model that returns
            predictions alone). Usually a ``DistributedModelParallel``, whose sharded modules'
            input_dist the pipeline runs ahead; a model without sharded modules trains unpipelined
            (logged).
        optimizer: The optimizer over the parameters the backward does not update itself (not the
            fused, in-backward embedding optimizer), stepped once per trained batch. The eval
            pipelines take ``None``.
        device: The device batches are copied to and the model runs on: a ``torch.device`` or a
            string naming one (``"cuda:0"``, ``"cpu"``).
        execute_all_batches: ``True``: when the iterator ends, train the batches still in flight;
            ``False``: drop them (logged), so N-2 of N batches are trained.
        apply_jit: torchrec's switch to TorchScript the model's unsharded modules. ``True`` raises
            ``ValueError`` here: TorchScript is deprecated in PyTorch; compile the dense part
            instead.
        context_type: The class of the context made for each batch (``TrainPipelineContext`` or a
            subclass of it, for fields of your own).
        pipeline_postproc: Run the parameter-free modules between the batch and a sharded module
            (postprocs) ahead, in the input_dist stage, once per batch; ``False``: they run in the
            forward, and a sharded module that reads their output is not pipelined.
        custom_model_fwd: A function of the device batch called instead of ``model(batch)``,
            returning ``(losses, output)`` as the forward would; ``None``: the model's forward.
        dmp_collection_sync_interval_batches: With a ``DMPCollection`` (2D sharding): sync the
            replicas' embedding weights and optimizer states every this many batches (``None``:
            never). No effect on other models.
        enqueue_batch_after_forward: Issue the host-to-device copy of the newest batch after the
            forward instead of before it.
        enable_inplace_copy_batch: Copy each batch into device memory allocated on the default
            stream, the copy itself on the memcpy stream (no ``record_stream`` needed); ``False``:
            ``batch.to(device)`` on the memcpy stream.
        free_features_storage_early: Free the device copy of a batch's sparse features once its
            input_dist has read them (only storage the pipeline's own copy made).
        clear_data_dist_inputs: Free the inputs of the tensors all-to-all in flight once it has
            them, to lower peak memory.
        async_inplace_copy: Issue the in-place host-to-device copy from a background thread
            (torchrec 1.9.2); implies ``enable_inplace_copy_batch``. On a device without streams
            (CPU) the copy stays on the training thread (logged).

    Our keyword-only options (each described in the options guide):

    * ``rewrite_strategy``: How the sharded modules' inputs are found: "fx" (trace the model),
      "direct" (bind the batch's KeyedJaggedTensor fields) or "auto" (trace, falling back to direct
      binding).
    * ``on_unpipelined``: A sharded module the rewrite cannot pipeline is logged and trained
      unpipelined ("warn"), or refused with the reason ("raise").
    * ``sync_exhaustion``: The ranks agree on every batch they pull, so data that ends on one rank
      first ends every rank's epoch at the same step (an eval pipeline pads until every rank's data
      ended instead: ``uneven_data``), and a batch malformed on one rank is dropped on all. None
      (the default) agrees whenever the model's steps join collectives across ranks; True insists
      (and needs torch.distributed); False turns it off.
    * ``agree_ahead``: With the ranks agreeing on each batch (``sync_exhaustion``), pull one host
      batch a step ahead so its agreement rides the current step's exchange, at the cost of one more
      host batch held (pulled from the iterator, not yet copied to the device; see the memory
      guide). False holds none: each pull is agreed as it is made, with a blocking round trip of its
      own on a gloo group. No effect without the agreement.
    * ``validate_batches``: Check each host batch's KeyedJaggedTensors as it is pulled: a malformed
      one raises ``MalformedBatchError`` before any work is issued for it.
    * ``input_dist_group``: "dedicated" runs the pipelined input_dist on a process group of the same
      ranks that carries nothing else; "shared" keeps it on the model's group, as torchrec does.
      Results are the same either way.
    * ``autocast_dtype``: Run each training forward under ``torch.autocast`` on the pipeline's
      device with this dtype (``torch.bfloat16``, or ``torch.float16`` on CUDA); None runs it as the
      model is.
    * ``grad_scaler``: A ``torch.amp.GradScaler``: the backward scales the summed loss, and the
      optimizer steps through the scaler (unscale, skip the step on inf or nan, update the scale).
      The fused (in-backward) embedding optimizers see the scaled gradients: see the options guide.
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
