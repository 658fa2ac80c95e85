"""The verbs of PEC embedding modules (``ShardedPECEmbeddingCollection``), for TrainPipelinePEC.

[Note: PEC, compute ahead]
A PEC module splits each batch's ids in two by comparing them with the
neighbouring batch's:

* forward: the ids batch ``i`` shares with batch ``i-1`` (*overlapped*, OL) may
  change in ``i-1``'s update, so they are looked up in ``i``'s own step, after
  that update; the others (NOL) are untouched by ``i-1``'s update and are
  looked up one step ahead, right after ``i-1``'s forward;
* backward: the gradient rows of ``i`` that batch ``i+1`` reads (OL) are
  applied in ``i``'s step; the others (NOL) are applied one step later, at
  the start of ``i+1``'s forward, since ``i+1`` never reads them.

Looking up or updating a row a step early or late is then meant to give the
same values as the plain loop (row-wise optimizers).  The split comes from the *overlap dist* of ``(i+1, i)``: it
builds ``i+1``'s forward partition and ``i``'s backward partition (mask
all-to-alls on the data_dist stream).  The first batch has no backward
partition made for it by a predecessor and the last batch's comes from a final
overlap dist with no successor.

Every function here loops over the pipeline's PEC modules only; with none
(a model of plain EmbeddingBagCollections) each is a no-op, and the pipeline
is the in-sync lookup-ahead schedule of its non-PEC modules alone.

PEC modules need torchrec >= 1.9 (1.8.0's takes one sharding group, not a
list per group): :func:`check_pec_supported` says so.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torchrec
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.pec_embedding import ShardedPECEmbeddingCollection
from torchrec.distributed.types import Awaitable, ShardedModule

from trec_pipelines.context import PECTrainPipelineContext
from trec_pipelines.streams import on_stream, record_event, record_stream, wait_event

PECModules = Sequence[Tuple[str, ShardedPECEmbeddingCollection]]
GradAwaitables = Dict[str, List[Awaitable[None]]]


def is_pec(module: ShardedModule) -> bool:
    return isinstance(module, ShardedPECEmbeddingCollection)


def check_pec_supported(modules: PECModules, pipeline: str) -> None:
    """Raise when PEC modules are pipelined on a torchrec whose PEC API is the old one."""
    if not modules:
        return
    major, minor = (int(part) for part in torchrec.__version__.split(".")[:2])
    if (major, minor) < (1, 9):
        names = ", ".join(name for name, _ in modules)
        raise RuntimeError(
            f"{pipeline}: the PEC modules {names} need torchrec >= 1.9 (installed: "
            f"{torchrec.__version__}, whose ShardedPECEmbeddingCollection takes one "
            "sharding group per call). Upgrade torchrec, or use plain "
            "EmbeddingCollections with this pipeline."
        )


def overlap_dist(
    modules: PECModules,
    current: Optional[PECTrainPipelineContext],
    previous: Optional[PECTrainPipelineContext],
    *,
    dist_stream: Optional[torch.Stream],
    compute_stream: Optional[torch.Stream],
) -> None:
    """Partition ``current``'s ids (forward) and ``previous``'s (backward) on ``dist_stream``.

    ``current`` is None for the final overlap dist (the last batch has no
    successor), ``previous`` for the first batch.  Takes each PEC module's
    tensors all-to-all from ``current``; writes ``current.pec_dist_inputs``,
    ``current.pec_forward_ctxs``, ``previous.pec_backward_ctxs`` and the events
    that order ``compute_stream``'s readers after this work.
    """
    assert current is not None or previous is not None
    with on_stream(dist_stream):
        for name, module in modules:
            dist_input = None
            module_ctx = None
            if current is not None:
                dist_input = current.input_dist_tensors_requests.pop(name).wait()
                current.pec_dist_inputs[name] = dist_input
                module_ctx = current.module_contexts[name]
            results = module.overlap_dist(
                ctx=module_ctx,
                dist_input=dist_input,
                prev_ctx=None if previous is None else previous.module_contexts[name],
                prev_dist_input=None if previous is None else previous.pec_dist_inputs[name],
            )
            forward_ctxs: List[Any] = []
            backward_ctxs: List[Any] = []
            for result in results:
                forward_ctx, backward_ctx = result.wait()
                if forward_ctx is not None:
                    _hand_over(forward_ctx, ("ol_features", "nol_features", "permute"), compute_stream)
                    forward_ctxs.append(forward_ctx)
                if backward_ctx is not None:
                    _hand_over(
                        backward_ctx,
                        ("ol_features", "nol_features", "ol_permute", "nol_permute"),
                        compute_stream,
                    )
                    backward_ctxs.append(backward_ctx)
            if current is not None:
                current.pec_forward_ctxs[name] = forward_ctxs
            if previous is not None and backward_ctxs:
                previous.pec_backward_ctxs[name] = backward_ctxs
        done = record_event(dist_stream)
    if current is not None:
        current.overlap_dist_event = done
    if previous is not None:
        previous.backward_ctx_event = done


def _hand_over(partition: Any, fields: Tuple[str, ...], consumer: Optional[torch.Stream]) -> None:
    """Record a partition's tensors on the stream that reads them, and compute the
    KJTs' per-key lengths now: they were built without them, and computing them at
    first use would synchronise the device there, in the middle of the step."""
    for name in fields:
        record_stream(getattr(partition, name), consumer)
    partition.ol_features.sync()
    partition.nol_features.sync()


def partition_lookup(
    modules: PECModules, context: PECTrainPipelineContext, overlapped: bool
) -> None:
    """Look up the overlapped (OL) or non-overlapped (NOL) partition of ``context``'s batch.

    Writes ``pec_ol_awaitables`` / ``pec_nol_awaitables``, popped by the forward.
    """
    store = context.pec_ol_awaitables if overlapped else context.pec_nol_awaitables
    for name, module in modules:
        forward_ctxs = context.pec_forward_ctxs[name]
        store[name] = module.compute_and_output_dist_in_partition(
            context.module_contexts[name],
            [fc.ol_features if overlapped else fc.nol_features for fc in forward_ctxs],
            [fc.splits for fc in forward_ctxs],
            is_overlapped=overlapped,
        )


def start_ol_grad(
    modules: PECModules, context: PECTrainPipelineContext, consumer: Optional[torch.Stream]
) -> GradAwaitables:
    """Start the OL gradient all-to-all of ``context``'s batch (its backward has run)."""
    wait_event(consumer, context.backward_ctx_event)
    started: GradAwaitables = {}
    for name, module in modules:
        backward_ctxs = context.pec_backward_ctxs[name]
        started[name] = module.grad_dist(
            context.module_contexts[name],
            KJTList([bc.ol_features for bc in backward_ctxs]),
            is_overlapped=True,
        )
    return started


