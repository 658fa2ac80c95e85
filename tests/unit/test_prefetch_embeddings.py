"""prefetch_embeddings with torchrec's signature, on CPU (no data_dist stream).

torchrec's returns at once without a data_dist stream, so on CPU nothing is
prefetched (tests/distributed/test_prefetch.py shows its pipeline fail on
that); the reference here is what the verb must do: finish each module's
input_dist, call its ``prefetch()``, and move input and context to the
post-prefetch fields the prefetch forward reads.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import pytest
import torch
from torch import nn

from tests.unit.fakes import _Ctx, _Ready
from trec_pipelines import (
    CallArgs,
    PrefetchPipelinedForward,
    PrefetchTrainPipelineContext,
    prefetch_embeddings,
)

CPU = torch.device("cpu")


class Prefetching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls: List[Tuple[Any, Optional[torch.Stream], Any]] = []

    def prefetch(
        self, dist_input: Any, forward_stream: Optional[torch.Stream] = None, ctx: Any = None
    ) -> None:
        self.calls.append((dist_input, forward_stream, ctx))


def test_prefetches_each_module_and_fills_the_post_prefetch_fields() -> None:
    context = PrefetchTrainPipelineContext(index=0)
    modules = []
    for name in ("ebc", "ec"):
        module = Prefetching()
        module.forward = PrefetchPipelinedForward(name, CallArgs([], {}), module, context)  # type: ignore[assignment]
        context.input_dist_tensors_requests[name] = _Ready(torch.full((2,), float(len(name))))
        context.module_contexts[name] = _Ctx()
        modules.append(module)
    contexts = dict(context.module_contexts)

    prefetch_embeddings(context, modules, CPU, torch.cuda.stream, None, None)  # type: ignore[arg-type]

    assert context.input_dist_tensors_requests == {} and context.module_contexts == {}
    for module, name in zip(modules, ("ebc", "ec"), strict=True):
        ((dist_input, forward_stream, ctx),) = module.calls
        assert torch.equal(dist_input, torch.full((2,), float(len(name))))
        assert forward_stream is None and ctx is contexts[name]
        assert context.module_input_post_prefetch[name] is dist_input
        assert context.module_contexts_post_prefetch[name] is ctx


def test_refuses_a_module_that_was_not_rewritten() -> None:
    with pytest.raises(TypeError, match="not a pipelined forward"):
        prefetch_embeddings(
            PrefetchTrainPipelineContext(), [Prefetching()], CPU, torch.cuda.stream, None, None
        )  # type: ignore[list-item]


def test_reads_a_cache_only_false_for_torchrec_kernels_known_to_have_none() -> None:
    from types import SimpleNamespace

    from torchrec.distributed.embedding_types import EmbeddingComputeKernel

    from trec_pipelines.sparse.cache_prefetch import reads_a_cache

    def sharded(*kernels: EmbeddingComputeKernel) -> SimpleNamespace:
        ops = [SimpleNamespace(_config=SimpleNamespace(compute_kernel=k)) for k in kernels]
        return SimpleNamespace(_lookups=[SimpleNamespace(_emb_modules=ops)])

    assert not reads_a_cache(sharded(EmbeddingComputeKernel.FUSED))
    assert not reads_a_cache(
        sharded(EmbeddingComputeKernel.FUSED, EmbeddingComputeKernel.FUSED_UVM)
    )
    assert reads_a_cache(
        sharded(EmbeddingComputeKernel.FUSED, EmbeddingComputeKernel.FUSED_UVM_CACHING)
    )
    assert reads_a_cache(sharded(EmbeddingComputeKernel.KEY_VALUE))
    assert reads_a_cache(SimpleNamespace())  # not torchrec's: its prefetch may matter
    assert reads_a_cache(SimpleNamespace(_lookups=[SimpleNamespace()]))  # kernels not visible
