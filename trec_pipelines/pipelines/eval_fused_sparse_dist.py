"""EvalPipelineFusedSparseDist: inference in TrainPipelineFusedSparseDist's order."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Tuple, cast

import torch
from torchrec.distributed.train_pipeline import In, Out
from typing_extensions import Unpack

from trec_pipelines.assembly.options import EvalSparseDistOptions, takes_options
from trec_pipelines.core.checks import predictions
from trec_pipelines.core.step_guard import guarded_step
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
    the other; ``enable_embedding_lookup_prefetch`` runs it a batch ahead.

    The lookup stream choices and the arguments are
    :class:`TrainPipelineFusedSparseDist`'s; ``optimizer`` may be ``None``.
    ``progress()`` returns the predictions: ``pred`` of a ``(loss, pred)``
    pair, any other output as it is.  Call ``model.eval()`` first: as in
    torchrec, ``zero_grad`` runs if the model is left in training mode, and
    the copy of ``new`` is always issued before the forward
    (``enqueue_batch_after_forward`` has no effect).  A ``progress()`` that
    raises is rolled back as a training step is: the next call evaluates that
    batch again (``skip_failed_batch()`` drops it), and with several ranks the
    others end within seconds naming this rank and the batch.

    Differences from torchrec: :ref:`the migration guide <migrating-eval-fused>` (docs/guides/migrating.md).

    Example::

        model.eval()
        pipeline = EvalPipelineFusedSparseDist(
            model, optimizer, device, enable_embedding_lookup_prefetch=True
        )
        it = iter(dataloader)
        predictions = pipeline.progress(it)  # one batch a call, until StopIteration

    Args:
        enable_embedding_lookup_prefetch: Keyword-only, as torchrec's: run the lookup one
            batch ahead: ``fill_pipeline`` starts the first batch's, and each
            :meth:`progress` issues ``nxt``'s right after ``cur``'s forward, so on a GPU
            they overlap (use ``emb_lookup_stream="new"``; two batches' embeddings are
            then alive at once).

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
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

    @guarded_step
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one step on the next batch of ``dataloader_iter``; return its output.

        What every ``progress()`` does: :class:`~trec_pipelines.PipelineOptions`.
        """
        # See [Note: padding uneven eval data] in trec_pipelines.data.padding.
        return first_real_output(lambda: self._evaluate_step(dataloader_iter))

    def _evaluate_step(self, dataloader_iter: Iterator[Any]) -> Tuple[Any, bool]:
        """One step: ``cur``'s predictions, and whether ``cur`` was a padding batch.

        A step that raises is rolled back and its batch evaluated again by the
        next call (see [Note: a failed eval step] in
        trec_pipelines.pipelines.eval_sparse_dist); the guard retires ``cur``'s
        host copy once ``progress()`` returns."""
        self._start_step(dataloader_iter)  # fill, pull host batches, stop at end of data
        padding = self.contexts[0].padding
        if self._enable_embedding_lookup_prefetch:
            output = self._progress_prefetch(dataloader_iter)
        else:
            output = self._progress_in_order(dataloader_iter)
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
