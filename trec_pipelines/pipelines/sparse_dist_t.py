"""TrainPipelineSparseDistT: SparseDist with every host-to-device copy issued by a thread."""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Type

import torch
from torchrec.distributed.train_pipeline import In, Out
from typing_extensions import Unpack

from trec_pipelines.assembly.options import SparseDistTrainOptions, takes_options
from trec_pipelines.core.subclass_hooks import ASYNC_SUBMIT_OFF
from trec_pipelines.data.inplace_copy import BatchQueue, make_copy_worker
from trec_pipelines.model.context import TrainPipelineContext
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist


@takes_options(SparseDistTrainOptions)
class TrainPipelineSparseDistT(TrainPipelineSparseDist[In, Out]):
    """:class:`TrainPipelineSparseDist`'s schedule; a background thread issues the copies.

    ==========  =======  ==========================================================
    stream      slot     work
    ==========  =======  ==========================================================
    default     ``cur``  zero_grad, wait, forward, backward, step
    data_dist   ``nxt``  input_dist: splits all-to-all, then tensors all-to-all
    memcpy      ``new``  host-to-device copy, issued by the worker thread
    ==========  =======  ==========================================================

    torchrec's experimental class (``experimental_pipelines``).  The slots are
    SparseDist's; ``new``'s slot holds the copy's Future until the next step
    first reads it, before any stream waits for the copy.

    Every copy of ``new``, in place (``enable_inplace_copy_batch``) or not, is
    submitted to one worker thread, so the training thread does not spend the
    CPU time of issuing it (the machinery of ``async_inplace_copy``, see
    the note "async in-place copy" in the source of ``trec_pipelines.data.inplace_copy``).  The
    copy is always issued before the forward: there is no
    ``enqueue_batch_after_forward`` and no ``async_inplace_copy`` parameter.
    On a device without streams (CPU) there is no device copy to issue: the
    copies stay on the training thread (logged once).  Everything else,
    results included, is SparseDist's, bit for bit.

    Differences from torchrec: :ref:`the migration guide <migrating-sparse-dist-t>` (docs/guides/migrating.md).

    Example::

        pipeline = TrainPipelineSparseDistT(dmp_model, optimizer, torch.device("cuda"))
        it = iter(dataloader)
        while True:
            try:
                output = pipeline.progress(it)
            except StopIteration:
                break

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
        enable_inplace_copy_batch: Copy each batch into device memory allocated on the default
            stream, the copy itself on the memcpy stream (no ``record_stream`` needed); ``False``:
            ``batch.to(device)`` on the memcpy stream.
        free_features_storage_early: Free the device copy of a batch's sparse features once its
            input_dist has read them (only storage the pipeline's own copy made).
        clear_data_dist_inputs: Free the inputs of the tensors all-to-all in flight once it has
            them, to lower peak memory.

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

    # torchrec's constructor takes no async_inplace_copy: it never submits a copy.
    _traits = TrainPipelineSparseDist._traits.updated(
        hooks={"_submit_inplace_copy": ASYNC_SUBMIT_OFF},
    )

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: Type[TrainPipelineContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Optional[Callable[[Optional[Any]], Tuple[torch.Tensor, Any]]] = None,
        dmp_collection_sync_interval_batches: Optional[int] = 1,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        **options: Unpack[SparseDistTrainOptions],
    ) -> None:
        super().__init__(
            model,
            optimizer,
            device,
            execute_all_batches,
            apply_jit,
            context_type,
            pipeline_postproc,
            custom_model_fwd,
            dmp_collection_sync_interval_batches,
            enqueue_batch_after_forward=False,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            **options,
        )
        self._copy_worker = make_copy_worker(self, False, every_copy=True)
        self.batches = BatchQueue(self.batches)  # its slots may hold the worker's Futures
