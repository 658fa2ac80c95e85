"""What TrainPipelineSemiSync keeps in a checkpoint besides its batches (see
[Note: exact resume] in :mod:`trec_pipelines.assembly.resume`)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, cast

import torch

from trec_pipelines.assembly.resume import CheckpointedPipeline, ResumeHooks
from trec_pipelines.model.context import EmbeddingTrainPipelineContext, TrainPipelineContext
from trec_pipelines.sparse.lookup import finish_lookup


class SemiSyncPipeline(CheckpointedPipeline, Protocol):
    """What :class:`SemiSyncResume` reads and writes of a TrainPipelineSemiSync."""

    _gradients: Dict[str, torch.Tensor]
    _restored_lookup: Optional[Tuple[int, Dict[str, List[torch.Tensor]]]]

    @property
    def _stash_gradients(self) -> bool: ...

    @property
    def _model(self) -> torch.nn.Module: ...

    @property
    def contexts(self) -> Sequence[TrainPipelineContext]: ...


class SemiSyncResume(ResumeHooks):
    """SemiSync's checkpoint: ``nxt``'s looked-up embeddings and the stashed gradients."""

    pipeline: SemiSyncPipeline

    def extra_state(self) -> Dict[str, Any]:
        """``nxt``'s looked-up embeddings and the stashed gradients.

        Once semi-sync, ``nxt`` was looked up before ``cur``'s update: a resumed
        pipeline, looking it up again from the checkpointed tables, would read
        rows one update newer.  So its lookup is finished here (the output
        all-to-all already issued) and the values its dense part will see are
        kept; the resumed pipeline gives its dense part these values and sends
        the gradients into its own lookup, whose table gradient does not
        depend on the rows' values.  With ``stash_gradients``, the dense
        gradients of the last batch, which the next step applies, are kept too.
        Size: ``nxt``'s pooled embeddings (batch x summed embedding dims) and,
        stashing, one gradient per dense parameter.
        """
        p = self.pipeline
        extra: Dict[str, Any] = {}
        if p._gradients:
            extra["semi_sync_stashed_gradients"] = dict(p._gradients)
        if p.contexts:
            context = cast(EmbeddingTrainPipelineContext, p.contexts[0])
            if context.embedding_a2a_requests:
                extra["semi_sync_lookup"] = (context.index, finish_lookup(context))
        return extra

    def load_extra_state(self, extra: Dict[str, Any], variant: str) -> None:
        p = self.pipeline
        extra = dict(extra)
        gradients = extra.pop("semi_sync_stashed_gradients", None)
        if gradients is not None and p._stash_gradients:
            devices = {name: param.device for name, param in p._model.named_parameters()}
            p._gradients = {name: g.to(devices[name]) for name, g in gradients.items()}
        elif gradients is not None:
            extra["semi_sync_stashed_gradients"] = gradients  # reported as unused below
        lookup = extra.pop("semi_sync_lookup", None)
        if lookup is not None:
            p._restored_lookup = lookup
        super().load_extra_state(extra, variant)


__all__ = ["SemiSyncResume"]