def defer_nol_grad(
    modules: PECModules, trained: PECTrainPipelineContext, carrier: PECTrainPipelineContext
) -> None:
    """Hand ``trained``'s NOL gradient inputs to ``carrier`` (the next batch, or itself at the end).

    The carrier keeps the module context (which holds the gradient appliers the
    backward made) alive after ``trained`` is dequeued.
    """
    for name, _ in modules:
        backward_ctxs = trained.pec_backward_ctxs.get(name)
        if backward_ctxs is None:
            continue
        carrier.pec_deferred_nol_grad[name] = (
            trained.module_contexts[name],
            [bc.nol_features for bc in backward_ctxs],
        )


def start_deferred_nol_grad(
    modules: PECModules, context: PECTrainPipelineContext
) -> GradAwaitables:
    """Start the NOL gradient all-to-all ``context`` carries (the previous batch's)."""
    by_name = dict(modules)
    started: GradAwaitables = {}
    for name, (module_ctx, nol_features) in context.pec_deferred_nol_grad.items():
        started[name] = by_name[name].grad_dist(module_ctx, KJTList(nol_features), is_overlapped=False)
    context.pec_deferred_nol_grad.clear()
    return started


def apply_grad(started: GradAwaitables) -> None:
    """Finish the gradient all-to-alls and apply them to the tables."""
    for awaitables in started.values():
        for awaitable in awaitables:
            awaitable.wait()


__all__ = [
    "apply_grad",
    "check_pec_supported",
    "defer_nol_grad",
    "is_pec",
    "overlap_dist",
    "partition_lookup",
    "start_deferred_nol_grad",
    "start_ol_grad",
]
