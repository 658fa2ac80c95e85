"""TrainPipelinePEC: lookups ahead of the forward, PEC modules split by overlap with the next batch.

[Note: PEC, retrying a step]
A failed ``progress()`` is rolled back as in every train variant (see
[Note: retrying a failed step] in :mod:`trec_pipelines.core.step_guard`), with one
more thing to keep: the NOL gradient of the last trained batch ``i-1``, which
its step left to ``i``'s.  It is held by the pipeline, not by a batch's
context (:class:`~trec_pipelines.sparse.pec_ops.DeferredNolGrad`), so forgetting the
contexts does not lose it, and the rollback issues nothing.  Whatever of it the
failed step had not applied (not started, or started and not waited) is
applied first thing by the retry, after the step guard's ``begin()`` and
before the refill, so the refilled batch's lookups read up-to-date rows; each
all-to-all started once, each applier fired once.  ``detach()``, switching
iterators and ``reset()`` apply it too (batch ``i-1`` was trained).

The failed step's own PEC update is discarded: a PEC module applies its
gradient after the optimizer step (OL) or in the next step (NOL), so a step
that raised in its forward, backward or optimizer step has updated no PEC
table, and an OL gradient all-to-all started before the optimizer raised is
dropped unwaited.  (A failure after the optimizer step, while applying the
PEC gradient itself, leaves what it applied applied, as a plain loop that
retries keeps what a failed attempt did; a NOL gradient it had already
deferred is applied before the retry.)  Other modules' fused (in-backward)
updates stay done, as in every variant.

The retried batch ``i`` is refilled as the first of a pipeline: its overlap
dist has no predecessor, so all its ids are looked up as NOL, after ``i-1``'s
whole update.  They read the values the uninterrupted run reads (its NOL ids
are untouched by ``i-1``, its OL ids are read after ``i-1``'s update either
way), and ``i``'s backward partition against ``i+1`` is unchanged: training is
that of the run that never failed, bit for bit (tests/distributed/test_pec.py).
"""

from __future__ import annotations

from typing import Any, Callable, Deque, Iterator, List, Optional, Tuple

import torch
from torchrec.distributed.train_pipeline import In, Out
from typing_extensions import Unpack

from trec_pipelines._types import AnyShardedModule
from trec_pipelines.assembly.options import SparseDistTrainOptions, takes_options
from trec_pipelines.assembly.resume import ResumeHooks
from trec_pipelines.core.step_guard import guarded_step
from trec_pipelines.core.streams import current_stream, record_stream, wait_event
from trec_pipelines.core.subclass_hooks import ASYNC_SUBMIT_OFF, Refused
from trec_pipelines.model.args import CallArgs
from trec_pipelines.model.context import PECTrainPipelineContext
from trec_pipelines.observe import recorder as rec
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist
from trec_pipelines.sparse import lookup, pec_ops
from trec_pipelines.sparse.forwards import BaseForward, PECPipelinedForward


class _PECResume(ResumeHooks):
    pipeline: TrainPipelinePEC[Any, Any]

    def settle(self) -> None:
        """Apply the deferred NOL gradient before a checkpoint: it belongs to the
        model's state (batch ``i-1`` was trained), which the caller reads next.

        Take the pipeline's state before reading the model's (see the guide
        docs/guides/checkpoint.md).  The resumed pipeline refills from ``cur`` as
        a retried step does, which is exact (see [Note: PEC, retrying a step]).
        """
        self.pipeline._flush_deferred_nol_grad()


