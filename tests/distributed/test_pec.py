"""TrainPipelinePEC against the plain loop and, on torchrec >= 1.9, torchrec's class.

The model's sharded modules are EmbeddingBagCollections, so the pipeline runs
its lookup-ahead schedule with the PEC verbs doing nothing (CPU has no PEC
module path to compare); every step's output and the final weights must be
``torch.equal`` across the runs.  torchrec 1.8.0 has no TrainPipelinePEC: the
plain loop is then the only oracle.

torchrec 1.9.2's class needs the test shim on CPU, plus CPU stand-ins for the
two ``torch.cuda.Event`` s it records (recording one on CPU raises).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Optional

import pytest
import torch

import trec_pipelines
from tests.distributed.dlrm import (
    DLRM,
    SHARDING_TYPES,
    NestedDLRM,
    assert_runs_equal,
    make_batches,
    make_sharded,
    plain_loop,
    run_pipeline,
)
from tests.distributed.torchrec_shim import shim_active, torchrec_on_cpu

CPU = torch.device("cpu")
SEED, DATA_SEED = 1234, 7
UPSTREAM_MODULE = "torchrec.distributed.train_pipeline.pec_train_pipeline"


class _CpuEvent:
    """Stands in for the torch.cuda.Event torchrec's PEC pipeline records: CPU work is in order."""

    def record(self, stream: Optional[Any] = None) -> None:
        return None


def torchrec_pec(model: torch.nn.Module, optimizer: Any) -> Optional[Any]:
    """torchrec's TrainPipelinePEC made runnable on CPU, or None where torchrec has none."""
    if importlib.util.find_spec(UPSTREAM_MODULE) is None:
        return None
    pipeline = importlib.import_module(UPSTREAM_MODULE).TrainPipelinePEC(model, optimizer, CPU)
    pipeline._input_dist_event = _CpuEvent()
    pipeline._overlap_dist_event = _CpuEvent()
    return pipeline


class _OursRunsUnshimmed:
    """Wraps our pipeline so that each step checks the shim is off."""

    def __init__(self, pipeline: Any) -> None:
        self._pipeline = pipeline
        self._model = pipeline._model

    def progress(self, it: Any) -> Any:
        assert not shim_active()
        return self._pipeline.progress(it)


@pytest.mark.parametrize("factory", [DLRM, NestedDLRM], ids=["flat", "nested"])
@pytest.mark.parametrize("sharding_type", SHARDING_TYPES)
def test_pec_matches_torchrec_and_plain_loop(sharding_type: str, factory: Any) -> None:
    batches = make_batches(seed=DATA_SEED, nested=factory is NestedDLRM)
    ref = plain_loop(*make_sharded(factory, sharding_type, seed=SEED), batches)
    dmp, optimizer = make_sharded(factory, sharding_type, seed=SEED)
    pipeline = trec_pipelines.TrainPipelinePEC(dmp, optimizer, CPU)
    ours = run_pipeline(_OursRunsUnshimmed(pipeline), batches, model=dmp)
    assert len(ref) == len(batches)
    assert_runs_equal(ref, ours, ("plain_loop", "trec_pipelines"))
    assert pipeline.rewrite_result is not None and pipeline.rewrite_result.pipelined
    theirs_pipeline = torchrec_pec(*make_sharded(factory, sharding_type, seed=SEED))
    if theirs_pipeline is not None:
        with torchrec_on_cpu():
            theirs = run_pipeline(theirs_pipeline, batches)
        assert_runs_equal(theirs, ours, ("torchrec", "trec_pipelines"))


def test_pec_second_epoch_without_reset() -> None:
    """A second epoch on the same pipeline, without reset(): as two epochs of the plain loop."""
    batches = make_batches(seed=DATA_SEED)
    ref_model, ref_opt = make_sharded(DLRM, "table_wise", seed=SEED)
    ref = plain_loop(ref_model, ref_opt, batches)
    ref2 = plain_loop(ref_model, ref_opt, batches)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelinePEC(dmp, optimizer, CPU)
    first = run_pipeline(pipeline, batches, model=dmp)
    second = run_pipeline(pipeline, batches, model=dmp)
    assert_runs_equal(ref, first, ("plain_loop", "epoch 1"))
    assert_runs_equal(ref2, second, ("plain_loop", "epoch 2"))
