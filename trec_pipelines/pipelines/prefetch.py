"""PrefetchTrainPipelineSparseDist: SparseDist plus an embedding-cache prefetch stage.

[Note: prefetch ordering]
Issuing prefetch(nxt) on the CPU after forward(cur) does not order the two
on the GPU: they run on different streams.  Unordered, prefetch(nxt) could
evict cache rows forward(cur)'s lookup has not read yet, or be handed
memory the allocator freed on the prefetch stream (cache locations of
``cur``) while forward(cur) still reads it: wrong rows, illegal accesses,
NaNs (the family of races of torchrec issue #4191).  The lookup may be
issued anywhere inside the model's forward (the wrapper returns a lazy
awaitable), so the first point where every read of ``cur``'s prefetch is
known to be issued is the end of forward(cur).  An event is recorded on
the default stream there, and the prefetch stream waits for it before
prefetch(nxt).  The prefetch still overlaps cur's backward and optimizer
step; the embedding kernel orders it against its own backward (FBGEMM
``prefetch_pipeline``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Tuple, cast

import torch
from torchrec.distributed.train_pipeline import In, Out
from typing_extensions import Unpack

from trec_pipelines._types import AnyShardedModule
from trec_pipelines.assembly.options import SparseDistTrainOptions, takes_options
from trec_pipelines.core.step_guard import guarded_step
from trec_pipelines.core.streams import (
    StreamSet,
    current_stream,
    make_streams,
    record_event,
    wait_for_batch,
    wait_stream,
)
from trec_pipelines.model.args import CallArgs
from trec_pipelines.model.context import PrefetchTrainPipelineContext, TrainPipelineContext
from trec_pipelines.observe import recorder as rec
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist
from trec_pipelines.sparse.cache_prefetch import prefetch_modules
from trec_pipelines.sparse.forwards import BaseForward, PrefetchPipelinedForward


@takes_options(SparseDistTrainOptions)
class PrefetchTrainPipelineSparseDist(TrainPipelineSparseDist[In, Out]):
    """Three batches in flight; ``nxt``'s cache prefetch overlaps ``cur``'s backward.

    ==========  =======  ==========================================================
    stream      slot     work
    ==========  =======  ==========================================================
    default     ``cur``  zero_grad, wait, forward (lookup of prefetched rows),
                         backward, step
    prefetch    ``nxt``  wait for the tensors all-to-all, ``ShardedModule.prefetch()``
    data_dist   ``nxt``  tensors all-to-all, launched before ``cur``'s forward
    data_dist   ``new``  splits all-to-all, started after ``cur``'s step
    memcpy      ``new``  host-to-device copy
    ==========  =======  ==========================================================

    Per ``progress()`` call, in the order issued: zero_grad(cur),
    wait(cur, on the prefetch stream), copy(new), input_dist wait(nxt),
    forward(cur), prefetch(nxt), backward(cur), step(cur), input_dist
    start(new).  Filling an empty pipeline copies, distributes and prefetches
    batch 0, then copies batch 1 and starts its input_dist.

    Each pipelined ``ShardedModule.forward`` becomes a
    :class:`~trec_pipelines.sparse.forwards.PrefetchPipelinedForward`, which finds the
    batch's input distributed and its rows prefetched into the embedding cache,
    and only runs ``compute_and_output_dist``.  Every pipelined module goes
    through the prefetch stage, including those with nothing to prefetch (every
    CPU kernel: their ``prefetch()`` does nothing), so the pipeline runs the
    same way on CPU and GPU.  ``prefetch(nxt)`` waits for the end of
    ``forward(cur)``, the first point where every read of ``cur``'s cached rows
    is known to be issued, so it never evicts rows the forward still reads; it
    still overlaps ``cur``'s backward and optimizer step (see
    the note "prefetch ordering" in the source of ``trec_pipelines.pipelines.prefetch``).
    ``clear_data_dist_inputs`` does nothing here (the prefetch stage has
    finished the batch's input_dist before its forward), and the embeddings of
    a ``DMPCollection`` are not synced between replicas, both as in torchrec.
    Epochs, failed steps, iterators and our keyword-only options are as in
    :class:`TrainPipelineSparseDist`.

    Differences from torchrec: :ref:`the migration guide <migrating-prefetch>` (docs/guides/migrating.md).

    Example::

        pipeline = PrefetchTrainPipelineSparseDist(dmp_model, optimizer, device)
        it = iter(dataloader)
        output = pipeline.progress(it)  # one batch a call, until StopIteration

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
    """

    # torchrec's class leaves _state IDLE.
    _traits = TrainPipelineSparseDist._traits.updated(
        tracks_state=False,
    )

    @property
    def _prefetch_stream(self) -> Optional[torch.Stream]:
        """The stream of the cache prefetch (torchrec's attribute; None on CPU)."""
        return self._streams.prefetch

    @property
    def _default_stream(self) -> Optional[torch.Stream]:
        """The device's current stream (torchrec's attribute; None on CPU)."""
        return current_stream(self._device)

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        pipeline_postproc: bool = True,
        custom_model_fwd: Optional[Callable[[Optional[Any]], Tuple[torch.Tensor, Any]]] = None,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        async_inplace_copy: bool = False,
        **options: Unpack[SparseDistTrainOptions],
    ) -> None:
        super().__init__(
            model,
            optimizer,
            device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            context_type=PrefetchTrainPipelineContext,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            async_inplace_copy=async_inplace_copy,
            **options,
        )
        # Recorded on the default stream when the last forward was issued;
        # the next prefetch waits for it (see [Note: prefetch ordering]).
        self._forward_done: Optional[torch.Event] = None

    # ------------------------------------------------------------------ setup

    def _make_streams(self) -> StreamSet:
        return make_streams(self._device, memcpy=True, data_dist=True, prefetch=True)

    def _make_forward(
        self, name: str, call_args: CallArgs, module: AnyShardedModule
    ) -> BaseForward[Any]:
        # The wrapper hands the prefetched input over from the prefetch stream.
        return PrefetchPipelinedForward(
            name,
            call_args,
            module,
            cast(PrefetchTrainPipelineContext, self._current_context()),
            self._streams.prefetch,
        )

    # ------------------------------------------------------------------ verbs

    def _prefetch(self, context: PrefetchTrainPipelineContext) -> None:
        """Finish ``context``'s input_dist and prefetch every module's rows.

        Runs on the prefetch stream.  Moves each module's distributed input and
        sharding context from ``input_dist_tensors_requests`` /
        ``module_contexts`` to ``module_input_post_prefetch`` /
        ``module_contexts_post_prefetch``, where the forward wrapper finds them.
        """
        assert self._pipelined.result is not None, "the model is rewritten before any prefetch"
        context.module_input_post_prefetch.clear()
        context.module_contexts_post_prefetch.clear()
        with self._recording.span(rec.EMB_PREFETCH, context.index, "prefetch"):
            prefetch_modules(
                self._pipelined.result.pipelined,
                context,
                dist_stream=self._streams.data_dist,
                prefetch_stream=self._streams.prefetch,
                forward_stream=current_stream(self._device),
                forward_done=self._forward_done,
            )

    def start_sparse_data_dist(self, batch: Optional[Any], context: TrainPipelineContext) -> None:
        """As SparseDist's, once the prefetch stream's work so far is done.

        The prefetch fills the embedding caches on its own stream, and a
        caching module's input dist may read the cache state (torchrec PR
        #4191): the next batch's input dist, on data_dist, must not overtake
        the prefetch before it, in the fill as in the steady state.
        """
        wait_stream(self._streams.data_dist, self._streams.prefetch)
        super().start_sparse_data_dist(batch, context)

    def _wait_for_batch(self) -> None:
        # The prefetch stream waited for data_dist, which waited for memcpy:
        # waiting for prefetch covers the whole chain of this batch.
        with self._recording.span(rec.WAIT_BATCH, self.contexts[0].index):  # prefetch -> default
            wait_for_batch(
                self.batches[0], self._streams.prefetch, not self._enable_inplace_copy_batch
            )

    def _forward(self) -> Tuple[torch.Tensor, Any]:
        losses, output = super()._forward()
        # Every lookup of the prefetched rows is issued by now.
        self._forward_done = record_event(current_stream(self._device))
        return losses, output

    def detach(self) -> torch.nn.Module:
        """As SparseDist's, once the caller's stream has waited for the prefetch in flight.

        ``nxt``'s prefetch may still be filling the embedding caches on the
        prefetch stream, and whatever the caller runs on the model next is
        issued on the current stream.
        """
        wait_stream(current_stream(self._device), self._streams.prefetch)
        return super().detach()

    # --------------------------------------------------------------- schedule

    def fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        """Fill an empty pipeline: ``cur`` prefetched, ``nxt`` in input_dist.

        A non-empty pipeline is in steady state (two batches) or draining (one)
        and is left alone.
        """
        if self.batches:
            return
        if not self.enqueue_batch(dataloader_iter):
            return
        self._init_pipelined_modules(
            self.batches[0], self.contexts[0], self._pipelined_forward_type
        )
        self.wait_sparse_data_dist(self.contexts[0])
        self._prefetch(self.contexts[0])  # type: ignore[arg-type]
        if not self.enqueue_batch(dataloader_iter):
            return
        self.start_sparse_data_dist(self.batches[1], self.contexts[1])

    @guarded_step
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one step on the next batch of ``dataloader_iter``; return its output.

        What every ``progress()`` does: :class:`~trec_pipelines.PipelineOptions`.
        """
        # See [Note: a progress() timeline] in trec_pipelines.pipelines.
        # fmt: off
        self._start_step(dataloader_iter)  # fill, pull host batches, stop at end of data
        training = self._model.training

        if training:
            self._zero_grad()                                      # cur, default
        self._wait_for_batch()                                     # cur, prefetch -> default
        self.enqueue_batch(dataloader_iter)                        # new, memcpy
        if len(self.batches) >= 2:
            # The tensors all-to-all of nxt then runs during cur's forward.
            self.wait_sparse_data_dist(self.contexts[1])           # nxt, data_dist
        losses, output = self._forward()                           # cur, default
        if len(self.batches) >= 2:
            self._prefetch(self.contexts[1])  # type: ignore[arg-type]  # nxt, prefetch
        if training:
            self._backward(losses)                                 # cur, default
            self._optimizer_step()                                 # cur, default
        if len(self.batches) >= 3:
            self.start_sparse_data_dist(self.batches[2], self.contexts[2])  # new, data_dist
        self.dequeue_batch()
        return output
