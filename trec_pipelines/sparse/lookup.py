"""The embedding lookup run outside the model's forward (Fused, SemiSync).

:func:`start_embedding_lookup` finishes each pipelined module's input_dist and
runs its ``compute_and_output_dist`` on the lookup stream, leaving the awaitable
in the context for the embedding forward wrapper to pick up.

[Note: lookup ordering on streams]
The lookup of batch ``i`` reads embedding rows that the fused optimizer writes
during the backward of batch ``i-1`` (on the default stream).  When the lookup
runs on a side stream it therefore first waits for ``weights_ready``, an event
the pipeline records right after that backward -- not for the whole default
stream, so the lookup still overlaps the dense optimizer step.  After the
lookup an event is recorded on the lookup stream and stored in the context;
the forward wrapper makes the consuming stream wait on exactly that event,
not on everything later issued to the lookup stream (which, with the default
``emb_lookup_stream="data_dist"``, includes the next batch's input_dist).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedTensor

from trec_pipelines._types import AnyShardedModule
from trec_pipelines.core.streams import (
    current_stream,
    on_stream,
    record_event,
    record_stream,
    wait_event,
    wait_stream,
)
from trec_pipelines.model.context import EmbeddingTrainPipelineContext


def start_embedding_lookup(
    modules: Sequence[Tuple[str, AnyShardedModule]],
    context: EmbeddingTrainPipelineContext,
    *,
    dist_stream: Optional[torch.Stream],
    lookup_stream: Optional[torch.Stream],
    weights_ready: Optional[torch.Event],
) -> None:
    """Run every module's lookup for ``context``'s batch on ``lookup_stream``.

    Reads ``input_dist_tensors_requests`` and ``module_contexts``; writes
    ``embedding_a2a_requests`` and ``embedding_lookup_event``.
    """
    # The caller's stream runs the forward and the backward over this lookup,
    # and the fused TBE keeps the ids of ``dist_input`` for that backward: the
    # input is used there too, not only where the lookup runs.
    compute = current_stream(_device_of(lookup_stream, dist_stream))
    runs_on = lookup_stream if lookup_stream is not None else compute
    users = [runs_on] if runs_on == compute else [runs_on, compute]
    wait_event(lookup_stream, weights_ready)
    with on_stream(lookup_stream):
        for name, module in modules:
            module_ctx = context.module_contexts[name]
            request = context.input_dist_tensors_requests.pop(name)
            # The tensors all-to-all completes on the stream it was issued to.
            with on_stream(dist_stream):
                dist_input = request.wait()
            wait_stream(runs_on, dist_stream)
            for user in users:
                record_stream(dist_input, user)
                record_stream(module_ctx, user)
            context.embedding_a2a_requests[name] = module.compute_and_output_dist(
                module_ctx, dist_input
            )
    context.embedding_lookup_event = record_event(lookup_stream)


def _device_of(*streams: Optional[torch.Stream]) -> torch.device:
    for stream in streams:
        if stream is not None:
            return stream.device
    return torch.device("cpu")


class _Done:
    """An awaitable already waited: ``wait()`` gives its result again."""

    def __init__(self, result: Any) -> None:
        self._result = result

    def wait(self) -> Any:
        return self._result


def finish_lookup(context: EmbeddingTrainPipelineContext) -> Dict[str, List[torch.Tensor]]:
    """Wait for ``context``'s embedding all-to-alls, leaving their results in place,
    and return each module's looked-up values in the order the forward detaches them."""
    values: Dict[str, List[torch.Tensor]] = {}
    for name, request in list(context.embedding_a2a_requests.items()):
        if isinstance(request, tuple):  # managed collisions: (embeddings, remapped ids)
            results = tuple(r.wait() for r in request)
            context.embedding_a2a_requests[name] = tuple(_Done(r) for r in results)
            embeddings = results[0]
        else:
            embeddings = request.wait()
            context.embedding_a2a_requests[name] = _Done(embeddings)
        if isinstance(embeddings, KeyedTensor):
            values[name] = [embeddings.values().detach()]
        else:
            values[name] = [jt.values().detach() for jt in embeddings.values()]
    return values
