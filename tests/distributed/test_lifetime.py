"""The package's process groups are released whole: destroyed, and their gloo threads gone.

See [Note: a clean exit] in trec_pipelines/core/lifetime.py.  The exit itself
is measured by tests/soak/exit_soak.py (many 2-rank runs under torchrun);
here, on 2 gloo ranks, what the exit hook does is called directly.
"""

from __future__ import annotations

import gc
import time
from typing import Set

import pytest
import torch
import torch.distributed as dist

import trec_pipelines
from tests.distributed.threads import thread_ids_named
from trec_pipelines.core import input_dist_group as idg, lifetime
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    assert_runs_equal,
    current_group,
    make_batches,
    make_sharded,
    run_pipeline,
)
from trec_pipelines.testing.references import plain_loop_of

DEVICE = devices.device()
SEED, DATA_SEED = 77, 3

pytestmark = pytest.mark.skipif(
    devices.on_gpu(), reason="counts gloo's threads; the model's groups are NCCL on GPU"
)


def gloo_workers() -> Set[int]:
    """The ids of the gloo worker threads this process runs (two per gloo group).

    The tests compare the ids of the threads they made, not counts: an earlier
    test's groups may leave threads that are still ending when a test starts."""
    return thread_ids_named("pt_gloo_runloop")


def still_listed(workers: Set[int], timeout_s: float = 5.0) -> Set[int]:
    """Those of ``workers`` still listed once none is, or ``timeout_s`` has passed
    (a hang guard): a joined thread leaves the list when the kernel removes it,
    not always before the next line runs."""
    deadline = time.monotonic() + timeout_s
    left = workers & gloo_workers()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = workers & gloo_workers()
    return left


def test_release_all_destroys_the_groups_and_joins_their_threads() -> None:
    """The dedicated input-dist group and the agreement group, made by a pipeline
    that is still alive, are destroyed and their threads joined."""
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    lifetime.release_all()  # what earlier tests' pipelines left registered
    gc.collect()  # and the groups they left to the collector
    before = gloo_workers()
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE, sync_exhaustion=True)
    run_pipeline(pipeline, make_batches(4, seed=DATA_SEED), model=dmp)
    assert pipeline._agreement is not None
    agreed = pipeline._agreement.group
    dedicated = idg.dedicated_of(current_group())
    assert agreed is not None and dedicated is not None
    assert lifetime.is_owned(agreed) and lifetime.is_owned(dedicated)
    made = gloo_workers() - before
    assert len(made) == 4, made  # two groups, two workers each
    del agreed, dedicated
    released = lifetime.release_all()
    assert released["groups"] == 2, released
    assert not still_listed(made)
    assert not gloo_workers() - before
    assert idg.dedicated_of(current_group()) is None
    # The pipeline, still attached, says what happened rather than using a dead group.
    with pytest.raises(RuntimeError, match="was released"):
        pipeline.progress(iter(make_batches(2, seed=DATA_SEED)))
    dist.barrier(group=current_group())


def test_a_detached_pipeline_makes_new_groups_after_a_release() -> None:
    """release_input_dist_groups() then detach() and attach(): the pipeline makes a
    new dedicated group and trains on as the plain loop does."""
    batches = make_batches(6, seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    it = iter(batches)
    outputs = [pipeline.progress(it).detach().clone() for _ in range(2)]
    first = idg.dedicated_of(current_group())
    assert first is not None
    del first
    assert idg.release_input_dist_groups(current_group()) == 1
    pipeline.detach()
    pipeline.attach()
    second = idg.dedicated_of(current_group())
    assert second is not None and set(pipeline._pipelined.fusion.groups.values()) == {second}
    del second
    rest = run_pipeline(pipeline, it, model=dmp)
    assert_runs_equal(ref, type(rest)(outputs + list(rest), rest.weights))


def test_a_collected_pipelines_agreement_group_goes_at_the_next_pipeline() -> None:
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    gc.collect()  # the groups earlier tests left to the collector
    lifetime.release_orphans()  # and those of their collected pipelines
    before = gloo_workers()
    pipeline = trec_pipelines.TrainPipelineBase(dmp, optimizer, DEVICE, sync_exhaustion=True)
    run_pipeline(pipeline, make_batches(2, seed=DATA_SEED), model=dmp)
    made = gloo_workers() - before
    assert len(made) == 2, made
    del pipeline
    gc.collect()
    trec_pipelines.TrainPipelineBase(dmp, optimizer, DEVICE, sync_exhaustion=False)
    assert not still_listed(made)
    assert not gloo_workers() - before
    torch.distributed.barrier(group=current_group())
