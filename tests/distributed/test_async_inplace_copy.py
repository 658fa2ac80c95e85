"""``async_inplace_copy`` on 2 gloo ranks: the plain loop, and torchrec 1.9.2's classes.

On CPU torchrec logs the flag and copies synchronously, and so do we; what is
checked here is that the flag, alone or with ``enable_inplace_copy_batch``,
changes nothing in what is trained: every step's output and the final weights
are ``torch.equal`` to the plain loop's and, where torchrec has the flag
(1.9.2) and its class runs on CPU (SparseDist, Lite), to torchrec's run with
the same arguments.  The stream protocol of the worker thread is checked in
``tests/unit/test_stream_protocol.py``.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict

import pytest
import torchrec.distributed.train_pipeline.train_pipelines as upstream

import trec_pipelines
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    assert_runs_equal,
    make_batches,
    make_sharded,
    run_pipeline,
)
from trec_pipelines.testing.references import plain_loop_of

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 7

# torchrec's Prefetch fails on CPU (see test_prefetch.py): the plain loop is its only oracle.
RUNS_ON_CPU_UPSTREAM = {"TrainPipelineSparseDist", "TrainPipelineSparseDistLite"}


def upstream_has_flag(name: str) -> bool:
    return "async_inplace_copy" in inspect.signature(getattr(upstream, name).__init__).parameters


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("async_copy", [False, True])
@pytest.mark.parametrize(
    "name",
    ["TrainPipelineSparseDist", "TrainPipelineSparseDistLite", "PrefetchTrainPipelineSparseDist"],
)
def test_async_inplace_copy_trains_identically(name: str, async_copy: bool, inplace: bool) -> None:
    batches = make_batches(seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    kwargs: Dict[str, Any] = dict(enable_inplace_copy_batch=inplace, async_inplace_copy=async_copy)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = getattr(trec_pipelines, name)(dmp, optimizer, DEVICE, **kwargs)
    ours = run_pipeline(pipeline, batches, model=dmp)
    assert len(ref) == len(batches)
    assert_runs_equal(ref, ours, ("plain_loop", "trec_pipelines"))
    if name in RUNS_ON_CPU_UPSTREAM and upstream_has_flag(name):
        theirs_cls = getattr(upstream, name)
        theirs = run_pipeline(
            theirs_cls(*make_sharded(DLRM, "table_wise", seed=SEED), DEVICE, **kwargs), batches
        )
        assert_runs_equal(theirs, ours, ("torchrec", "trec_pipelines"))
