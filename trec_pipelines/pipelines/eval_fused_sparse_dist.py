"""EvalPipelineFusedSparseDist: inference in TrainPipelineFusedSparseDist's order."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Tuple, cast

import torch
from torchrec.distributed.train_pipeline import In, Out
from typing_extensions import Unpack

from trec_pipelines.assembly.options import EvalSparseDistOptions, takes_options
from trec_pipelines.core.checks import predictions
from trec_pipelines.core.subclass_hooks import never_called
from trec_pipelines.data.padding import first_real_output
from trec_pipelines.observe import recorder as rec
from trec_pipelines.pipelines.fused_sparse_dist import EmbLookupStream, TrainPipelineFusedSparseDist


@takes_options(EvalSparseDistOptions)
class EvalPipelineFusedSparseDist(TrainPipelineFusedSparseDist[In, Out]):
    """Inference in Fused's order: no backward or step, the forward under ``torch.no_grad()``.

    ==========  =======  ==================================================
    stream      slot     work
    ==========  =======  ==================================================
    lookup      ``cur``  embedding lookup (with prefetch: ``nxt``'s, issued
                         after ``cur``'s forward)
    default     ``cur``  wait, dense forward
    data_dist   ``nxt``  input_dist
    memcpy      ``new``  host-to-device copy
    ==========  =======  ==================================================

    Three batches in flight.  By default ``cur``'s lookup is issued at the top
    of :meth:`progress` and its forward right after, so the two run one after
    the other.  With ``enable_embedding_lookup_prefetch=True`` the lookup runs
    one batch ahead: ``fill_pipeline`` starts the first batch's, and each
    :meth:`progress` issues ``nxt``'s right after ``cur``'s forward, so on a
    GPU they overlap (use ``emb_lookup_stream="new"``; two batches' embeddings
    are then alive at once).

    The lookup stream choices and the arguments are
    :class:`TrainPipelineFusedSparseDist`'s; ``optimizer`` may be ``None``.
    ``progress()`` returns the predictions: ``pred`` of a ``(loss, pred)``
    pair, any other output as it is.  Call ``model.eval()`` first: as in
    torchrec, ``zero_grad`` runs if the model is left in training mode, and
    the copy of ``new`` is always issued before the forward
    (``enqueue_batch_after_forward`` has no effect).

    Differences from torchrec: :ref:`the migration guide <migrating-eval-fused>` (docs/guides/migrating.md).

    Example::

        model.eval()
        pipeline = EvalPipelineFusedSparseDist(
            model, optimizer, device, enable_embedding_lookup_prefetch=True
        )
        it = iter(dataloader)
        while True:
            try:
                predictions = pipeline.progress(it)
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
        pipeline_postproc: Run the parameter-free modules between the batch and a sharded module
            (postprocs) ahead, in the input_dist stage, once per batch; ``False``: they run in the
            forward, and a sharded module that reads their output is not pipelined.
        custom_model_fwd: A function of the device batch called instead of ``model(batch)``,
            returning ``(losses, output)`` as the forward would; ``None``: the model's forward.
        strict: TrainPipelineSemiSync: raise ``ValueError``, instead of warning, when the optimizer
            holds a pipelined module's parameters. The fused pipelines accept it and do not use it,
            as torchrec's.
        emb_lookup_stream: The stream the embedding lookup runs on: ``"data_dist"`` (input_dist's),
            ``"new"`` (one of its own) or ``"current"``.
        embedding_lookup_after_data_dist: ``False``: start the trained batch's embedding lookup
            first in its step; ``True``: after the next batch's input_dist is started and the newest
            batch's copy issued.
        enable_inplace_copy_batch: Copy each batch into device memory allocated on the default
            stream, the copy itself on the memcpy stream (no ``record_stream`` needed); ``False``:
            ``batch.to(device)`` on the memcpy stream.
        enqueue_batch_after_forward: Issue the host-to-device copy of the newest batch after the
            forward instead of before it.
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
    * ``uneven_data``: What an eval pipeline does when the ranks hold different numbers of batches
      (with the ranks agreeing on each batch, see ``sync_exhaustion``). "pad" (the default) scores
      every rank's batches: a rank whose data ended runs padding steps, whose outputs no one sees,
      until every rank's data has ended, then raises ``StopIteration``. "stop" ends every rank's
      epoch where the first rank's data ends, as training always does; the other ranks' remaining
      batches are not scored (``unused_batches``).
    * ``validate_batches``: Check each host batch's KeyedJaggedTensors as it is pulled: a malformed
      one raises ``MalformedBatchError`` before any work is issued for it.
    * ``input_dist_group``: "dedicated" runs the pipelined input_dist on a process group of the same
      ranks that carries nothing else; "shared" keeps it on the model's group, as torchrec does.
      Results are the same either way.
    """

    _traits = TrainPipelineFusedSparseDist._traits.updated(
        hooks={
            hook: never_called("EvalPipelineFusedSparseDist", "progress(dataloader_iter)")
            for hook in ("_backward", "_optimizer_step", "sync_embeddings")
        },
        requires_optimizer=False,  # nothing is trained: optimizer=None is fine
    )

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        pipeline_postproc: bool = True,
        custom_model_fwd: Optional[Callable[[Optional[Any]], Tuple[torch.Tensor, Any]]] = None,
        strict: bool = False,
        emb_lookup_stream: EmbLookupStream = "data_dist",
        embedding_lookup_after_data_dist: bool = False,
        enable_inplace_copy_batch: bool = False,
        enqueue_batch_after_forward: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        enable_embedding_lookup_prefetch: bool = False,
        **options: Unpack[EvalSparseDistOptions],
    ) -> None:
        super().__init__(
            model,
            optimizer,  # type: ignore[arg-type]
            device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            strict=strict,
            emb_lookup_stream=emb_lookup_stream,
            embedding_lookup_after_data_dist=embedding_lookup_after_data_dist,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            enqueue_batch_after_forward=enqueue_batch_after_forward,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            # uneven_data is ours, not the training parent's: the options are
            # checked against this class (resolve_options reads type(self)).
            **cast(Any, options),
        )
        self._enable_embedding_lookup_prefetch = enable_embedding_lookup_prefetch

    def _zero_grad_if_training(self) -> None:
        # Upstream clears the gradients when the model was left in training mode.
        if self._model.training and self._optimizer is not None:
            self._zero_grad()

    def _eval_forward(self) -> Any:
        with self._recording.span(rec.FORWARD, self.contexts[0].index):
            with torch.no_grad():
                # (loss, pred) or predictions only: both model shapes, as EvalPipelineSparseDist.
                return predictions(self._model_fwd(self.batches[0]))

    # --------------------------------------------------------------- schedule

    def fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        """SparseDist's fill; with prefetch, also start ``cur``'s lookup before copying ``nxt``."""
        if not self._enable_embedding_lookup_prefetch:
            super().fill_pipeline(dataloader_iter)
            return
        if len(self.batches) >= 2:
            return
        if self.batches and self._execute_all_batches:
            return  # draining: the last batch's lookup is already under way
        if not self.enqueue_batch(dataloader_iter):
            return
        self._init_pipelined_modules(
            self.batches[0], self.contexts[0], self._pipelined_forward_type
        )
        self.wait_sparse_data_dist(self.contexts[0])
        self.start_embedding_lookup(self.batches[0], self.contexts[0])  # the first forward's
        self.enqueue_batch(dataloader_iter)

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

        An eval pipeline runs the forward alone, under ``no_grad`` (no backward, no
        optimizer step), and returns the predictions: ``pred`` of a ``(loss, pred)``
        pair, or the forward's output as it is.  With ranks holding different numbers
        of batches, it returns one output per batch of this rank's own: once this
        rank's data has ended, the call runs padding steps (their outputs thrown away)
        until every rank's has, then raises ``StopIteration`` (``uneven_data="pad"``,
        the default; see the what-happens-when guide).
        """
        # See [Note: padding uneven eval data] in trec_pipelines.data.padding.
        return first_real_output(lambda: self._evaluate_step(dataloader_iter))

    def _evaluate_step(self, dataloader_iter: Iterator[Any]) -> Tuple[Any, bool]:
        """One step: ``cur``'s predictions, and whether ``cur`` was a padding batch."""
        self._start_step(dataloader_iter)  # fill, pull host batches, stop at end of data
        padding = self.contexts[0].padding
        if self._enable_embedding_lookup_prefetch:
            output = self._progress_prefetch(dataloader_iter)
        else:
            output = self._progress_in_order(dataloader_iter)
        self._source.retire()  # cur's host copy: a checkpoint from here goes on with nxt
        return output, padding

    def _progress_in_order(self, dataloader_iter: Iterator[Any]) -> Any:
        """``cur``'s lookup, then its forward (the Fused training order without the update)."""
        # See [Note: a progress() timeline] in trec_pipelines.pipelines.
        # fmt: off
        if not self._embedding_lookup_after_data_dist:
            self.start_embedding_lookup(self.batches[0], self.contexts[0])  # cur, lookup
        self._zero_grad_if_training()                              # cur, default
        self._wait_for_batch()                                     # cur, data_dist -> default
        if self._clear_data_dist_inputs:
            self.clear_sparse_data_dist_inputs(self.contexts[0])
        if len(self.batches) >= 2:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])  # nxt, data_dist
        self.enqueue_batch(dataloader_iter)                        # new, memcpy
        if self._embedding_lookup_after_data_dist:
            self.start_embedding_lookup(self.batches[0], self.contexts[0])  # cur, lookup
        output = self._eval_forward()                              # cur, default (waits for the lookup)
        if len(self.batches) >= 2:
            self.wait_sparse_data_dist(self.contexts[1])           # nxt, data_dist
        self.dequeue_batch()
        return output

    def _progress_prefetch(self, dataloader_iter: Iterator[Any]) -> Any:
        """``cur``'s lookup was started one call earlier; ``nxt``'s starts after ``cur``'s forward."""
        # See [Note: a progress() timeline] in trec_pipelines.pipelines.
        # fmt: off
        self._zero_grad_if_training()                              # cur, default
        self._wait_for_batch()                                     # cur, data_dist -> default
        if self._clear_data_dist_inputs:
            self.clear_sparse_data_dist_inputs(self.contexts[0])
        if len(self.batches) >= 2:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])  # nxt, data_dist
        self.enqueue_batch(dataloader_iter)                        # new, memcpy
        # Issued before nxt's input_dist wait, which it does not depend on.
        output = self._eval_forward()                              # cur, default (lookup primed)
        if len(self.batches) >= 2:
            self.wait_sparse_data_dist(self.contexts[1])           # nxt, data_dist
            self.start_embedding_lookup(self.batches[1], self.contexts[1])  # nxt, lookup (overlaps cur's forward)
        self.dequeue_batch()
        return output
