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
    since no step of this schedule could release the inputs early.  It takes
    SparseDist's options but ``input_dist_group`` (the input dist runs in the
    step that trains its batch).

    Differences from torchrec: :ref:`the migration guide <migrating-lite>` (docs/guides/migrating.md).

    Example::

        pipeline = TrainPipelineSparseDistLite(dmp_model, optimizer, device)
        it = iter(dataloader)
        output = pipeline.progress(it)  # one batch a call, until StopIteration

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
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

        What every ``progress()`` does: :class:`~trec_pipelines.PipelineOptions`.
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
