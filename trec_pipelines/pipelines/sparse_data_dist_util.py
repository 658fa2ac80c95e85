"""SparseDataDistUtil: the sparse input_dist (and prefetch or lookup) as pipeline stages.

[Note: a failed forward in the caller's loop]
The forward hook moves the contexts on only when a forward finishes.  The
model's forward, wrapped while the util is attached (not hooked: see
:mod:`trec_pipelines.core.forward_watch`), counts the forward calls first
(``_before_forward``); a sharded module called in a
later call than the one that used its pipelined input up (the caller
retries a batch whose forward raised after the lookup), or in any call
after the batch's forward finished and before the next ``progress()``
(the caller retries after its backward or optimizer step raised), runs
its ``input_dist`` again on the arguments it is given and the hook leaves
the contexts alone.  The input_dist stage counts the forwards between two
``progress()`` calls: if the batch handed out last never finished its
forward (the caller skipped it), it does the hook's work first.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Deque, List, Optional, Set, cast

import torch
from torch.utils.hooks import RemovableHandle
from torchrec.distributed.train_pipeline import In
from typing_extensions import Unpack

from trec_pipelines._types import AnyShardedModule
from trec_pipelines.assembly.options import ModelOptions, resolve_options, takes_options
from trec_pipelines.assembly.pipelined_model import PipelinedModel
from trec_pipelines.core import forward_watch
from trec_pipelines.core.checks import check_apply_jit
from trec_pipelines.core.streams import (
    current_stream,
    on_stream,
    record_event,
    wait_event,
    wait_stream,
)
from trec_pipelines.data.agreement import AgreementChannel
from trec_pipelines.model.args import CallArgs
from trec_pipelines.model.context import (
    EmbeddingTrainPipelineContext,
    PrefetchTrainPipelineContext,
    TrainPipelineContext,
)
from trec_pipelines.model.postproc import PipelinedPostproc
from trec_pipelines.model.rewrite import RewriteResult
from trec_pipelines.pipelines.sparse_data_dist_stages import SparseDataDistStages
from trec_pipelines.pipelines.stages import side_stream
from trec_pipelines.sparse.forwards import (
    BaseForward,
    InSyncEmbeddingPipelinedForward,
    PipelinedForward,
    PrefetchPipelinedForward,
)
from trec_pipelines.sparse.input_dist import SplitsFusion, start_input_dist, wait_input_dist

logger: logging.Logger = logging.getLogger(__name__)


@takes_options(ModelOptions)
class SparseDataDistUtil(SparseDataDistStages[In]):
    """Pipelines a model's sparse ``input_dist`` through :class:`StagedTrainPipeline` stages.

    The caller trains in its own loop; this class rewrites the model so each
    pipelined ``ShardedModule`` finds its input already distributed, and hooks
    the end of the model's forward to move on to the next batch.

    ===================  ==============================  ===========================
    stage / hook         stream                          batch (``i`` = being trained)
    ===================  ==============================  ===========================
    input_dist start     ``data_dist_stream``            ``i+1`` (``i+2`` with a third stage)
    prefetch / lookup    ``prefetch_stream`` / lookup    ``i+1``
    forward hook: wait   ``data_dist_stream``            the batch whose input_dist started last
    ===================  ==============================  ===========================

    Each in-flight batch has a context; the contexts advance in lock step with
    the stages: ``contexts[0]`` is the batch the model's forward reads,
    ``contexts[-1]`` the batch whose input_dist starts next and, with prefetch
    or embedding lookup, ``contexts[1]`` the batch that stage works on.  They
    advance at the end of every forward (the hook) and, while the pipeline
    fills, in :meth:`wait_sdd_fill_callback`.

    Every stream may be ``None`` (on CPU): a :class:`StagedTrainPipeline` given a
    stage that runs :meth:`prefetch` or :meth:`start_embedding_lookup` turns that
    mode on (see :meth:`stage_declared`), and the work runs on the current stream.
    The stages are ordered against the caller's forward and backward on the compute
    stream: a prefetch waits for the end of the last forward, the backward for the
    next batch's lookup, and an input dist for the prefetches before it.  A batch
    whose forward raised can be trained again (bit for bit; with a lookup stage it
    is looked up again with the current weights) or skipped by calling
    ``progress()`` again (the note "a failed forward in the caller's loop" in the
    source of ``trec_pipelines.pipelines.sparse_data_dist_util``).  It takes our
    options ``rewrite_strategy``, ``on_unpipelined`` and ``input_dist_group``.

    Differences from torchrec: :ref:`the migration guide <migrating-sdd-util>` (docs/guides/migrating.md).

    Example::

        sdd = SparseDataDistUtil(model, data_dist_stream=torch.cuda.Stream())
        pipeline = StagedTrainPipeline([
            PipelineStage("h2d", lambda b: b.to(device, non_blocking=True), torch.cuda.Stream()),
            sdd.start_sparse_data_dist_stage(),
        ])
        while (batch := pipeline.progress(it)) is not None:
            optimizer.zero_grad()
            loss, pred = model(batch)
            torch.sum(loss, dim=0).backward()
            optimizer.step()

    Args:
        data_dist_stream: The stream input_dist runs on; ``None``: the current stream.
        prefetch_stream: Adds the cache prefetch (:meth:`prefetch`, a stage after
            input_dist) on this stream; ``None``: no prefetch.
        embedding_lookup_stream: Runs the embedding lookup as a stage of its own
            (:meth:`start_embedding_lookup`) on this stream, one batch ahead of the
            forward, so that batch is looked up before the optimizer step of the batch
            before it (semi-synchronous); ``None``: the lookup stays in the forward.

    torchrec's ``model`` and our keyword-only options: :class:`~trec_pipelines.PipelineOptions`.
    """

    # Debugging aid: check the contexts' contents whenever one is used.
    _WITH_CONTEXT_ASSERTIONS: bool = False

    def __init__(
        self,
        model: torch.nn.Module,
        data_dist_stream: Optional[torch.Stream],
        apply_jit: bool = False,
        prefetch_stream: Optional[torch.Stream] = None,
        pipeline_postproc: bool = False,
        embedding_lookup_stream: Optional[torch.Stream] = None,
        **options: Unpack[ModelOptions],
    ) -> None:
        if prefetch_stream is not None and embedding_lookup_stream is not None:
            raise ValueError(
                "SparseDataDistUtil: pass prefetch_stream or embedding_lookup_stream, "
                "not both; the lookup stage already reads the rows prefetch would load"
            )
        self._options = resolve_options(type(self).__name__, type(self), options)
        check_apply_jit(apply_jit, type(self).__name__)
        self.model = model
        self.data_dist_stream = data_dist_stream
        self.apply_jit = apply_jit
        self.prefetch_stream = prefetch_stream
        self.embedding_lookup_stream = embedding_lookup_stream
        # The third stage, if any: set by a stream here, or (streams left None,
        # as on CPU) when a StagedTrainPipeline is given the stage's verb.
        self._third_stage: Optional[str] = (
            "prefetch"
            if prefetch_stream is not None
            else "start_embedding_lookup"
            if embedding_lookup_stream is not None
            else None
        )
        self.initialized = False
        self.fwd_hook: Optional[RemovableHandle] = None
        self._watch: Optional[forward_watch.WatchedForward] = None
        self._pipeline_postproc = pipeline_postproc

        given = [
            s for s in (data_dist_stream, prefetch_stream, embedding_lookup_stream) if s is not None
        ]
        self._device = given[0].device if given else torch.device("cpu")
        self._dist_stream = side_stream(data_dist_stream)
        self._prefetch_stream = side_stream(prefetch_stream)
        self._lookup_stream = side_stream(embedding_lookup_stream)
        # The caller's forward and backward run here (see the class docstring).
        self._compute_stream = current_stream(self._device)
        # Recorded on the compute stream by the forward hook; the next prefetch waits for it.
        self._forward_done: Optional[torch.Event] = None

        self._contexts: Deque[TrainPipelineContext] = deque()
        self._next_index = 0
        # The context the last advance dropped (a skip in the fill takes it back),
        # and the indices of contexts no batch will be trained from: a batch
        # the pipeline skipped, or no batch at all (see batch_skipped).
        self._last_dropped: Optional[TrainPipelineContext] = None
        self._holes: Set[int] = set()
        # The rewrite, its claimed wrappers and the take-over (see
        # [Note: who owns a pipelined model]).
        self._pipelined = PipelinedModel(self, model, self._options["input_dist_group"])
        # Set when a pipeline detached this one to take the model over; the next
        # start_sparse_data_dist takes it back.
        self._taken_over_by: Optional[str] = None
        # Set when a stage first found no batch; only relaxes the context checks.
        self._exhausting_mode = False
        # Between two input_dist-stage calls (one progress() each, see
        # [Note: a failed forward in the caller's loop]): did a forward of the
        # model finish, and did the contexts move on (a forward or the fill)?
        self._trained_since_tick = False
        self._advanced_since_tick = False
        # The index of the last batch whose input_dist started.
        self._last_started = -1
        # The ranks' agreement its splits exchanges carry (set by the Staged pipeline).
        self._agreement: Optional[AgreementChannel] = None

    @property
    def _with_prefetch(self) -> bool:
        return self._third_stage == "prefetch"

    @property
    def _with_embedding_lookup(self) -> bool:
        return self._third_stage == "start_embedding_lookup"

    @property
    def trained_model(self) -> Optional[torch.nn.Module]:
        """The model this util pipelines (the agreement's ranks are its groups')."""
        return self.model

    def carry_agreement(self, channel: AgreementChannel) -> None:
        """Called by :class:`StagedTrainPipeline` before any batch: the splits
        exchange of each ``start_sparse_data_dist`` carries ``channel``'s codes
        (see the note "agreeing on each batch" in the source of ``trec_pipelines.data.agreement``)."""
        self._agreement = channel

    def stage_declared(self, verb: str) -> None:
        """Called by :class:`StagedTrainPipeline` for every stage that runs one of
        this object's verbs, before any batch: a ``prefetch`` or
        ``start_embedding_lookup`` stage turns that mode on even when its stream
        is ``None`` (as on CPU), since the number of batches in flight depends on it.
        """
        if verb not in ("prefetch", "start_embedding_lookup") or self._third_stage == verb:
            return
        if self._third_stage is not None:
            raise ValueError(
                f"SparseDataDistUtil: a {verb!r} stage was declared but this object "
                f"runs a {self._third_stage!r} stage; use one of the two"
            )
        if self._contexts:
            raise RuntimeError(
                f"SparseDataDistUtil: a {verb!r} stage was declared after batches "
                "started their input_dist; build the StagedTrainPipeline with all "
                "its stages before the first progress()"
            )
        self._third_stage = verb

    @property
    def _num_contexts(self) -> int:
        return 3 if self._with_prefetch or self._with_embedding_lookup else 2

    @property
    def _rewrite(self) -> Optional[RewriteResult]:
        return self._pipelined.result

    @property
    def _fusion(self) -> SplitsFusion:
        return self._pipelined.fusion

    @property
    def rewrite_result(self) -> Optional[RewriteResult]:
        """What the model rewrite pipelined and what it left alone (after the first batch)."""
        return self._rewrite

    # --------------------------------------------------------------- contexts

    def _new_context(self, index: int) -> TrainPipelineContext:
        if self._with_prefetch:
            return PrefetchTrainPipelineContext(index=index)
        if self._with_embedding_lookup:
            return EmbeddingTrainPipelineContext(index=index)
        return TrainPipelineContext(index=index)

    def _add_context(self) -> None:
        self._contexts.append(self._new_context(self._next_index))
        self._next_index += 1

    def _advance_context(self) -> None:
        """The forward's batch is done: every batch moves one context down."""
        self._advanced_since_tick = True
        self._last_dropped = self._contexts.popleft()
        self._holes.discard(self._index_of(self._last_dropped))
        self._add_context()
        self._set_module_context(self._forward_context())

    def _set_module_context(self, context: TrainPipelineContext) -> None:
        for module in self._modules():
            cast(BaseForward[Any], module.forward).set_context(context)
        for postproc in self._pipelined_postprocs:
            postproc.set_context(context)

    @property
    def _pipelined_postprocs(self) -> List[PipelinedPostproc]:
        """The postproc wrappers installed by the rewrite (``pipeline_postproc=True``)."""
        return [] if self._rewrite is None else list(self._rewrite.postprocs)

    def _make_postproc(
        self, fqn: str, module: torch.nn.Module, call_args: CallArgs
    ) -> PipelinedPostproc:
        # Runs in the input_dist stage, on its stream; read on the stream
        # current in the forward (default_stream None).
        return PipelinedPostproc(module, fqn, call_args, self._contexts[0], None, self._dist_stream)

    def should_assert_context_invariants(self, ctx: TrainPipelineContext) -> bool:
        """True when ``ctx`` belongs to a real batch and the checks are switched on."""
        return (
            self._WITH_CONTEXT_ASSERTIONS
            and self.initialized
            and not self._exhausting_mode
            and ctx.index is not None
            and ctx.index >= 0
            and ctx.index not in self._holes
        )

    @staticmethod
    def _index_of(ctx: TrainPipelineContext) -> int:
        assert ctx.index is not None, "every context here is made with an index"
        return ctx.index

    def _forward_context(self) -> TrainPipelineContext:
        ctx = self._contexts[0]
        if self.should_assert_context_invariants(ctx):
            names = set(self._names())
            if isinstance(ctx, PrefetchTrainPipelineContext):
                assert set(ctx.module_input_post_prefetch) == names, ctx
            elif isinstance(ctx, EmbeddingTrainPipelineContext):
                assert set(ctx.embedding_a2a_requests) == names, ctx
            else:
                assert set(ctx.input_dist_tensors_requests) == names, ctx
        return ctx

    def _dist_context(self) -> TrainPipelineContext:
        return self._contexts[-1]

    def _stage_context(self) -> TrainPipelineContext:
        """The context of the prefetch or lookup stage's batch."""
        ctx = self._contexts[1]
        if self.should_assert_context_invariants(ctx):
            assert set(ctx.input_dist_tensors_requests) == set(self._names()), ctx
        return ctx

    # ---------------------------------------------------------------- rewrite

    def _modules(self) -> List[AnyShardedModule]:
        return [] if self._rewrite is None else self._rewrite.modules

    def _names(self) -> List[str]:
        return [] if self._rewrite is None else self._rewrite.names

    def _make_forward(
        self, name: str, call_args: CallArgs, module: AnyShardedModule
    ) -> BaseForward[Any]:
        context: Any = self._contexts[0]  # of the type _new_context makes for this mode
        if self._with_prefetch:
            return PrefetchPipelinedForward(name, call_args, module, context, self._prefetch_stream)
        if self._with_embedding_lookup:
            # The stream only names the device whose current stream consumes the lookup.
            return InSyncEmbeddingPipelinedForward(
                name, call_args, module, context, self._lookup_stream or self._dist_stream
            )
        return PipelinedForward(name, call_args, module, context, self._dist_stream)

    def _initialize_or_reattach(self, batch: Any) -> None:
        """Rewrite the model (first batch) or swap the wrappers back in (after :meth:`detach`)."""
        if not self._contexts:
            # Stand-ins for the batches ahead of the first one, so that the
            # first batch's context is the one whose input_dist starts now.
            for index in range(1 - self._num_contexts, 0):
                self._contexts.append(self._new_context(index))
            self._add_context()
        self._taken_over_by = None
        if self._rewrite is None:
            self._pipelined.rewrite(
                batch,
                self._make_forward,
                self._options["rewrite_strategy"],
                self._options["on_unpipelined"],
                make_postproc=self._make_postproc if self._pipeline_postproc else None,
            )
        else:
            self._pipelined.reattach(self._make_forward)
            # The caller may have run the model directly since the last forward hook.
            self._forward_done = record_event(self._compute_stream)
        self._set_module_context(self._forward_context())
        self.fwd_hook = self.model.register_forward_hook(self._after_forward)
        # The count of forwards and the watch that tells the other ranks when a forward
        # raises (the caller's loop runs it) wrap the model's forward instead of hooking
        # it: the model carries torchrec's one hook, as code that counts hooks expects.
        self._watch = forward_watch.WatchedForward(
            self.model, self._forward_index, before=self._before_forward
        )
        self.initialized = True

    def _forward_index(self) -> Optional[int]:
        """The index of the batch the forward reads (for a failure's message)."""
        return self._contexts[0].index if self._contexts else None

    def _before_forward(self, module: torch.nn.Module, input: Any) -> None:
        # Once this batch's forward has finished, the contexts hold the next
        # batch's input: a repeated forward (the caller retries after its
        # backward or optimizer step raised) must redo its own input_dist.
        direct = self._trained_since_tick
        for sharded in self._modules():
            forward: Any = sharded.forward
            forward.direct = direct
            forward.attempt += 1
        for postproc in self._pipelined_postprocs:
            postproc.direct = direct

    def _after_forward(self, module: torch.nn.Module, input: Any, output: Any) -> None:
        # Every read of this batch's prefetched cache rows is issued by now.
        self._forward_done = record_event(self._compute_stream)
        if self._trained_since_tick:
            return  # a repeated forward: the contexts moved on after the first
        self._trained_since_tick = True
        try:
            self._next_batch()
        except Exception:
            if self._watch is not None:
                self._watch.raised()  # part of the model's call, as the forward is
            raise

    def _next_batch(self) -> None:
        """Make the next batch the one the forward reads."""
        # The next batch's input must be distributed before its forward, and
        # the contexts move on only after that wait and before the next start.
        self.wait_sparse_data_dist()
        self._advance_context()
        # The next batch's lookup ran before this forward; the caller's
        # backward, which updates the tables it read, must not overtake it.
        ctx = self._contexts[0]
        if isinstance(ctx, EmbeddingTrainPipelineContext):
            wait_event(self._compute_stream, ctx.embedding_lookup_event)

    def detach(self) -> torch.nn.Module:
        """Give the model its own forwards back; in-flight batches are kept.

        The next :meth:`start_sparse_data_dist` (the next ``progress()``)
        pipelines the model again and carries on where it stopped.
        """
        if self.initialized:
            assert self.fwd_hook is not None and self._rewrite is not None
            self.fwd_hook.remove()
            self.fwd_hook = None
            if self._watch is not None:
                self._watch.remove()
                self._watch = None
        self._pipelined.detach()
        self.initialized = False
        return self.model

    # ------------------------------------------------------------------ verbs

    def start_sparse_data_dist(self, batch: In) -> In:
        """Start ``batch``'s input_dist (the splits all-to-all) on ``data_dist_stream``."""
        if not self.initialized:
            self._initialize_or_reattach(batch)
        assert self._rewrite is not None
        self._exhausting_mode = False
        self._drop_untrained_batch()
        ctx = self._dist_context()
        self._holes.discard(self._index_of(ctx))  # e.g. after a flush: a batch again
        if self._with_prefetch:
            # A caching module's input dist may read the cache state the prefetch
            # stage writes (torchrec PR #4191): after the prefetches issued so far.
            wait_stream(self._dist_stream, self._prefetch_stream)
        with on_stream(self._dist_stream):
            start_input_dist(self._rewrite, batch, ctx, self._agreement)
        assert ctx.index is not None
        self._last_started = ctx.index
        self._end_tick()
        if not self._fusion.fused:
            # The modules build their all-to-alls on their first input_dist.
            self._fusion.fuse(self._rewrite.modules)
        return batch

    def wait_sparse_data_dist(self) -> None:
        """Finish the last started batch's splits all-to-all, which launches its tensors one."""
        ctx = self._dist_context()
        if self.should_assert_context_invariants(ctx) and self._names():
            assert ctx.fused_splits_awaitables, f"batch {ctx.index}: input_dist was not started"
        with on_stream(self._dist_stream):
            wait_input_dist(ctx)

    def wait_sdd_fill_callback(self) -> None:
        """The input_dist stage's ``fill_callback``: the forward hook's work, while filling."""
        if not self._contexts:
            return  # the data ran out before any input_dist started
        self.wait_sparse_data_dist()
        self._advance_context()

    def data_exhausted_callback(self) -> None:
        """The input_dist stage's ``data_exhausted_callback``."""
        self._exhausting_mode = True
        if self._contexts:
            # No input_dist starts in this context now (end of data, a flush,
            # or a batch the pipeline skipped): no batch is trained from it.
            self._holes.add(self._index_of(self._dist_context()))
            self._drop_untrained_batch()
        self._end_tick()

    def batch_skipped(self, passed: bool, filling: bool) -> None:
        """Called by :meth:`StagedTrainPipeline.skip_failed_batch` when it drops a
        batch a stage raised on (see :class:`~trec_pipelines.pipelines.stages.SkipAware`).

        ``passed``: the batch had started its input_dist, and the stage after
        it (prefetch or lookup) raised.  Otherwise its input_dist raised (what
        it left in the context is forgotten) or an earlier stage did.
        ``filling``: the pipeline is filling, and the next batch takes the
        dropped one's place; otherwise the dropped batch's context stays a
        gap that the next input_dist stage passes over, as for a batch the
        caller skipped.
        """
        if not self._contexts:
            return  # it raised before the first batch set anything up
        if not passed:
            ctx = self._dist_context()
            self._contexts[-1] = self._new_context(self._index_of(ctx))
            return
        assert self._third_stage is not None, "only prefetch or lookup runs after input_dist"
        if filling:
            # Undo the fill callback's advance: the next batch starts its
            # input_dist in the newest context and advances once more.
            assert self._last_dropped is not None
            del self._contexts[1]
            self._contexts.appendleft(self._last_dropped)
            self._last_dropped = None
        else:
            self._holes.add(self._index_of(self._contexts[1]))

    def _drop_untrained_batch(self) -> None:
        """Catch up if the caller moved on without finishing the forward of the
        batch it was handed (it skipped a batch whose forward raised)."""
        ctx = self._contexts[0]
        handed_out = ctx.index is not None and 0 <= ctx.index <= self._last_started
        if self._advanced_since_tick or not handed_out:
            return
        if self._index_of(ctx) in self._holes:
            logger.debug(
                "SparseDataDistUtil: passing over batch %s, which the pipeline skipped", ctx.index
            )
        else:
            logger.warning(
                "SparseDataDistUtil: batch %s was not trained (its forward never finished); "
                "moving on to the next batch",
                ctx.index,
            )
        self._next_batch()

    def _end_tick(self) -> None:
        """The input_dist stage is done for this progress(): count anew."""
        self._trained_since_tick = False
        self._advanced_since_tick = False


__all__ = ["SparseDataDistUtil"]
