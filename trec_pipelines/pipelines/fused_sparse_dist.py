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