@takes_options(SparseDistTrainOptions)
class TrainPipelinePEC(TrainPipelineSparseDist[In, Out]):
    """Three batches in flight; every lookup of ``cur`` runs before its forward, part of it a step early.

    ==========  =======  ===========================================================
    stream      slot     work
    ==========  =======  ===========================================================
    default     ``cur``  wait, OL lookup (PEC), lookup (other modules), zero_grad,
                         forward, backward, OL gradient, step
    default     ``prv``  NOL gradient, deferred from the previous step
    default     ``nxt``  NOL lookup (PEC), after ``cur``'s forward
    data_dist   ``nxt``  overlap dist against ``cur`` (PEC mask all-to-alls)
    data_dist   ``new``  input_dist: splits all-to-all, then tensors all-to-all
    memcpy      ``new``  host-to-device copy
    ==========  =======  ===========================================================

    ``prv`` is the batch trained by the previous call, whose non-overlapping
    (NOL) gradient this step applies; ``cur``'s is handed to ``nxt``'s step (the
    last batch applies its own at once).  Each call's verbs, fill and drain
    included, are drawn in :doc:`/guides/variants` (in issue order: the timeline in
    ``progress()``'s source).

    PEC modules (``ShardedPECEmbeddingCollection``, torchrec >= 1.9) look up
    and update the ids a batch shares with its neighbours in its own step, and
    the others a step early (lookup) or late (update), which is meant to give
    the same values as the plain loop: see the note "PEC, compute ahead" in the source of
    ``trec_pipelines.sparse.pec_ops``.  (On CPU with torchrec 1.9.2 the PEC
    module's own gradient routing departs from the plain loop from the second
    step on, in torchrec's class as here; ours matches torchrec's bit for
    bit.)  Every other pipelined module is looked up on the default stream at
    the top of the step, as Fused does with ``emb_lookup_stream="current"``,
    after the previous step's update; its forward is an
    :class:`~trec_pipelines.sparse.forwards.PECPipelinedForward`, which hands the
    output over still attached to autograd.  With no PEC module the PEC verbs
    do nothing and are still recorded, so the schedule keeps its shape.  Before
    the model is used outside the pipeline's order (:meth:`detach`, another
    iterator mid-epoch, :meth:`reset`) the deferred NOL gradient is applied at
    once.  A ``progress()`` that raises is rolled back and the next one retries
    its batch, with the deferred NOL gradient of the batch before it applied
    exactly once and the failed attempt's own PEC update discarded (see
    the note "PEC, retrying a step" in the source of ``trec_pipelines.pipelines.pec``).

    Differences from torchrec: :ref:`the migration guide <migrating-pec>` (docs/guides/migrating.md).

    Example::

        pipeline = TrainPipelinePEC(dmp_model, optimizer, torch.device("cuda"))
        it = iter(dataloader)
        output = pipeline.progress(it)  # one batch a call, until StopIteration

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
    """

    # torchrec's class leaves _state IDLE.  torchrec keeps the deferred NOL
    # gradient on the next batch's context; ours keeps it on the pipeline, so it
    # survives a rolled-back step and a checkpoint.
    _traits = TrainPipelineSparseDist._traits.updated(
        hooks={
            "_submit_inplace_copy": ASYNC_SUBMIT_OFF,
        }
        | {
            hook: Refused(
                "its PEC state lives on torchrec's contexts; here the deferred gradient and the "
                "overlapped lookups are kept by the pipeline, to survive a failed step and a "
                "checkpoint",
                "progress(dataloader_iter), or the hooks every SparseDist pipeline honours",
            )
            for hook in (
                "_compute_and_output_dist",
                "_defer_nol_grad",
                "_pec_module_ctx",
                "_pec_nol_compute",
                "_pec_ol_compute",
                "_pec_overlap_dist",
                "_precache_length_per_key",
                "_record_stream_backward_ctx",
                "_record_stream_forward_ctx",
                "_start_deferred_nol_grad",
                "_start_pec_ol_grad",
                "_wait_pec_grad",
                "_wait_pec_overlap_results",
            )
        },
        tracks_state=False,
        resume=_PECResume,
    )

    contexts: Deque[PECTrainPipelineContext]  # type: ignore[assignment]

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        custom_model_fwd: Optional[Callable[[Optional[Any]], Tuple[torch.Tensor, Any]]] = None,
        **options: Unpack[SparseDistTrainOptions],
    ) -> None:
        super().__init__(
            model,
            optimizer,
            device,
            execute_all_batches=execute_all_batches,
            apply_jit=apply_jit,
            context_type=PECTrainPipelineContext,
            custom_model_fwd=custom_model_fwd,
            **options,
        )
        # The last trained batch's NOL gradient, applied in the next step: on the
        # pipeline, so a rolled-back step keeps it (see [Note: PEC, retrying a step]).
        self._deferred_nol_grad = pec_ops.DeferredNolGrad()

    # ------------------------------------------------------------------ setup

    def _make_forward(
        self, name: str, call_args: CallArgs, module: AnyShardedModule
    ) -> BaseForward[Any]:
        # Lookups run on the default stream: nothing to hand over.
        return PECPipelinedForward(name, call_args, module, self._current_context())  # type: ignore[arg-type]

    def _pipeline_model(
        self, batch: Any, context: Any, pipelined_forward: Optional[type] = None
    ) -> None:
        super()._pipeline_model(batch, context, pipelined_forward)
        pec_ops.check_pec_supported(self._pec_modules(), type(self).__name__)

    def _pec_modules(self) -> List[Tuple[str, Any]]:
        if self._pipelined.result is None:
            return []
        return [
            (p.name, p.module) for p in self._pipelined.result.pipelined if pec_ops.is_pec(p.module)
        ]

    def _other_modules(self) -> List[Tuple[str, AnyShardedModule]]:
        if self._pipelined.result is None:
            return []
        return [
            (p.name, p.module)
            for p in self._pipelined.result.pipelined
            if not pec_ops.is_pec(p.module)
        ]

    # ------------------------------------------------------------------ verbs

    def _wait_for_batch(self) -> None:
        """Order the default stream after ``cur``'s copy and overlap dist.

        The event was recorded on data_dist after ``cur``'s input_dist (which
        waited for its copy) and overlap dist, and before any later data_dist
        work, so the forward does not wait for ``new``'s all-to-alls.
        """
        context = self.contexts[0]
        with self._recording.span(rec.WAIT_BATCH, context.index):  # data_dist -> default (event)
            consumer = current_stream(self._device)
            wait_event(consumer, context.overlap_dist_event)
            if not self._enable_inplace_copy_batch:
                record_stream(self.batches[0], consumer)

    def _overlap_dist(
        self,
        current: Optional[PECTrainPipelineContext],
        previous: Optional[PECTrainPipelineContext],
    ) -> None:
        batch = current.index if current is not None else previous.index  # type: ignore[union-attr]
        with self._recording.span(rec.OVERLAP_DIST, batch, "data_dist"):
            pec_ops.overlap_dist(
                self._pec_modules(),
                current,
                previous,
                dist_stream=self._streams.data_dist,
                compute_stream=current_stream(self._device),
            )

    def _ol_lookup(self, context: PECTrainPipelineContext) -> None:
        with self._recording.span(rec.OL_LOOKUP, context.index):
            pec_ops.partition_lookup(self._pec_modules(), context, overlapped=True)

    def _nol_lookup(self, context: PECTrainPipelineContext) -> None:
        with self._recording.span(rec.NOL_LOOKUP, context.index):
            wait_event(current_stream(self._device), context.overlap_dist_event)
            pec_ops.partition_lookup(self._pec_modules(), context, overlapped=False)

    def _lookup(self, context: PECTrainPipelineContext) -> None:
        """The other modules' lookup, on the default stream after their tensors all-to-all."""
        with self._recording.span(rec.EMB_LOOKUP, context.index):
            lookup.start_embedding_lookup(
                self._other_modules(),
                context,
                dist_stream=self._streams.data_dist,
                lookup_stream=None,
                weights_ready=None,
            )

    def _start_nol_grad(self) -> None:
        """Start the deferred NOL gradient (the previous batch's, if any)."""
        deferred = self._deferred_nol_grad
        with self._recording.span(rec.NOL_GRAD_START, deferred.batch):
            pec_ops.start_nol_grad(self._pec_modules(), deferred)

    def _apply_nol_grad(self) -> None:
        deferred = self._deferred_nol_grad
        with self._recording.span(rec.NOL_GRAD_APPLY, deferred.batch):
            pec_ops.apply_grad(deferred.started)
        deferred.batch = None

    def _start_ol_grad(self, context: PECTrainPipelineContext) -> pec_ops.GradAwaitables:
        with self._recording.span(rec.OL_GRAD_START, context.index):
            return pec_ops.start_ol_grad(self._pec_modules(), context, current_stream(self._device))

    def _apply_ol_grad(
        self, started: pec_ops.GradAwaitables, context: PECTrainPipelineContext
    ) -> None:
        with self._recording.span(rec.OL_GRAD_APPLY, context.index):
            pec_ops.apply_grad(started)

    # --------------------------------------------------------------- schedule

    def fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        """Fill an empty pipeline: ``cur`` overlap-distributed with its NOL lookup done, ``nxt`` distributed.

        A non-empty pipeline is in steady state or draining and is left alone.
        Any NOL gradient still owed (a failed step's retry) is applied first, so
        the refilled batches' lookups read up-to-date rows.
        """
        if self.batches:
            return
        self._flush_deferred_nol_grad()
        if not self.enqueue_batch(dataloader_iter):
            return
        self._init_pipelined_modules(
            self.batches[0], self.contexts[0], self._pipelined_forward_type
        )
        self.wait_sparse_data_dist(self.contexts[0])
        self._overlap_dist(self.contexts[0], None)
        self._nol_lookup(self.contexts[0])
        if not self.enqueue_batch(dataloader_iter):
            return
        self.start_sparse_data_dist(self.batches[1], self.contexts[1])
        self.wait_sparse_data_dist(self.contexts[1])

    @guarded_step
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one step on the next batch of ``dataloader_iter``; return its output.

        What every ``progress()`` does: :class:`~trec_pipelines.PipelineOptions`.
        """
        # See [Note: a progress() timeline] in trec_pipelines.pipelines.
        # fmt: off
        self._start_step(dataloader_iter)  # fill, pull host batches, stop at end of data
        training = self._model.training
        cur = self.contexts[0]
        nxt = self.contexts[1] if len(self.contexts) >= 2 else None

        self._wait_for_batch()                                     # cur, data_dist -> default (event)
        self.enqueue_batch(dataloader_iter)                        # new, memcpy
        self._ol_lookup(cur)                                       # cur, default: fresh weights
        self._lookup(cur)                                          # cur, default: other modules
        self._overlap_dist(nxt, cur)                               # nxt vs cur, data_dist
        if len(self.batches) >= 3:
            self.start_sparse_data_dist(self.batches[2], self.contexts[2])  # new, data_dist
        self._start_nol_grad()                                     # prv, default: deferred to this step
        if training:
            self._zero_grad()                                      # cur, default
        losses, output = self._forward()                           # cur, default
        if len(self.batches) >= 3:
            self.wait_sparse_data_dist(self.contexts[2])           # new, data_dist
        self._apply_nol_grad()                                     # prv, default
        if nxt is not None:
            self._nol_lookup(nxt)                                  # nxt, default: a step early
        if training:
            self._backward(losses)                                 # cur, default
            ol_grad = self._start_ol_grad(cur)                     # cur, default
            self._optimizer_step()                                 # cur, default
            self._apply_ol_grad(ol_grad, cur)                      # cur, default
            self._keep_nol_grad(cur, nxt)                          # cur's NOL gradient, kept for nxt's step
        self.dequeue_batch()
        return output

    def _keep_nol_grad(
        self, cur: PECTrainPipelineContext, nxt: Optional[PECTrainPipelineContext]
    ) -> None:
        """Keep ``cur``'s NOL gradient for ``nxt``'s step; the last batch applies its own now."""
        # See [Note: a progress() timeline] in trec_pipelines.pipelines.
        # fmt: off
        pec_ops.defer_nol_grad(self._pec_modules(), cur, self._deferred_nol_grad)
        if nxt is None:
            self._start_nol_grad()                                 # cur, default: no batch reads it later
            self._apply_nol_grad()                                 # cur, default

    # ------------------------------------------------------- attach / detach

    def _flush_deferred_nol_grad(self) -> None:
        """Apply the deferred NOL gradient now, what of it is not applied yet.

        Deferring it is exact only while the next batch's step comes next;
        before the model is used otherwise (another iterator's batches, the
        caller after :meth:`detach` or :meth:`reset`, a retried step's refill)
        the tables must be up to date.  The next batch does not read those
        rows, so applying them early changes nothing else.
        """
        # See [Note: a progress() timeline] in trec_pipelines.pipelines.
        # fmt: off
        if not self._deferred_nol_grad.pending:
            return
        self._start_nol_grad()                                     # prv, default (the rest of it)
        self._apply_nol_grad()                                     # prv, default

    def _stop_if_done(self) -> None:
        """As SparseDist's; an epoch that ends with batches dropped untrained
        (``execute_all_batches=False``) first applies the NOL gradient of the
        last batch it did train, which no later step will carry."""
        try:
            super()._stop_if_done()
        except StopIteration:
            self._flush_deferred_nol_grad()
            raise

    def _switch_iterator(self, dataloader_iter: Iterator[Any]) -> None:
        if dataloader_iter is not self._source.iterator:
            self._flush_deferred_nol_grad()
        super()._switch_iterator(dataloader_iter)

    def detach(self) -> torch.nn.Module:
        """As SparseDist's, once the deferred NOL gradient is applied (the caller may read those rows)."""
        self._flush_deferred_nol_grad()
        return super().detach()

    def reset(self) -> None:
        """As SparseDist's, once the deferred NOL gradient is applied: its batch was
        trained, only the batches still in flight are dropped."""
        self._flush_deferred_nol_grad()
        super().reset()
