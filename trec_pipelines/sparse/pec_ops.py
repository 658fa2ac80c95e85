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

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torchrec
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.pec_embedding import ShardedPECEmbeddingCollection
from torchrec.distributed.types import Awaitable

from trec_pipelines._types import AnyShardedModule
from trec_pipelines.core.streams import on_stream, record_event, record_stream, wait_event
from trec_pipelines.model.context import PECTrainPipelineContext

# The modules are ShardedPECEmbeddingCollection, typed Any: its methods'
# signatures differ between torchrec 1.8 and 1.9 (we call 1.9's), and it takes
# its own context type where the pipeline context keeps Multistreamable.
PECModules = Sequence[Tuple[str, Any]]
GradAwaitables = Dict[str, List[Awaitable[None]]]


def is_pec(module: AnyShardedModule) -> bool:
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
                    _hand_over(
                        forward_ctx, ("ol_features", "nol_features", "permute"), compute_stream
                    )
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


@dataclass
class DeferredNolGrad:
    """A trained batch's NOL gradient, held by the pipeline until it is applied.

    Written by :func:`defer_nol_grad` at the end of the batch's step; started
    by :func:`start_nol_grad` and applied by :func:`apply_grad` in the next
    step (or at once, before the model is used out of order).  It lives on the
    pipeline, not in a batch's context, so a rolled-back step forgets its
    contexts without losing it (see [Note: PEC, retrying a step] in
    :mod:`trec_pipelines.pipelines.pec`).  Each module's entry moves from
    ``inputs`` to ``started`` as its all-to-all is started, and leaves
    ``started`` once applied: a failure half-way leaves exactly what is still
    owed, and nothing is applied twice.
    """

    batch: Optional[int] = None  # the batch the gradient comes from, for the recorder
    # Not started: each module's context (holding the appliers its backward made)
    # and NOL features per sharding group.
    inputs: Dict[str, Tuple[Any, List[Any]]] = field(default_factory=dict)
    started: GradAwaitables = field(default_factory=dict)  # started, not applied

    @property
    def pending(self) -> bool:
        return bool(self.inputs or self.started)


def defer_nol_grad(
    modules: PECModules, trained: PECTrainPipelineContext, deferred: DeferredNolGrad
) -> None:
    """Hand ``trained``'s NOL gradient inputs to ``deferred`` (the last one is applied)."""
    assert not deferred.pending, f"batch {deferred.batch}'s NOL gradient was never applied"
    deferred.batch = trained.index
    for name, _ in modules:
        backward_ctxs = trained.pec_backward_ctxs.get(name)
        if backward_ctxs is None:
            continue
        deferred.inputs[name] = (
            trained.module_contexts[name],
            [bc.nol_features for bc in backward_ctxs],
        )


def start_nol_grad(modules: PECModules, deferred: DeferredNolGrad) -> None:
    """Start the NOL gradient all-to-alls of ``deferred`` not started yet."""
    by_name = dict(modules)
    for name in list(deferred.inputs):
        module_ctx, nol_features = deferred.inputs[name]
        deferred.started[name] = by_name[name].grad_dist(
            module_ctx, KJTList(nol_features), is_overlapped=False
        )
        del deferred.inputs[name]


def apply_grad(started: GradAwaitables) -> None:
    """Finish the gradient all-to-alls and apply them to the tables.

    Each awaitable leaves ``started`` once waited: an applier fires once only
    (torchrec's ``PECGradientApply.apply`` forgets its all-to-all), so after a
    failure half-way only the rest may be waited again.
    """
    for name in list(started):
        awaitables = started[name]
        while awaitables:
            awaitables[0].wait()
            awaitables.pop(0)
        del started[name]


__all__ = [
    "DeferredNolGrad",
    "apply_grad",
    "check_pec_supported",
    "defer_nol_grad",
    "is_pec",
    "overlap_dist",
    "partition_lookup",
    "start_nol_grad",
    "start_ol_grad",
]
