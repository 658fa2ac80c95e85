"""TrainPipelineFusedSparseDist: the embedding lookup leaves the forward (the eval variant:
:mod:`trec_pipelines.pipelines.eval_fused_sparse_dist`)."""

from __future__ import annotations

from typing import (
    Any,
    Callable,
    Deque,
    Iterator,
    List,
    Literal,
    Optional,
    Tuple,
    cast,
)

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
    wait_stream,
)
from trec_pipelines.core.subclass_hooks import ASYNC_SUBMIT_OFF, never_called
from trec_pipelines.model.args import CallArgs
from trec_pipelines.model.context import EmbeddingTrainPipelineContext
from trec_pipelines.observe import recorder as rec
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist
from trec_pipelines.sparse import lookup
from trec_pipelines.sparse.forwards import BaseForward, InSyncEmbeddingPipelinedForward

EmbLookupStream = Literal["data_dist", "new", "current"]
EMB_LOOKUP_STREAMS: Tuple[str, ...] = ("data_dist", "new", "current")


@takes_options(SparseDistTrainOptions)
class TrainPipelineFusedSparseDist(TrainPipelineSparseDist[In, Out]):
    """Three batches in flight as in SparseDist; ``cur``'s embedding lookup runs first, on its own stream.

    ==========  =======  ==================================================
    stream      slot     work
    ==========  =======  ==================================================
    lookup (*)  ``cur``  embedding lookup (``compute_and_output_dist``)
    default     ``cur``  zero_grad, wait, dense forward, backward, step
    data_dist   ``nxt``  input_dist: splits all-to-all, then tensors all-to-all
    memcpy      ``new``  host-to-device copy
    ==========  =======  ==================================================

    (*) ``emb_lookup_stream``: "data_dist" (default) reuses the input_dist
    stream, so the caching allocator keeps memory for one stream fewer; "new"
    gives the lookup a stream of its own (most overlap); "current" runs it on
    the default stream (no overlap: SparseDist with the lookup issued earlier).

    The slots are :class:`TrainPipelineSparseDist`'s.  The lookup of ``cur`` is
    issued at the top of :meth:`progress`, before the dense forward, and on a
    GPU it overlaps the previous batch's optimizer step; each pipelined
    module's forward is an
    :class:`~trec_pipelines.sparse.forwards.InSyncEmbeddingPipelinedForward`, which
    hands the result over still attached to autograd, so the backward reaches
    the embeddings as usual.

    Reading the tables before the previous optimizer step is correct only when
    the embeddings are updated inside the backward (the fused TBE optimizer,
    torchrec's default for sharded tables): a table trained by the dense
    optimizer (data-parallel tables) or behind a feature processor would be
    read before its update.  The class is experimental, as in torchrec: check
    NE parity before relying on it.  ``embedding_lookup_after_data_dist=True``
    issues the lookup after ``nxt``'s input_dist start and ``new``'s copy
    instead, which helps when launching the all-to-alls is what holds the CPU
    back.  ``pipeline_postproc`` defaults to True, as in torchrec.  The rest
    (epochs, failed steps, iterators, our keyword-only options) is
    :class:`TrainPipelineSparseDist`'s.

    Differences from torchrec: :ref:`the migration guide <migrating-fused>` (docs/guides/migrating.md).

    Example::

        pipeline = TrainPipelineFusedSparseDist(
            dmp_model, optimizer, torch.device("cuda"), emb_lookup_stream="new"
        )
        it = iter(dataloader)
        output = pipeline.progress(it)  # one batch a call, until StopIteration

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
    """

    # torchrec's class leaves _state IDLE.
    _traits = TrainPipelineSparseDist._traits.updated(
        hooks={
            "wait_embedding_lookup": never_called(
                "TrainPipelineFusedSparseDist", "start_embedding_lookup(batch, context)"
            ),
            "_submit_inplace_copy": ASYNC_SUBMIT_OFF,
        },
        tracks_state=False,
    )

    # context_type is always EmbeddingTrainPipelineContext here.
    contexts: Deque[EmbeddingTrainPipelineContext]  # type: ignore[assignment]

    @property
    def _emb_lookup_stream(self) -> Optional[torch.Stream]:
        """The stream the embedding lookup runs on (torchrec's attribute; None on CPU)."""
        return self._lookup_stream

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
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
        **options: Unpack[SparseDistTrainOptions],
    ) -> None:
        if emb_lookup_stream not in EMB_LOOKUP_STREAMS:
            raise ValueError(
                f"emb_lookup_stream must be one of {EMB_LOOKUP_STREAMS}, got "
                f"{emb_lookup_stream!r}: 'data_dist' reuses the input_dist stream, "
                "'new' creates a stream for the lookup, 'current' runs it on the "
                "default stream"
            )
        # Read by _make_streams, which the base constructor calls.
        self._emb_lookup_choice: str = emb_lookup_stream
        super().__init__(
            model,
            optimizer,
            device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            context_type=EmbeddingTrainPipelineContext,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            enqueue_batch_after_forward=enqueue_batch_after_forward,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            **options,
        )
        self._strict = strict
        self._embedding_lookup_after_data_dist = embedding_lookup_after_data_dist
        self._lookup_stream: Optional[torch.Stream]
        self._lookup_role: str  # the stream's name in recorded schedules
        if emb_lookup_stream == "data_dist":
            self._lookup_stream, self._lookup_role = self._streams.data_dist, "data_dist"
        elif emb_lookup_stream == "new":
            self._lookup_stream, self._lookup_role = self._streams.emb_lookup, "emb_lookup"
        else:
            self._lookup_stream, self._lookup_role = current_stream(self._device), "default"
        # Recorded on the default stream once the embeddings are up to date;
        # the next lookup waits on it (None: record one at the next lookup).
        self._weights_ready: Optional[torch.Event] = None

    # ------------------------------------------------------------------ setup

    def _make_streams(self) -> StreamSet:
        return make_streams(
            self._device,
            memcpy=True,
            data_dist=True,
            emb_lookup=self._emb_lookup_choice == "new",
        )

    def _make_forward(
        self, name: str, call_args: CallArgs, module: AnyShardedModule
    ) -> BaseForward[Any]:
        return InSyncEmbeddingPipelinedForward(
            name,
            call_args,
            module,
            cast(EmbeddingTrainPipelineContext, self._current_context()),
            self._lookup_stream,
        )

    def _lookup_modules(self) -> List[Tuple[str, AnyShardedModule]]:
        if self._pipelined.result is None:
            return []
        return [(p.name, p.module) for p in self._pipelined.result.pipelined]

    def _weights_ready_event(self) -> Optional[torch.Event]:
        if self._weights_ready is None:
            # No backward since the start (or since detach): the rows may have
            # been written by anything on the default stream, so wait for all of it.
            self._weights_ready = record_event(current_stream(self._device))
        return self._weights_ready

    # ------------------------------------------------------------------ verbs

    def start_embedding_lookup(
        self, batch: Optional[Any], context: EmbeddingTrainPipelineContext
    ) -> None:
        """Issue ``batch``'s embedding lookup on the lookup stream.

        ``batch``'s input_dist must have been waited (:meth:`wait_sparse_data_dist`).
        """
        if batch is None:
            return
        with self._recording.span(rec.EMB_LOOKUP, context.index, self._lookup_role):
            lookup.start_embedding_lookup(
                self._lookup_modules(),
                context,
                dist_stream=self._streams.data_dist,
                lookup_stream=self._lookup_stream,
                weights_ready=self._weights_ready_event(),
            )

    def wait_embedding_lookup(self) -> None:
        """Make the current stream wait for every lookup issued so far."""
        wait_stream(current_stream(self._device), self._lookup_stream)

    def _mark_weights_ready(self) -> None:
        # The fused TBE has updated the rows in the backward just issued on this
        # stream; the step that follows touches only dense parameters.
        self._weights_ready = record_event(current_stream(self._device))

    # --------------------------------------------------------------- schedule

    @guarded_step
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one step on the next batch of ``dataloader_iter``; return its output.

        What every ``progress()`` does: :class:`~trec_pipelines.PipelineOptions`.
        """
        # See [Note: a progress() timeline] in trec_pipelines.pipelines.
        # fmt: off
        self._start_step(dataloader_iter)  # fill, pull host batches, stop at end of data
        training = self._model.training

        if not self._embedding_lookup_after_data_dist:
            self.start_embedding_lookup(self.batches[0], self.contexts[0])  # cur, lookup (overlaps last step)
        if training:
            self._zero_grad()                                      # cur, default
        self._wait_for_batch()                                     # cur, data_dist -> default
        if self._clear_data_dist_inputs:
            self.clear_sparse_data_dist_inputs(self.contexts[0])
        if len(self.batches) >= 2:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])  # nxt, data_dist
        if not self._enqueue_batch_after_forward:
            self.enqueue_batch(dataloader_iter)                    # new, memcpy
        if self._embedding_lookup_after_data_dist:
            self.start_embedding_lookup(self.batches[0], self.contexts[0])  # cur, lookup
        losses, output = self._forward()                           # cur, default (waits for the lookup)
        if self._enqueue_batch_after_forward:
            self.enqueue_batch(dataloader_iter)                    # new, memcpy
        if len(self.batches) >= 2:
            self.wait_sparse_data_dist(self.contexts[1])           # nxt, data_dist
        if training:
            self._backward(losses)                                 # cur, default (updates embeddings)
            self.sync_embeddings(
                self._model, self._dmp_collection_sync_interval_batches, self.contexts[0]
            )
            self._mark_weights_ready()                             # default: the next lookup waits here
            self._optimizer_step()                                 # cur, default
        self.dequeue_batch()
        return output

    def _drop_in_flight_state(self) -> None:
        super()._drop_in_flight_state()
        # The failed step may have stopped anywhere: the next lookup waits for
        # all the work issued so far.
        self._weights_ready = None

    # ------------------------------------------------------- attach / detach

    def detach(self) -> torch.nn.Module:
        """As SparseDist's; the next lookup also waits for whatever the user ran meanwhile.

        A lookup may still be in flight (the eval variant's prefetch); the
        caller's stream waits for it, so nothing the caller runs on the model
        next (an update of the tables) overtakes it.
        """
        wait_stream(current_stream(self._device), self._lookup_stream)
        self._weights_ready = None
        return super().detach()
