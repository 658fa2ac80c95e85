"""Pipeline contexts: the state of one in-flight batch, passed between verbs.

A pipeline creates one context per batch when the batch is loaded and drops it
when the batch has been trained.  Each field names the verb that writes it and
the verb that reads it; nothing else touches it.  Subclasses only add fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torchrec.distributed.types import Awaitable
from torchrec.streamable import Multistreamable


@dataclass
class TrainPipelineContext:
    """Per-batch state of the sparse-dist pipelines.

    Attributes:
        index: the batch's position in the stream of loaded batches.
            Written by ``copy_batch_to_gpu``; read by every verb for recording.
        module_contexts: each pipelined module's sharding context, by module FQN.
            Written by ``start_sparse_data_dist``; popped by the forward wrapper
            (or by the prefetch / embedding-lookup verbs).
        input_dist_splits_requests: the first (splits) phase of each module's
            ``input_dist``.  Written by ``start_sparse_data_dist``; read and
            cleared by ``wait_sparse_data_dist``.
        fused_splits_awaitables: the splits phases fused into one collective per
            process group, with the module names each one answers for.
            Written by ``start_sparse_data_dist``; read and cleared by
            ``wait_sparse_data_dist``.
        input_dist_tensors_requests: the second (tensors) phase per module.
            Written by ``wait_sparse_data_dist``; popped by the forward wrapper
            (or by the prefetch / embedding-lookup verbs).
        events: events the consumer of this batch waits on before using it.
            Written and read by the staged pipeline's stages.
        postproc_fwd_results: each pipelined postproc module's output for this
            batch, by module FQN, in the order they ran.  Written by the
            postproc wrapper when ``start_sparse_data_dist`` builds the
            input_dist arguments (data_dist stream); read by postprocs that
            consume it in the same stage and by the model's own call to the
            postproc in the forward, which gets this output instead of running
            the module again.  Dropped with the context.
        postproc_events: recorded on the data_dist stream right after each
            postproc ran, by FQN (empty on CPU).  Written by the postproc
            wrapper in the input_dist stage; the forward's call waits on it
            before reading the cached output.
        features_shared_with_loader: the device batch's KJTs use the storage of
            the batch the loader gave (it was already on the device), so
            ``free_features_storage_early`` must leave them alone.  Written by
            the copy verb (only with that option); read by ``start_sparse_data_dist``.
        padding: the batch is a padding batch (an eval pipeline's rank whose data
            ended, running steps until every rank's has; see the note "padding
            uneven eval data" in ``trec_pipelines.data.padding``): its output is
            thrown away.  Written by the copy verb; read by the eval ``progress()``.
        version: torchrec's context version, accepted so that a ``_create_context``
            written for torchrec (``self._context_type(index=..., version=1)``)
            works; nothing reads it.
    """

    index: Optional[int] = None
    module_contexts: Dict[str, Multistreamable] = field(default_factory=dict)
    input_dist_splits_requests: Dict[str, Awaitable[Any]] = field(default_factory=dict)
    fused_splits_awaitables: List[Tuple[List[str], Awaitable[Any]]] = field(default_factory=list)
    input_dist_tensors_requests: Dict[str, Awaitable[Any]] = field(default_factory=dict)
    events: List[torch.Event] = field(default_factory=list)
    postproc_fwd_results: Dict[str, Any] = field(default_factory=dict)
    postproc_events: Dict[str, torch.Event] = field(default_factory=dict)
    features_shared_with_loader: bool = False
    padding: bool = False
    version: int = 1


@dataclass
class PrefetchTrainPipelineContext(TrainPipelineContext):
    """Adds the results of the cache-prefetch stage.

    Attributes:
        module_input_post_prefetch: each module's distributed input, ready for
            lookup.  Written by the prefetch verb; popped by the prefetch forward.
        module_contexts_post_prefetch: each module's sharding context after
            prefetch.  Written by the prefetch verb; popped by the prefetch forward.
    """

    module_input_post_prefetch: Dict[str, Union[Multistreamable, torch.Tensor]] = field(
        default_factory=dict
    )
    module_contexts_post_prefetch: Dict[str, Multistreamable] = field(default_factory=dict)


@dataclass
class EmbeddingTrainPipelineContext(TrainPipelineContext):
    """Adds the embedding lookup that runs outside the forward (Fused, SemiSync).

    Attributes:
        embedding_a2a_requests: each module's ``compute_and_output_dist`` result.
            Written by the embedding-lookup verb; popped by the embedding forward.
        embedding_tensors: the lookup outputs, one list per module, in forward
            order.  Written by the embedding forward (SemiSync); read by
            ``embedding_backward``.
        embedding_features: the feature names matching ``embedding_tensors``.
            Written by the embedding forward; read by ``embedding_backward``.
        detached_embedding_tensors: the detached leaves the dense part saw, whose
            ``.grad`` is sent back into ``embedding_tensors``.  Written by the
            embedding forward; read by ``embedding_backward``.
        embedding_lookup_event: recorded on the lookup stream right after the
            lookup (``None`` on CPU).  Written by the embedding-lookup verb; the
            embedding forward makes the consuming stream wait on it.
        restored_embeddings: per module, the values the dense part must see
            in place of the lookup's (a batch resumed from a checkpoint whose
            lookup read older weights; see the note "exact resume" in the source of
            ``trec_pipelines.assembly.resume``).  Written
            by SemiSync after the batch's lookup; popped by the embedding forward.
    """

    embedding_a2a_requests: Dict[str, Any] = field(default_factory=dict)
    embedding_tensors: List[List[torch.Tensor]] = field(default_factory=list)
    embedding_features: List[List[Union[str, List[str]]]] = field(default_factory=list)
    detached_embedding_tensors: List[List[torch.Tensor]] = field(default_factory=list)
    embedding_lookup_event: Optional[torch.Event] = None
    restored_embeddings: Dict[str, List[torch.Tensor]] = field(default_factory=dict)


@dataclass
class CPUEmbeddingTrainPipelineContext(EmbeddingTrainPipelineContext):
    """EvalPipelineCPUSparse's batch: embeddings looked up on the host, then copied.

    Attributes:
        dense_gpu_device: the device type the dense forward runs on ("cuda",
            or "cpu").  Written when the batch is queued.
        gpu_embedding_outputs: per module, its embeddings on that device.
            Written by the copy stage; popped by
            :class:`~trec_pipelines.sparse.forwards.CPUEmbeddingPipelinedForward`.
    """

    dense_gpu_device: str = ""
    gpu_embedding_outputs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class PECTrainPipelineContext(EmbeddingTrainPipelineContext):
    """Adds the state of PEC (overlap-aware) embedding modules; every dict is keyed by module FQN.

    Non-PEC modules use the inherited lookup fields (``embedding_a2a_requests``).
    "Overlap dist" below is the verb that compares a batch's ids with the
    previous batch's (``ShardedPECEmbeddingCollection.overlap_dist``).

    Attributes:
        pec_dist_inputs: each PEC module's distributed input (one KJT per
            sharding group).  Written by the overlap dist of this batch; read
            by the next batch's overlap dist, as its previous input.
        pec_forward_ctxs: the forward partition (overlapped / not overlapped
            ids) per sharding group.  Written by the overlap dist of this
            batch; read by the OL and NOL lookups; popped by the PEC forward.
        pec_backward_ctxs: the backward partition per sharding group.  Written
            by the overlap dist of the *next* batch (or the final one); read by
            the PEC forward, the OL gradient and the NOL gradient deferral.
        pec_ol_awaitables: output dists of the overlapped lookup (fresh
            weights).  Written by the OL lookup; popped by the PEC forward.
        pec_nol_awaitables: output dists of the non-overlapped lookup, run one
            step ahead.  Written by the NOL lookup; popped by the PEC forward.
        overlap_dist_event: recorded on the data_dist stream after the overlap
            dist that made ``pec_forward_ctxs`` (``None`` on CPU).  Written by
            that overlap dist; waited by this batch's NOL lookup and WaitBatch.
        backward_ctx_event: recorded after the overlap dist that made
            ``pec_backward_ctxs``.  Written by that overlap dist; waited before
            this batch's OL gradient.
        pec_deferred_nol_grad: torchrec's field for the previous batch's NOL
            gradient, carried by the next batch's context.  Kept so code that
            reads it finds it; our pipeline leaves it empty and holds that
            gradient itself (``pec_ops.DeferredNolGrad``), where a rolled-back
            step cannot lose it.
    """

    pec_dist_inputs: Dict[str, Any] = field(default_factory=dict)
    pec_forward_ctxs: Dict[str, Any] = field(default_factory=dict)
    pec_backward_ctxs: Dict[str, Any] = field(default_factory=dict)
    pec_ol_awaitables: Dict[str, Any] = field(default_factory=dict)
    pec_nol_awaitables: Dict[str, Any] = field(default_factory=dict)
    overlap_dist_event: Optional[torch.Event] = None
    backward_ctx_event: Optional[torch.Event] = None
    pec_deferred_nol_grad: Dict[str, Any] = field(default_factory=dict)
