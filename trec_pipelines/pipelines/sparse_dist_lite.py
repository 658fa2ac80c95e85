"""TrainPipelineSparseDistLite: only the copy overlaps; input_dist stays on the critical path."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Tuple, Type

import torch
from torchrec.distributed.train_pipeline import In, Out
from torchrec.distributed.train_pipeline.types import PipelineState
from typing_extensions import Unpack

from trec_pipelines.assembly.options import LiteOptions, takes_options
from trec_pipelines.core.step_guard import guarded_step
from trec_pipelines.core.streams import StreamSet, make_streams, wait_for_batch
from trec_pipelines.core.subclass_hooks import never_called
from trec_pipelines.model.context import TrainPipelineContext
from trec_pipelines.observe import recorder as rec
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist


@takes_options(LiteOptions)
class TrainPipelineSparseDistLite(TrainPipelineSparseDist[In, Out]):
    """Two batches in flight: ``cur`` runs input_dist and trains, ``nxt`` is copied.

    ==========  =======  ==========================================================
    stream      slot     work
    ==========  =======  ==========================================================
    default     ``cur``  zero_grad, wait, input_dist (start + wait), forward,
                         backward, step
    memcpy      ``nxt``  host-to-device copy, issued between backward and step
    ==========  =======  ==========================================================

    There is no data_dist stream: the all-to-alls of ``cur`` run on the default
    stream just before its forward, so the pipeline holds one batch fewer than
    :class:`TrainPipelineSparseDist` (the device memory of two batches, not
    three) at the price of exposing input_dist.  The copy of ``nxt`` is issued
    after the backward, so it overlaps the optimizer step and the next
    ``progress()`` call's host work.

    Everything else works as in :class:`TrainPipelineSparseDist`: the model
    rewrite and its report, the end of the data, failed steps rolled back and
    retried, epochs without ``reset()``, switching iterators, ``detach()`` and
    ``attach()``.  ``clear_data_dist_inputs`` is accepted and does nothing,
    since no step of this schedule could release the inputs early.  Our
    keyword-only options are SparseDist's but ``input_dist_group`` (the input
    dist runs in the step that trains its batch); see the
    :doc:`options guide </guides/options>`.

    Differences from torchrec: :ref:`the migration guide <migrating-lite>` (docs/guides/migrating.md).

    Example::

        pipeline = TrainPipelineSparseDistLite(dmp_model, optimizer, device)
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
    * ``autocast_dtype``: Run each training forward under ``torch.autocast`` on the pipeline's
      device with this dtype (``torch.bfloat16``, or ``torch.float16`` on CUDA); None runs it as the
      model is.
    * ``grad_scaler``: A ``torch.amp.GradScaler``: the backward scales the summed loss, and the
      optimizer steps through the scaler (unscale, skip the step on inf or nan, update the scale).
      The fused (in-backward) embedding optimizers see the scaled gradients: see the options guide.
    """

    _traits = TrainPipelineSparseDist._traits.updated(
        hooks={
            "sync_embeddings": never_called(
                "TrainPipelineSparseDistLite", "nothing (call it yourself)"
            ),
        },
        depth=2,
        # input_dist runs on the default stream, in the step that trains the batch.
        input_dist_role="default",
        input_dist_ahead=False,
        rewrite_on_attach=False,
    )

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        apply_jit: bool = False,
        context_type: Type[TrainPipelineContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Optional[Callable[[Optional[Any]], Tuple[torch.Tensor, Any]]] = None,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        async_inplace_copy: bool = False,
        **options: Unpack[LiteOptions],
    ) -> None:
        super().__init__(
            model,
            optimizer,
            device,
            apply_jit=apply_jit,
            context_type=context_type,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            dmp_collection_sync_interval_batches=None,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            async_inplace_copy=async_inplace_copy,
            **options,
        )

    def _make_streams(self) -> StreamSet:
        return make_streams(self._device, memcpy=True)

    def _wait_for_batch(self) -> None:
        with self._recording.span(rec.WAIT_BATCH, self.contexts[0].index):  # memcpy -> default
            wait_for_batch(
                self.batches[0], self._streams.memcpy, not self._enable_inplace_copy_batch
            )

    def fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        """Load ``cur`` (copy only) when the queue is empty."""
        if not self.batches:
            self.enqueue_batch(dataloader_iter)

    @guarded_step
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one step on the next batch of ``dataloader_iter``; return its output.

        ``dataloader_iter`` is an iterator (``iter(dataloader)``, not the data loader
        itself), the same one for every call of an epoch.  A training step runs the
        forward, the backward of ``torch.sum(losses, dim=0)`` and the optimizer step
        (the forward alone when the model is in eval mode) and returns the second
        element of the forward's ``(losses, output)``; the class docstring shows what
        else the step overlaps.  At the end of the data it raises ``StopIteration``;
        calling it again then starts a new epoch, with a new iterator or the same one
        refilled (a spent iterator ends again at once).  A step that raises is rolled
        back: the next call retries the same batch, and :meth:`skip_failed_batch`
        drops it instead.  With several ranks, call it on every rank alike.
        """
        # See [Note: a progress() timeline] in trec_pipelines.pipelines.
        # fmt: off
        self._start_step(dataloader_iter)  # fill, pull host batches, stop at end of data
        cur, ctx = self.batches[0], self.contexts[0]
        training = self._model.training

        if training:
            self._zero_grad()                                      # cur, default
        self._wait_for_batch()                                     # cur, memcpy -> default
        self._init_pipelined_modules(cur, ctx, self._pipelined_forward_type)  # cur, default
        self.wait_sparse_data_dist(ctx)                            # cur, default
        losses, output = self._forward()                           # cur, default
        if training:
            self._enter_phase(PipelineState.CALL_BWD)
            self._backward(losses)                                 # cur, default
        self.enqueue_batch(dataloader_iter)                        # nxt, memcpy: overlaps the step
        if training:
            self._optimizer_step()                                 # cur, default
        self.dequeue_batch()
        return output
