"""PrefetchTrainPipelineSparseDist against the plain loop; torchrec's class on CPU.

Prefetching changes where rows come from, not what is computed: the embeddings
are still updated in the backward of each batch before the next forward, so
the oracle is the plain, non-pipelined loop.  Every step's output and the final
weights must be ``torch.equal``.

torchrec 1.8.0's class is no oracle here: on CPU it fails on the first forward,
with or without the test shim (see :func:`test_torchrec_class_fails_on_cpu`).
"""

from __future__ import annotations

import contextlib
from typing import Any, List, Optional, Tuple

import pytest
import torch
import torchrec.distributed.train_pipeline as upstream
from torchrec.distributed.types import ShardedModule

from trec_pipelines.pipelines.prefetch import PrefetchTrainPipelineSparseDist
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    SHARDING_TYPES,
    NestedDLRM,
    assert_runs_equal,
    make_batches,
    make_sharded,
    run_pipeline,
)
from trec_pipelines.testing.references import plain_loop_of
from trec_pipelines.testing.torchrec_cpu import shim_active, torchrec_on_cpu

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 7


def sharded_module(model: torch.nn.Module) -> ShardedModule:
    (module,) = [m for m in model.modules() if isinstance(m, ShardedModule)]
    return module


def count_prefetches(module: ShardedModule) -> List[Tuple[Optional[Any], bool]]:
    """Wrap ``module.prefetch`` to log ``(forward_stream, got a context)`` per call."""
    calls: List[Tuple[Optional[Any], bool]] = []
    original = module.prefetch

    def prefetch(dist_input: Any, forward_stream: Optional[Any] = None, ctx: Any = None) -> None:
        calls.append((forward_stream, ctx is not None))
        original(dist_input=dist_input, forward_stream=forward_stream, ctx=ctx)

    module.prefetch = prefetch  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("sharding_type", SHARDING_TYPES)
def test_prefetch_matches_plain_loop(sharding_type: str) -> None:
    batches = make_batches(seed=DATA_SEED)
    ref = plain_loop_of(DLRM, sharding_type, batches, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, sharding_type, seed=SEED)
    calls = count_prefetches(sharded_module(dmp))
    pipeline = PrefetchTrainPipelineSparseDist(dmp, optimizer, DEVICE)
    assert not shim_active()
    ours = run_pipeline(pipeline, batches, model=dmp)
    assert len(ref) == len(batches)
    assert_runs_equal(ref, ours, ("plain_loop", "trec_pipelines"))
    # The CPU kernel has nothing to prefetch, yet every batch went through the stage.
    assert calls == [(None, True)] * len(batches)
    assert len(pipeline.rewrite_result.pipelined) == 1


def test_prefetch_kjt_inside_a_dict_and_two_epochs() -> None:
    batches = make_batches(4, seed=DATA_SEED, nested=True)
    ref = plain_loop_of(NestedDLRM, "column_wise", batches + batches, seed=SEED)
    dmp, optimizer = make_sharded(NestedDLRM, "column_wise", seed=SEED)
    pipeline = PrefetchTrainPipelineSparseDist(dmp, optimizer, DEVICE, rewrite_strategy="fx")
    first = run_pipeline(pipeline, batches, model=dmp)
    second = run_pipeline(pipeline, batches, model=dmp)  # a new epoch, no reset()
    ours = type(second)(list(first) + list(second), second.weights)
    assert_runs_equal(ref, ours, ("plain_loop", "two epochs"))


@devices.cpu_only("torchrec's class without a data_dist stream")
@pytest.mark.parametrize("shim", [False, True], ids=["plain", "shim"])
def test_torchrec_class_fails_on_cpu(shim: bool) -> None:
    """torchrec 1.8.0's PrefetchTrainPipelineSparseDist cannot train on CPU.

    Its fill runs the prefetch stage through ``prefetch_embeddings``, which
    returns at once when there is no data_dist stream (always the case on
    CPU): the batch's input is never moved to ``module_input_post_prefetch``
    and ``prefetch()`` is never called.  The first forward then finds nothing
    and its ``PrefetchPipelinedForward`` asserts.  The shim (no-op
    ``record_stream``, CPU ``current_stream``) changes nothing: no stream call
    is reached.
    """
    batches = make_batches(1, seed=DATA_SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    calls = count_prefetches(sharded_module(dmp))
    pipeline = upstream.PrefetchTrainPipelineSparseDist(dmp, optimizer, DEVICE)
    assert pipeline._data_dist_stream is None
    it = iter(batches)
    with torchrec_on_cpu() if shim else contextlib.nullcontext():
        pipeline.fill_pipeline(it)
        (context,) = pipeline.contexts
        # The prefetch stage ran and did nothing: the dist input is still pending.
        assert context.module_input_post_prefetch == {}
        assert list(context.input_dist_tensors_requests) == ["ebc"]
        assert calls == []
        with pytest.raises(AssertionError, match="Invalid PrefetchPipelinedForward usage"):
            pipeline.progress(it)
    # Finish the tensors all-to-all it left in flight, so the process group
    # can be torn down cleanly.
    for request in context.input_dist_tensors_requests.values():
        request.wait()
