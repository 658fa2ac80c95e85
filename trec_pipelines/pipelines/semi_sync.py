"""TrainPipelineSemiSync: the next batch's embedding lookup runs before this batch's backward."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, cast

import torch
from torchrec.distributed.train_pipeline import In, Out
from typing_extensions import Unpack

from trec_pipelines._types import AnyShardedModule
from trec_pipelines.assembly.options import SparseDistTrainOptions, takes_options
from trec_pipelines.core.all_reduce_wait import all_reduce_wait
from trec_pipelines.core.step_guard import guarded_step
from trec_pipelines.core.streams import (
    current_stream,
    on_stream,
    record_event,
    record_stream,
    wait_event,
    wait_for_batch,
)
from trec_pipelines.core.subclass_hooks import ASYNC_SUBMIT_OFF, never_called
from trec_pipelines.model.args import CallArgs
from trec_pipelines.model.context import EmbeddingTrainPipelineContext, TrainPipelineContext
from trec_pipelines.observe import recorder as rec
from trec_pipelines.pipelines.semi_sync_resume import SemiSyncResume
from trec_pipelines.pipelines.semi_sync_start import (
    TORCHREC_START_BATCH,
    report_shared_parameters,
    say_synchronous_start,
)
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist
from trec_pipelines.sparse.deferred_lookup import DeferralPlan, deferring, plan_deferral
from trec_pipelines.sparse.forwards import BaseForward, EmbeddingPipelinedForward
from trec_pipelines.sparse.input_dist import start_input_dist
from trec_pipelines.sparse.lookup import (
    start_embedding_lookup as run_embedding_lookup,
)

logger: logging.Logger = logging.getLogger(__name__)


@takes_options(SparseDistTrainOptions)
class TrainPipelineSemiSync(TrainPipelineSparseDist[In, Out]):
    """Four batches in flight; once semi-sync, ``nxt`` is looked up before ``cur``'s backward.

    ==========  ===========  ======================================================
    stream      slot         work
    ==========  ===========  ======================================================
    default     ``cur``      zero_grad, wait for the copy, forward on detached
                             embeddings, backward, embedding backward, step
    default     ``nxt``      embedding lookup: right after ``cur``'s forward once
                             semi-sync, after ``cur``'s step before that
    data_dist   ``slot(2)``  input_dist: splits all-to-all, then tensors all-to-all
    memcpy      ``slot(3)``  host-to-device copy
    ==========  ===========  ======================================================

    The recorder shows, per call: ``InputDistStart[i+2] ZeroGrad[i] WaitBatch[i]
    Forward[i] H2D[i+3] EmbLookup[i+1]`` (semi-sync) ``InputDistWait[i+2]
    Backward[i] EmbBackward[i] OptimizerStep EmbLookup[i+1]`` (synchronous).  The
    first call fills the pipeline (lookup of batch 0, input_dist of 1, copy of 2).
    Pipelined modules get an
    :class:`~trec_pipelines.sparse.forwards.EmbeddingPipelinedForward`: the forward
    reads its batch's lookup as detached leaves, so the dense backward stops there and
    :meth:`embedding_backward` sends the leaves' gradients into the tables, whose fused
    optimizer updates them.  Under ``DistributedDataParallel`` the embedding backward
    runs while DDP's all-reduce is in flight: DDP's gradients, bit for bit.

    Batches before ``start_batch`` (default 900, torchrec's; counted from
    construction or ``reset()``, across epochs) train synchronously, as
    ``TrainPipelineSparseDist`` does, bit for bit.  From then on ``nxt`` is looked up
    before ``cur``'s update (batch ``i`` reads rows updated through ``i-2``) and the
    all-to-all of its embeddings overlaps ``cur``'s backward.  Every loaded batch is
    trained whatever ``execute_all_batches`` says.  The optimizer should hold the
    dense parameters (and dense-kernel tables) only; a pipelined module's fused table
    in it is reported when an epoch starts (an error with ``strict``).  Tables with the
    ``dense`` kernel (every ``data_parallel`` table) train synchronously, like the
    dense parameters; a sharding type mixing them with fused tables raises
    ``ValueError`` at the first batch (``[Note: semi-sync and tables the dense
    optimizer updates]`` in ``trec_pipelines/sparse/deferred_lookup.py``).

    Differences from torchrec: :ref:`the migration guide <migrating-semi-sync>` (docs/guides/migrating.md).

    Example::

        pipeline = TrainPipelineSemiSync(dmp_model, dense_optimizer, device, start_batch=0)
        it = iter(dataloader)
        output = pipeline.progress(it)  # one batch a call, until StopIteration

    Args:
        start_batch: How many batches train synchronously, counted from construction or
            ``reset()``, before the semi-synchronous schedule starts (0: from the first).
        stash_gradients: Once semi-synchronous, each step applies the previous batch's
            dense gradients instead of its own (none at ``start_batch``: that step is
            skipped, and ``OptimizerStep`` records the batch ``i-1`` it applies).

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
    """

    # torchrec's class leaves _state IDLE; its SemiSync runs its dense backward and
    # step itself.
    _traits = TrainPipelineSparseDist._traits.updated(
        hooks={
            "_backward": never_called(
                "TrainPipelineSemiSync", "nothing: pass grad_scaler= for a scaled backward"
            ),
            "_optimizer_step": never_called(
                "TrainPipelineSemiSync", "_mlp_optimizer_step(current_batch)"
            ),
            "_wait_for_batch": never_called(
                "TrainPipelineSemiSync", "_mlp_forward(batch, context)"
            ),
            "_submit_inplace_copy": ASYNC_SUBMIT_OFF,
        },
        tracks_state=False,
        depth=4,
        resume=SemiSyncResume,
    )

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        start_batch: int = TORCHREC_START_BATCH,
        stash_gradients: bool = False,
        pipeline_postproc: bool = True,
        custom_model_fwd: Optional[Callable[[Optional[Any]], Tuple[torch.Tensor, Any]]] = None,
        strict: bool = False,
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
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            context_type=EmbeddingTrainPipelineContext,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            dmp_collection_sync_interval_batches=dmp_collection_sync_interval_batches,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            **options,
        )
        self._start_batch = start_batch
        self._stash_gradients = stash_gradients
        self._strict = strict
        # Parameter name -> the gradient of the last batch, applied at the next step.
        self._gradients: Dict[str, torch.Tensor] = {}
        self._stash_before: Tuple[int, Dict[str, torch.Tensor]] = (-1, {})
        self._warned_unused_features = False
        # A resumed batch's looked-up values, from the checkpoint (load_state_dict).
        self._restored_lookup: Optional[Tuple[int, Dict[str, List[torch.Tensor]]]] = None
        # The sharding groups looked up in their batch's forward (set at the first batch).
        self._deferral: Optional[DeferralPlan] = None
        # The synchronous start was reported (once per pipeline, again after reset()).
        self._said_synchronous_start = False
        # DDP's all-reduce, waited after the embedding backward, not in the dense one.
        self._all_reduce = all_reduce_wait(self._model, type(self), "embedding_backward")
        logger.debug("%s: semi-sync from batch %d", type(self).__name__, start_batch)

    # ------------------------------------------------------------------ setup

    def _make_forward(
        self, name: str, call_args: CallArgs, module: AnyShardedModule
    ) -> BaseForward[Any]:
        return EmbeddingPipelinedForward(
            name,
            call_args,
            module,
            cast(EmbeddingTrainPipelineContext, self._current_context()),
            self._streams.data_dist,
        )

    def _lookup_modules(self) -> List[Tuple[str, AnyShardedModule]]:
        assert self._pipelined.result is not None
        return [(p.name, p.module) for p in self._pipelined.result.pipelined]

    def _plan_deferral(self) -> None:
        """Find the tables looked up in their batch's forward; refuse a group mixing kernels.

        See ``[Note: semi-sync and tables the dense optimizer updates]``
        (``trec_pipelines/sparse/deferred_lookup.py``).
        """
        if self._deferral is not None:
            return
        self._deferral = plan_deferral(self._lookup_modules(), type(self).__name__)
        if self._deferral.deferred:
            logger.info("%s: tables %s", type(self).__name__, self._deferral.describe())

    def _validate_optimizer(self) -> None:
        """Report pipelined modules whose parameters the optimizer also holds (see
        :func:`~trec_pipelines.pipelines.semi_sync_start.report_shared_parameters`)."""
        rewrite, name = self._pipelined.result, type(self).__name__
        pipelined = rewrite.pipelined if rewrite is not None else []
        report_shared_parameters(name, self._optimizer, pipelined, self._deferral, self._strict)

    def _say_synchronous_start(self) -> None:
        """One INFO line when ``start_batch`` keeps the first batch synchronous
        (once per pipeline, again after ``reset()``); see :func:`say_synchronous_start`."""
        if self._said_synchronous_start or not self.contexts:
            return
        self._said_synchronous_start = True
        say_synchronous_start(type(self).__name__, self.contexts[0].index, self._start_batch)

    def is_semi_sync(self) -> bool:
        """True when the next batch to train is at or past ``start_batch``."""
        if not self.contexts:
            return False
        index = self.contexts[0].index
        return index is not None and index >= self._start_batch

    def extract_model_input_from_batch(self, batch: Any) -> Any:
        """What input_dist reads from ``batch``; override when they differ.

        As upstream, the model rewrite still sees the whole batch, so with an
        override use FX tracing (``rewrite_strategy="fx"``), which binds the
        modules' arguments to what the model's forward receives.
        """
        return batch

    # ------------------------------------------------------------------ verbs

    def enqueue_batch(self, dataloader_iter: Iterator[Any]) -> bool:
        """Load, copy and queue one batch, with an event marking the end of its copy."""
        if not super().enqueue_batch(dataloader_iter):
            return False
        # The forward waits for this batch's copy only, not for later copies.
        copied = record_event(self._streams.memcpy)
        if copied is not None:
            self.contexts[-1].events.append(copied)
        return True

    def start_sparse_data_dist(self, batch: Optional[Any], context: TrainPipelineContext) -> None:
        """Wait for ``batch``'s copy, then start the input_dist of its model input."""
        if batch is None:
            return
        with self._recording.span(rec.INPUT_DIST_START, context.index, "data_dist"):
            with on_stream(self._streams.data_dist):
                wait_for_batch(batch, self._streams.memcpy)
                model_input = self.extract_model_input_from_batch(batch)
                start_input_dist(self._pipelined.result, model_input, context, self._agreement)

    def start_embedding_lookup(
        self, batch: Optional[Any], context: EmbeddingTrainPipelineContext
    ) -> None:
        """Finish ``batch``'s input_dist and run its lookup on the current stream."""
        if batch is None:
            return
        self._plan_deferral()  # done at the first batch; here for subclasses' own fills
        assert self._deferral is not None
        with self._recording.span(rec.EMB_LOOKUP, context.index), deferring(self._deferral):
            # data_dist -> default; dense-kernel groups wait for the forward
            run_embedding_lookup(
                self._lookup_modules(),
                context,
                dist_stream=self._streams.data_dist,
                # The current stream, which also runs the backward and fused
                # update this lookup must (or, semi-sync, must not) see: issue
                # order is the ordering, so no weights event is needed.
                lookup_stream=current_stream(self._device),
                weights_ready=None,
            )
        if self._restored_lookup is not None and self._restored_lookup[0] == context.index:
            context.restored_embeddings = self._restored_lookup[1]
            self._restored_lookup = None

    def _mlp_forward(self, batch: Any, context: TrainPipelineContext) -> Tuple[torch.Tensor, Any]:
        """``batch``'s forward once its copy is done (torchrec's hook, honoured)."""
        with self._recording.span(rec.WAIT_BATCH, context.index):  # memcpy -> default, by event
            consumer = current_stream(self._device)
            for event in context.events:
                wait_event(consumer, event)
            context.events.clear()
            if not self._enable_inplace_copy_batch:
                # Allocated on the memcpy stream; an inplace copy allocates here.
                record_stream(batch, consumer)
        with self._recording.span(rec.FORWARD, context.index), self._precision.autocast():
            return self._call_forward(batch)

    def _dense_backward(self, losses: torch.Tensor, context: TrainPipelineContext) -> None:
        with self._recording.span(rec.BACKWARD, context.index):
            self._precision.backward(torch.sum(losses, dim=0))

    def embedding_backward(self, context: EmbeddingTrainPipelineContext) -> None:
        """Send the gradients the dense backward left on the detached embeddings into them.

        Each pipelined module's outputs go back in one ``torch.autograd.backward``
        call; the fused optimizer updates the tables during it.  Outputs the loss
        did not use have no gradient and are left out (logged once).
        """

        with self._recording.span(rec.EMB_BACKWARD, context.index):
            assert len(context.embedding_tensors) == len(context.embedding_features)
            for tensors, features, leaves in zip(
                context.embedding_tensors,
                context.embedding_features,
                context.detached_embedding_tensors,
                strict=True,
            ):
                outputs: List[torch.Tensor] = []
                grads: List[torch.Tensor] = []
                unused: List[str] = []
                for feature, tensor, leaf in zip(features, tensors, leaves, strict=True):
                    if leaf.grad is None:
                        unused.extend([feature] if isinstance(feature, str) else feature)
                        continue
                    outputs.append(tensor)
                    grads.append(leaf.grad)
                if unused and not self._warned_unused_features:
                    self._warned_unused_features = True
                    logger.warning(
                        "%s: no gradient reaches the embeddings of features %s "
                        "(the loss does not use them); they are not updated",
                        type(self).__name__,
                        unused,
                    )
                if outputs:
                    torch.autograd.backward(outputs, grads)

    def _grad_swap(self) -> None:
        """Give every parameter the previous batch's gradient and stash this batch's."""
        # The stash as it was before this step, should the step fail after this.
        self._stash_before = (self._step_guard.steps, dict(self._gradients))
        for name, param in self._model.named_parameters():
            previous = self._gradients.pop(name, None)
            if param.grad is not None:
                # A copy: the live gradient may be a view into a DDP bucket
                # that the next backward overwrites.
                self._gradients[name] = param.grad.clone()
            param.grad = previous

    def _mlp_optimizer_step(self, current_batch: int) -> None:
        """The dense optimizer step of batch ``current_batch`` (torchrec's hook,
        honoured): with ``stash_gradients`` once semi-sync, of the gradients the
        previous batch stashed (none at ``start_batch``: no step), through
        ``grad_scaler`` if any."""
        stashed = self._stash_gradients and current_batch >= self._start_batch
        if stashed and current_batch == self._start_batch:
            # Nothing was stashed yet, and not every optimizer steps on None gradients.
            return
        with self._recording.span(
            rec.OPTIMIZER_STEP, current_batch - 1 if stashed else current_batch
        ):
            self._precision.step(self._optimizer)

    def _dense_zero_grad(self, context: TrainPipelineContext) -> None:
        with self._recording.span(rec.ZERO_GRAD, context.index):
            self._optimizer.zero_grad()

    # --------------------------------------------------------------- schedule

    def fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        """From empty: ``cur`` through its lookup, ``nxt`` through input_dist, a third copied."""
        if self.batches:
            return  # full, or draining: what is in flight trains first
        if not self.enqueue_batch(dataloader_iter):
            return
        self._init_pipelined_modules(
            self.batches[0], self.contexts[0], self._pipelined_forward_type
        )
        self.wait_sparse_data_dist(self.contexts[0])
        self._plan_deferral()
        self._validate_optimizer()
        self._say_synchronous_start()
        self.start_embedding_lookup(self.batches[0], self._embedding_context(0))
        if not self.enqueue_batch(dataloader_iter):
            return
        self.start_sparse_data_dist(self.batches[1], self.contexts[1])
        self.wait_sparse_data_dist(self.contexts[1])
        self.enqueue_batch(dataloader_iter)

    def _stop_if_done(self) -> None:
        # Every loaded batch is trained whatever execute_all_batches says, as
        # upstream's SemiSync does (its copy never stops mid-pipeline).
        if not self.batches:
            self._source.end_epoch()
            raise StopIteration

    @guarded_step
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one step on the next batch of ``dataloader_iter``; return its output.

        What every ``progress()`` does: :class:`~trec_pipelines.PipelineOptions`.
        """
        # See [Note: a progress() timeline] in trec_pipelines.pipelines.
        # fmt: off
        self._start_step(dataloader_iter)  # fill, pull host batches, stop at end of data
        semi_sync = self.is_semi_sync()

        if self._clear_data_dist_inputs and len(self.contexts) >= 2:
            self.clear_sparse_data_dist_inputs(self.contexts[1])   # nxt, data_dist (in flight)
        if len(self.batches) >= 3:
            self.start_sparse_data_dist(self.batches[2], self.contexts[2])  # slot(2), data_dist
        batch, context = self.batches[0], self._embedding_context(0)
        if self._model.training:
            # At the top, not after the step as upstream: a gradient-accumulating
            # optimizer wrapper (zero_grad only at accumulation boundaries) then
            # keeps the first micro-batch's gradient, and a retried step starts clean.
            self._dense_zero_grad(context)                         # cur, default
        losses, output = self._mlp_forward(batch, context)         # cur, memcpy -> default
        self.dequeue_batch()  # nxt is now at the front, and the wrappers serve it
        del batch  # cur's input is only held by the autograd graph from here on
        self.enqueue_batch(dataloader_iter)                        # slot(3), memcpy
        if semi_sync and self.batches:
            # nxt, data_dist -> default: issued before cur's update, so it misses it
            self.start_embedding_lookup(self.batches[0], self._embedding_context(0))
        if len(self.batches) >= 2:
            self.wait_sparse_data_dist(self.contexts[1])           # slot(2), data_dist
        if self._model.training:
            with self._all_reduce.deferring():
                self._dense_backward(losses, context)              # cur, default; all-reduce issued
            self.embedding_backward(context)                       # cur, default (fused update)
            self._all_reduce.wait()                                # cur's dense gradients averaged
            self.sync_embeddings(
                self._model, self._dmp_collection_sync_interval_batches, context
            )
            index = context.index
            del context  # cur's lookup outputs are not needed by the dense step
            if semi_sync and self._stash_gradients:
                self._grad_swap()                                  # cur <-> i-1, default
            self._mlp_optimizer_step(cast(int, index))             # cur (i-1 stashed), default
        if not semi_sync and self.batches:
            # nxt, data_dist -> default: issued after cur's update, so it sees it
            self.start_embedding_lookup(self.batches[0], self._embedding_context(0))
        return output

    def _drop_in_flight_state(self) -> None:
        super()._drop_in_flight_state()
        steps, stash = self._stash_before
        if steps == self._step_guard.steps:
            # The failed step swapped gradients: its retry must find the previous batch's.
            self._gradients = stash

    def _embedding_context(self, slot: int) -> EmbeddingTrainPipelineContext:
        return cast(EmbeddingTrainPipelineContext, self.contexts[slot])

    # ------------------------------------------------------------------ reset

    def reset(self) -> None:
        """Drop the in-flight batches and restart the batch count (synchronous again)."""
        super().reset()
        self._source = self._new_source()
        self._gradients.clear()
        self._restored_lookup = None
        self._said_synchronous_start = False  # the count restarts: synchronous again
