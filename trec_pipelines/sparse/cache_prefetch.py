"""The cache-prefetch verb shared by the Prefetch pipeline and SparseDataDistUtil.

:func:`prefetch_modules` finishes each pipelined module's input_dist and
calls its ``prefetch()`` on the prefetch stream, moving the distributed input
and sharding context to ``module_input_post_prefetch`` /
``module_contexts_post_prefetch``, where ``PrefetchPipelinedForward`` finds them.

The prefetch stream first waits for ``forward_done``, an event recorded after
the forward that reads the cache state this prefetch rewrites, then for the
data_dist stream; see ``[Note: prefetch ordering]`` in
:mod:`trec_pipelines.pipelines.prefetch`.

:func:`prefetch_embeddings` is the same verb with torchrec's signature, for code
that drives prefetching itself.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, List, Optional, Sequence, cast

import torch

from trec_pipelines._types import AnyShardedModule
from trec_pipelines.core.streams import (
    current_stream,
    on_stream,
    record_stream,
    wait_event,
    wait_stream,
)
from trec_pipelines.model.context import PrefetchTrainPipelineContext
from trec_pipelines.model.rewrite import PipelinedModule
from trec_pipelines.sparse.embedding_kernels import embedding_kernels
from trec_pipelines.sparse.forwards import BaseForward


def prefetch_modules(
    modules: Sequence[PipelinedModule],
    context: PrefetchTrainPipelineContext,
    *,
    dist_stream: Optional[torch.Stream],
    prefetch_stream: Optional[torch.Stream],
    forward_stream: Optional[torch.Stream],
    forward_done: Optional[torch.Event],
) -> None:
    """Prefetch every module's rows for ``context``'s batch on ``prefetch_stream``.

    Reads ``input_dist_tensors_requests`` and ``module_contexts``; writes
    ``module_input_post_prefetch`` and ``module_contexts_post_prefetch``.
    """
    # The tensors all-to-alls belong to the data_dist stream; waiting there
    # keeps any stream work the wait enqueues there too.
    with on_stream(dist_stream):
        dist_inputs = {
            p.name: context.input_dist_tensors_requests.pop(p.name).wait() for p in modules
        }
    with on_stream(prefetch_stream):
        wait_event(prefetch_stream, forward_done)
        # Everything of this batch so far (copy, input_dist) is now behind the
        # prefetch stream, which the forward waits for, pipelined modules or not.
        wait_stream(prefetch_stream, dist_stream)
        for pipelined in modules:
            name = pipelined.name
            dist_input = dist_inputs[name]
            module_ctx = context.module_contexts.pop(name)
            # Made on data_dist, read here: keep them alive for this stream.
            record_stream(dist_input, prefetch_stream)
            record_stream(module_ctx, prefetch_stream)
            pipelined.module.prefetch(
                dist_input=dist_input, forward_stream=forward_stream, ctx=module_ctx
            )
            context.module_input_post_prefetch[name] = dist_input
            context.module_contexts_post_prefetch[name] = module_ctx


def prefetch_embeddings(
    context: PrefetchTrainPipelineContext,
    pipelined_modules: List[AnyShardedModule],
    device: torch.device,
    stream_context: Callable[[Optional[torch.Stream]], ContextManager[Any]],
    data_dist_stream: Optional[torch.Stream],
    forward_stream: Optional[torch.Stream],
) -> None:
    """Prefetch ``context``'s batch for ``pipelined_modules`` on the current stream.

    torchrec's signature; each module's forward must be a pipelined forward of
    ours (it names the module).  The current stream of ``device`` does the
    prefetch, after the ``data_dist_stream`` that made the inputs.  Unlike
    torchrec's, it also prefetches when there is no data_dist stream (CPU).
    ``stream_context`` is accepted for torchrec's callers; ours switch streams
    with :func:`trec_pipelines.core.streams.on_stream`.
    """
    modules = []
    for module in pipelined_modules:
        name = getattr(module.forward, "name", None)
        if not isinstance(name, str):
            raise TypeError(
                f"prefetch_embeddings: {type(module).__name__}.forward is not a pipelined "
                "forward; pass the modules a trec_pipelines pipeline rewrote "
                "(pipeline.rewrite_result.pipelined)"
            )
        modules.append(PipelinedModule(name, module, cast(BaseForward[Any], module.forward).args))
    prefetch_modules(
        modules,
        context,
        dist_stream=data_dist_stream,
        prefetch_stream=current_stream(device),
        forward_stream=forward_stream,
        forward_done=None,
    )


# torchrec's compute kernels that read no cache: their prefetch() has nothing to fill.
NO_CACHE_KERNELS = frozenset({"dense", "fused", "fused_uvm", "quant", "quant_uvm"})


def reads_a_cache(module: Any) -> bool:
    """Whether ``module``'s ``prefetch()`` may fill a cache its lookup reads.

    False only for a torchrec sharded embedding module all of whose embedding
    kernels are of :data:`NO_CACHE_KERNELS`; any other module (a kernel of
    another kind, or a module whose kernels this can't see) may.
    """
    kernels = embedding_kernels(module)
    if kernels is None:
        return True
    for kernel in kernels:
        compute_kernel = getattr(getattr(kernel, "_config", None), "compute_kernel", None)
        if getattr(compute_kernel, "value", compute_kernel) not in NO_CACHE_KERNELS:
            return True
    return False
