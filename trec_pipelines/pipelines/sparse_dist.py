"""TrainPipelineSparseDist: copy, input_dist and compute of three batches overlap."""

from __future__ import annotations

import logging
from collections import deque
from typing import (
    Any,
    Callable,
    Deque,
    Iterator,
    List,
    Optional,
    Tuple,
    Type,
)

import torch
from torch.utils.hooks import RemovableHandle
from torchrec.distributed.train_pipeline import In, Out, TrainPipeline
from torchrec.distributed.train_pipeline.types import PipelineState
from typing_extensions import Unpack

from trec_pipelines.assembly.options import SparseDistTrainOptions, takes_options
from trec_pipelines.assembly.pipeline import PipelineCore
from trec_pipelines.core.checks import check_apply_jit
from trec_pipelines.core.step_guard import guarded_step
from trec_pipelines.core.streams import (
    StreamSet,
    copy_to_device,
    make_streams,
    on_stream,
    wait_for_batch,
)
from trec_pipelines.core.subclass_hooks import (
    ASYNC_COPY,
    FORWARD_TYPE,
    VERSION_0,
)
from trec_pipelines.data import inplace_copy
from trec_pipelines.data.inplace_copy import BatchQueue, HoldsCopyWorker, InplaceCopyWorker
from trec_pipelines.data.padding import Padding
from trec_pipelines.data.validation import note_shared_features
from trec_pipelines.model.backward_hooks import pipeline_hook, register_backward_hook
from trec_pipelines.model.context import TrainPipelineContext
from trec_pipelines.model.rewrite import RewriteResult
from trec_pipelines.observe import recorder as rec
from trec_pipelines.pipelines.sparse_dist_rewrite import SparseDistRewrite
from trec_pipelines.sparse.forwards import PipelinedForward
from trec_pipelines.sparse.input_dist import (
    release_input_dist_inputs,
    start_input_dist,
    wait_input_dist,
)

logger: logging.Logger = logging.getLogger(__name__)


