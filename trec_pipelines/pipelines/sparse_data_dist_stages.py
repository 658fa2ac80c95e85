"""The later stages a :class:`~trec_pipelines.pipelines.sparse_data_dist_util.SparseDataDistUtil`
offers: its prefetch and embedding-lookup verbs, and the :class:`PipelineStage`
factories that wrap its verbs with their callbacks and streams.

:class:`SparseDataDistStages` is a base of that class only and holds no state of
its own: the streams, the contexts and the rewrite are the util's.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Generic, Optional

import torch
from torchrec.distributed.train_pipeline import In

from trec_pipelines.core.streams import on_stream, record_event
from trec_pipelines.model.context import (
    EmbeddingTrainPipelineContext,
    PrefetchTrainPipelineContext,
    TrainPipelineContext,
)
from trec_pipelines.model.rewrite import RewriteResult
from trec_pipelines.pipelines.stages import PipelineStage
from trec_pipelines.sparse.cache_prefetch import prefetch_modules
from trec_pipelines.sparse.lookup import start_embedding_lookup

logger: logging.Logger = logging.getLogger(__name__)


class SparseDataDistStages(Generic[In]):
    """The prefetch and lookup verbs and the stage factories of
    :class:`~trec_pipelines.pipelines.sparse_data_dist_util.SparseDataDistUtil`.

    The attributes below are set by that class's constructor; the members
    that raise are that class's.
    """

    data_dist_stream: Optional[torch.Stream]
    embedding_lookup_stream: Optional[torch.Stream]
    _dist_stream: Optional[torch.Stream]
    _prefetch_stream: Optional[torch.Stream]
    _lookup_stream: Optional[torch.Stream]
    _compute_stream: Optional[torch.Stream]
    _forward_done: Optional[torch.Event]

    @property
    def _with_prefetch(self) -> bool:
        raise NotImplementedError

    @property
    def _with_embedding_lookup(self) -> bool:
        raise NotImplementedError

    @property
    def _rewrite(self) -> Optional[RewriteResult]:
        raise NotImplementedError

    def _stage_context(self) -> TrainPipelineContext:
        raise NotImplementedError

    def stage_declared(self, verb: str) -> None:
        """Note that a stage runs ``verb`` (the util's)."""
        raise NotImplementedError

    def start_sparse_data_dist(self, batch: In) -> In:
        """Start the batch's input_dist (the util's)."""
        raise NotImplementedError

    def wait_sdd_fill_callback(self) -> None:
        """The input_dist stage's fill callback (the util's)."""
        raise NotImplementedError

    def data_exhausted_callback(self) -> None:
        """The input_dist stage's data-exhausted callback (the util's)."""
        raise NotImplementedError

    def prefetch(self, batch: In) -> In:
        """Finish the batch's input_dist and prefetch its rows into the embedding caches."""
        if not self._with_prefetch:
            raise RuntimeError(
                "SparseDataDistUtil.prefetch ran but prefetch is not on: pass "
                "prefetch_stream to the constructor (may be None on CPU if the "
                "stage runs in a StagedTrainPipeline, which turns it on)"
            )
        ctx = self._stage_context()
        assert isinstance(ctx, PrefetchTrainPipelineContext)
        assert self._rewrite is not None
        prefetch_modules(
            self._rewrite.pipelined,
            ctx,
            dist_stream=self._dist_stream,
            prefetch_stream=self._prefetch_stream,
            forward_stream=self._compute_stream,
            forward_done=self._forward_done,
        )
        return batch

    def load_prefetch(self) -> None:
        """Does nothing: the contexts carry the prefetched input (kept for compatibility)."""
        logger.warning(
            "SparseDataDistUtil.load_prefetch does nothing; drop it from the prefetch "
            "stage's fill_callback"
        )

    def start_embedding_lookup(self, batch: In) -> In:
        """Run the batch's embedding lookup on ``embedding_lookup_stream``."""
        if not self._with_embedding_lookup:
            raise RuntimeError(
                "SparseDataDistUtil.start_embedding_lookup ran but the lookup stage is "
                "not on: pass embedding_lookup_stream to the constructor, or build the "
                "stage with start_embedding_lookup_stage() (its stream may be None on CPU)"
            )
        ctx = self._stage_context()
        assert isinstance(ctx, EmbeddingTrainPipelineContext)
        assert self._rewrite is not None
        # Issued from the compute stream's point of view: the lookup waits for
        # what was issued there so far and its input is kept alive there too.
        with on_stream(self._compute_stream):
            start_embedding_lookup(
                [(p.name, p.module) for p in self._rewrite.pipelined],
                ctx,
                dist_stream=self._dist_stream,
                lookup_stream=self._lookup_stream,
                weights_ready=record_event(self._compute_stream),
            )
        return batch

    # ----------------------------------------------------------------- stages

    def start_sparse_data_dist_stage(
        self,
        name: str = "start_sparse_data_dist",
        runnable: Optional[Callable[[Any], Any]] = None,
    ) -> PipelineStage:
        """The input_dist stage, with its fill and data-exhausted callbacks."""
        return PipelineStage(
            name=name,
            runnable=runnable or self.start_sparse_data_dist,
            stream=self.data_dist_stream,
            fill_callback=self.wait_sdd_fill_callback,
            data_exhausted_callback=self.data_exhausted_callback,
        )

    def start_embedding_lookup_stage(
        self,
        name: str = "start_embedding_lookup",
        runnable: Optional[Callable[[Any], Any]] = None,
    ) -> PipelineStage:
        """The embedding-lookup stage, on ``embedding_lookup_stream`` (``None``: the current stream)."""
        self.stage_declared("start_embedding_lookup")
        return PipelineStage(
            name=name,
            runnable=runnable or self.start_embedding_lookup,
            stream=self.embedding_lookup_stream,
        )


__all__ = ["SparseDataDistStages"]