@takes_options(SparseDistTrainOptions)
class TrainPipelineSparseDist(SparseDistRewrite, HoldsCopyWorker, TrainPipeline[In, Out]):
    """Three batches in flight: ``cur`` trains, ``nxt`` is in input_dist, ``new`` is copied.

    ==========  =======  ==================================================
    stream      slot     work
    ==========  =======  ==================================================
    default     ``cur``  zero_grad, wait, forward (lookup inside), backward, step
    data_dist   ``nxt``  input_dist: splits all-to-all, then tensors all-to-all
    memcpy      ``new``  host-to-device copy
    ==========  =======  ==================================================

    While ``cur`` trains, the ids of ``nxt`` travel to the ranks that hold
    their embeddings and ``new`` travels to the device; each ``progress()``
    returns ``cur``'s output and moves every batch up one slot.  The model's
    forward returns ``(loss, output)``: the step backpropagates
    ``torch.sum(loss, dim=0)`` and ``progress()`` returns ``output`` (as
    torchrec), so put in ``output`` whatever the loop should see, the detached
    loss included (torchrec's ``DLRMTrain`` returns ``(loss, (loss.detach(),
    logits, labels))``).  Each pipelined
    ``ShardedModule.forward`` is replaced by a
    :class:`~trec_pipelines.sparse.forwards.PipelinedForward`, which finds its batch's
    ``input_dist`` already under way; a module that can't be pipelined keeps
    its forward, and :attr:`rewrite_result` says why.

    A ``progress()`` that raises is rolled back: the
    exception names the batch, and the next call retries it from the host
    copy the pipeline keeps, with nothing pulled twice, lost or trained twice
    (:meth:`skip_failed_batch` drops a batch that fails every time).  After
    ``StopIteration`` the next call starts a new epoch, without ``reset()``.
    Another iterator passed mid-epoch parks the previous one's batches,
    input_dist and all, until that iterator comes back; ``detach()`` and
    ``attach()`` keep the batches in flight, and ``progress()`` on a detached
    pipeline attaches it again.  Each step trains only if ``model.training``
    (in eval mode it runs the forward alone).  A pipeline that finds another
    pipeline's wrappers on its model (an eval pipeline left attached) detaches
    that one and takes the model over.  With ``pipeline_postproc=True``,
    parameter-free modules between the batch and a sharded module run ahead in
    the input_dist stage, once per batch (see :mod:`trec_pipelines.model.postproc`).
    A subclass that holds more batches in flight says how many with the class
    keyword ``depth`` (``class MyPipeline(TrainPipelineSparseDist, depth=4)``; see
    :doc:`the guide to writing a variant </guides/writing-a-variant>`).

    Differences from torchrec: :ref:`the migration guide <migrating-sparse-dist>` (docs/guides/migrating.md).

    Example::

        pipeline = TrainPipelineSparseDist(dmp_model, optimizer, device)
        it = iter(dataloader)
        output = pipeline.progress(it)  # one batch a call, until StopIteration

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
    """

    _traits = PipelineCore._traits.updated(
        hooks={
            "_fill_pipeline": VERSION_0,
            "_copy_batch_to_gpu": VERSION_0,
            "_start_sparse_data_dist": VERSION_0,
            "_wait_sparse_data_dist": VERSION_0,
            "_pipelined_forward_type": FORWARD_TYPE,
            "_setup_async_inplace_copy": ASYNC_COPY,
            "_submit_inplace_copy": ASYNC_COPY,
            "_shutdown_async_inplace_copy": ASYNC_COPY,
        },
        depth=3,  # batches in flight right after a step's copy: what a call may pull
        carries_agreement=True,  # each step's splits exchange carries the agreement
        tracks_state=True,  # IDLE, CALL_FWD and CALL_BWD, as torchrec's
    )
    # torchrec's attribute: the forward wrapper class of the pipelined modules
    # (read, not set: _make_forward builds each module's wrapper).
    _pipelined_forward_type: type = PipelinedForward
    # torchrec's 2D-sharding weight sync (a no-op without ``DMPCollection``), inherited
    # as it is: it reads only ``context.index``, which our contexts have too.
    sync_embeddings: Callable[  # type: ignore[assignment]  # any context with an index
        [torch.nn.Module, Optional[int], Optional[Any]], None
    ]

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
        enqueue_batch_after_forward: bool = False,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        async_inplace_copy: bool = False,
        **options: Unpack[SparseDistTrainOptions],
    ) -> None:
        super().__init__()
        # Lite starts a batch's input_dist in the step that trains it: nothing
        # queues behind it, so it stays on the model's group.
        self._init_core(
            model,
            optimizer,
            device,
            options,
            input_dist_group=None if self._traits.input_dist_ahead else "shared",
        )
        self._execute_all_batches = execute_all_batches
        self._apply_jit = apply_jit
        self._context_type = context_type
        self._pipeline_postproc = pipeline_postproc
        self._custom_model_fwd = custom_model_fwd
        self._model_fwd = custom_model_fwd or model
        self._enqueue_batch_after_forward = enqueue_batch_after_forward
        self._enable_inplace_copy_batch = enable_inplace_copy_batch
        self._free_features_storage_early = free_features_storage_early
        self._clear_data_dist_inputs = clear_data_dist_inputs
        check_apply_jit(apply_jit, type(self).__name__)

        self._streams: StreamSet = self._make_streams()
        self._copy_worker: Optional[InplaceCopyWorker] = inplace_copy.make_copy_worker(
            self, async_inplace_copy
        )
        # With a copy worker a slot may hold the Future of a copy it is issuing:
        # a BatchQueue waits for it where the slot is read.
        self.batches: Deque[Optional[Any]] = deque() if self._copy_worker is None else BatchQueue()
        self.contexts: Deque[TrainPipelineContext] = deque()
        self._warned_shared_features = False
        # Set-up a subclass runs once the model is first rewritten (the backward
        # hooks of the experimental variants), then never again: hooks stay on
        # the model's modules.
        self._after_first_rewrite: List[Callable[[], None]] = []
        self._batch_count = 0  # batches queued so far (torchrec's counter)
        self._init_2d_sharding(dmp_collection_sync_interval_batches)

    def _init_2d_sharding(self, dmp_collection_sync_interval_batches: Optional[int]) -> None:
        """torchrec's hook, honoured: the last step of the constructor, which keeps how
        often ``sync_embeddings`` syncs a ``DMPCollection``'s replicas."""
        self._dmp_collection_sync_interval_batches = dmp_collection_sync_interval_batches

    @property
    def _next_index(self) -> int:
        """The index the next batch pulled from the iterator takes (read-only)."""
        return self._source.loaded

    # ------------------------------------------------------------------ setup

    def _make_streams(self) -> StreamSet:
        return make_streams(self._device, memcpy=True, data_dist=True)

    @property
    def rewrite_result(self) -> Optional[RewriteResult]:
        """What the model rewrite pipelined and what it left alone (after the first batch)."""
        return self._pipelined.result

    def register_backward_hook(self, site: Any, work: Callable[[Any], None]) -> RemovableHandle:
        """Run ``work(self)`` each training step when the backward reaches ``site``.

        ``site`` is a :class:`~trec_pipelines.model.backward_hooks.InjectionSite` (or
        torchrec's): with ``OutputDistTensorFinder`` on a pipelined EBC/EC the
        work runs while that module's backward all-to-all is in flight (see
        :mod:`trec_pipelines.model.backward_hooks`).  Several works at one site run
        in registration order.  ``site.fqn`` is relative to the user's model.
        Returns a handle (torchrec returns None); ``handle.remove()`` stops it.

        Example::

            pipeline.register_backward_hook(
                InjectionSite("ebc", OutputDistTensorFinder(ShardingType.TABLE_WISE)),
                lambda p: log.append(p),
            )
        """
        return register_backward_hook(site, self._model, pipeline_hook(site, self, work))

    # ------------------------------------------------------------------ verbs

    def copy_batch_to_gpu(
        self, dataloader_iter: Iterator[Any]
    ) -> Tuple[Optional[Any], Optional[TrainPipelineContext]]:
        """Load the next batch and copy it to the device on the memcpy stream.

        Returns ``(None, None)`` once the iterator is exhausted.
        """
        return self._load_and_copy(dataloader_iter, inplace=False)

    def _load_and_copy(
        self, dataloader_iter: Iterator[Any], *, inplace: bool
    ) -> Tuple[Optional[Any], Optional[TrainPipelineContext]]:
        """The copy stage behind both of torchrec's copy methods (``enqueue_batch``
        calls the one ``enable_inplace_copy_batch`` picks, so an override of either
        is called as torchrec calls it): pull, make the context, copy.  ``inplace``
        allocates the device batch on the current stream, the copy itself on the
        memcpy stream."""
        host, padding = self._source.next(dataloader_iter), False
        if isinstance(host, Padding):  # an eval pipeline's: its batch runs, its output unused
            host, padding = host.batch, True
        if host is None:
            self._end_at_the_pull()
            return None, None
        context = self._create_context()
        context.padding = padding  # an eval pipeline's padding batch (trec_pipelines.data.padding)
        with self._recording.span(rec.H2D, context.index, "memcpy"):
            if self._copy_worker is not None:
                # async_inplace_copy's worker, or TrainPipelineSparseDistT's copy
                # thread (which copies in place as enable_inplace_copy_batch says).
                # Not checked for shared storage: the copy is still to be made.  The
                # worker copies a host batch into new device memory; a loader that
                # yields device tensors should not combine async_inplace_copy with
                # free_features_storage_early.
                return self._copy_worker.submit(host), context
            batch = copy_to_device(host, self._device, self._streams.memcpy, inplace=inplace)
        if self._free_features_storage_early:
            note_shared_features(self, host, batch, context)
        return batch, context

    def _end_at_the_pull(self) -> None:
        """The copy stage found no batch.  Where a user's ``_next_batch`` pulls here
        (see [Note: a user's _next_batch pulls at torchrec's moment]) and
        ``execute_all_batches`` is False, the epoch ends at this pull, as torchrec's
        copy stage ends it (``StopIteration``), the batches in flight untrained."""
        if self._traits.pulls_when_copied and not self._execute_all_batches:
            self._stop_if_done()

    def _create_context(self) -> TrainPipelineContext:
        """The context of the batch just pulled (torchrec's hook, honoured: one per
        batch copied; an override must return an instance of ``context_type``)."""
        return self._context_type(index=self._source.last_index)

    def inplace_copy_batch_to_gpu(
        self, dataloader_iter: Iterator[Any]
    ) -> Tuple[Optional[Any], Optional[TrainPipelineContext]]:
        """As :meth:`copy_batch_to_gpu`, allocating on the current stream.

        With ``async_inplace_copy`` the copy is submitted to the worker thread
        and the batch is a Future until its slot is read (see
        the note "async in-place copy" in the source of ``trec_pipelines.data.inplace_copy``).
        """
        return self._load_and_copy(dataloader_iter, inplace=True)

    def enqueue_batch(self, dataloader_iter: Iterator[Any]) -> bool:
        """Load, copy and queue one batch; False when the iterator is exhausted."""
        if self._enable_inplace_copy_batch:
            batch, context = self.inplace_copy_batch_to_gpu(dataloader_iter)
        else:
            batch, context = self.copy_batch_to_gpu(dataloader_iter)
        if batch is None or context is None:
            return False
        self.batches.append(batch)
        self.contexts.append(context)
        self._batch_count += 1
        return True

    def dequeue_batch(self) -> None:
        """Drop the trained batch and point the wrappers at the next one."""
        self.batches.popleft()
        self.contexts.popleft()
        if self.contexts:
            self._set_module_context(self.contexts[0])

    def start_sparse_data_dist(self, batch: Optional[Any], context: TrainPipelineContext) -> None:
        """Wait for ``batch``'s copy, then start its input_dist on the data_dist stream.

        Without a data_dist stream (Lite) both run on the current stream.
        """
        if batch is None:
            return
        with self._recording.span(
            rec.INPUT_DIST_START, context.index, self._traits.input_dist_role
        ):
            with on_stream(self._streams.data_dist):
                wait_for_batch(batch, self._streams.memcpy)
                start_input_dist(self._pipelined.result, batch, context, self._agreement)

    def wait_sparse_data_dist(self, context: TrainPipelineContext) -> None:
        """Finish the splits all-to-all, which launches the tensors all-to-all."""
        with self._recording.span(rec.INPUT_DIST_WAIT, context.index, self._traits.input_dist_role):
            with on_stream(self._streams.data_dist):
                wait_input_dist(context)

    def clear_sparse_data_dist_inputs(self, context: TrainPipelineContext) -> None:
        """Free the input storage of ``context``'s in-flight tensors all-to-alls."""
        with on_stream(self._streams.data_dist):
            release_input_dist_inputs(context)

    def _wait_for_batch(self) -> None:
        with self._recording.span(rec.WAIT_BATCH, self.contexts[0].index):  # data_dist -> default
            # An in-place copy allocated the batch on the default stream itself,
            # where a record_stream would do nothing.
            record = not self._enable_inplace_copy_batch
            wait_for_batch(self.batches[0], self._streams.data_dist, record)

    def _backward(self, losses: torch.Tensor) -> None:
        """The backward of the summed per-sample losses, through ``grad_scaler`` if any
        (torchrec's hook, honoured)."""
        with self._recording.span(rec.BACKWARD, self.contexts[0].index):
            self._precision.backward(torch.sum(losses, dim=0))

    def _optimizer_step(self) -> None:
        """The optimizer step, through ``grad_scaler`` if any (torchrec's hook, honoured)."""
        with self._recording.span(rec.OPTIMIZER_STEP, self.contexts[0].index):
            self._precision.step(self._optimizer)

    def _zero_grad(self) -> None:
        with self._recording.span(rec.ZERO_GRAD, self.contexts[0].index):
            self._optimizer.zero_grad()

    def _forward(self) -> Tuple[torch.Tensor, Any]:
        self._enter_phase(PipelineState.CALL_FWD)
        with self._recording.span(rec.FORWARD, self.contexts[0].index), self._precision.autocast():
            return self._call_forward(self.batches[0])

    # --------------------------------------------------------------- schedule

    def fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        """Load ``cur`` (copy + input_dist) and ``nxt`` (copy) when the queue is empty."""
        if len(self.batches) >= 2:
            return
        if self.batches and self._source.end.exhausted:
            return  # draining: the last batch trains alone
        if not self.batches:
            if not self.enqueue_batch(dataloader_iter):
                return
            self._init_pipelined_modules(
                self.batches[0], self.contexts[0], self._pipelined_forward_type
            )
            self.wait_sparse_data_dist(self.contexts[0])
        # One batch in flight and data left: only after an iterator error in the fill.
        self.enqueue_batch(dataloader_iter)

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
        self._wait_for_batch()                                     # cur, data_dist -> default
        if self._clear_data_dist_inputs:
            self.clear_sparse_data_dist_inputs(self.contexts[0])
        if len(self.batches) >= 2:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])  # nxt, data_dist
        if not self._enqueue_batch_after_forward:
            self.enqueue_batch(dataloader_iter)                    # new, memcpy
        losses, output = self._forward()                           # cur, default
        if self._enqueue_batch_after_forward:
            self.enqueue_batch(dataloader_iter)                    # new, memcpy (after lookup)
        if len(self.batches) >= 2:
            self.wait_sparse_data_dist(self.contexts[1])           # nxt, data_dist
        if training:
            self._enter_phase(PipelineState.CALL_BWD)
            self._backward(losses)                                 # cur, default
            self.sync_embeddings(
                self._model, self._dmp_collection_sync_interval_batches, self.contexts[0]
            )
            self._optimizer_step()                                 # cur, default
        self.dequeue_batch()
        return output

    def _start_step(self, dataloader_iter: Iterator[Any]) -> None:
        """What every step starts with: pull the host batches it will copy (so an
        iterator error surfaces before any work), fill an empty pipeline, end the
        epoch when nothing is left (``StopIteration``), and point the forward
        wrappers at ``cur``."""
        self._enter_phase(PipelineState.IDLE)
        super()._start_step(dataloader_iter)  # take-over, iterator switch, host batches
        self.fill_pipeline(dataloader_iter)
        self._stop_if_done()
        self._set_module_context(self.contexts[0])

    def _batches_to_fetch(self) -> int:
        return self._traits.depth - len(self.batches)

    def _in_flight(self) -> int:
        return len(self.batches)

    def _set_aside(self) -> Tuple[Deque[Optional[Any]], Deque[TrainPipelineContext]]:
        aside = (self.batches, self.contexts)
        self.batches, self.contexts = type(self.batches)(), deque()
        return aside

    def _bring_back(self, state: Tuple[Deque[Optional[Any]], Deque[TrainPipelineContext]]) -> None:
        self.batches, self.contexts = state

    def _take_over_model(self) -> None:
        """Detach any other pipeline whose forward wrappers are on this model.

        Two pipelines share a model (a train pipeline and an eval pipeline left
        attached when its data ended): the one about to run detaches the other,
        which gives back exactly what it replaced (this pipeline's wrappers, if
        it had rewritten the model first), and logs it.  A pipeline detached
        that way (not by the user) takes the model back the same way at its
        next ``progress()``, so train and eval pipelines can alternate on one
        model.  A wrapper whose pipeline was collected is undone from what it
        recorded it replaced.  A step's start calls it when a wrapper changed (or
        this pipeline was detached) since it last looked.
        """
        if self._taken_over_by is not None:
            self._taken_over_by = None
            self.attach()  # detaches the pipeline that took the model, then re-wraps
            return
        if self._pipelined.attached:
            super()._take_over_model()
            return
        # Detached by the user: attach again, as upstream's ``progress()`` does.
        logger.info("%s.progress() after detach(): attaching the model again", type(self).__name__)
        self.attach()

    def _stop_if_done(self) -> None:
        """End the epoch when nothing is in flight, or when the data ran out and
        ``execute_all_batches`` is False (dropping, and logging, what is in flight)."""
        if self.batches and not self._execute_all_batches and self._source.end.exhausted:
            logger.warning(
                "%s: data exhausted with execute_all_batches=False; dropping %d "
                "in-flight batch(es) untrained",
                type(self).__name__,
                len(self.batches),
            )
            self.batches.clear()
            self.contexts.clear()
            self._source.drop_in_flight()
        if not self.batches:
            self._source.end_epoch()
            raise StopIteration


# Held, not inherited: as torchrec 1.9.2's class, an instance of its mixin.
inplace_copy.AsyncInplaceCopyMixin.register(TrainPipelineSparseDist)
