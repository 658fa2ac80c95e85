"""SemiSync's dense backward leaves DDP's all-reduce in flight; the step waits for it.

The reference is torchrec's ``TrainPipelineSemiSync`` (DDP's own wait, at the
end of the backward): every step's output and the final weights must be
``torch.equal``.  Where DDP keeps its wait (a communication hook of the user's,
a subclass's own ``embedding_backward``) the pipeline must say so and still
train the same; a plain loop run on the model afterwards must train as DDP
does without the hook.
"""

from __future__ import annotations

from typing import Any, List

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipelineSemiSync as UpstreamSemiSync,
)

from tests.distributed.test_semi_sync import dense_only
from trec_pipelines.core.all_reduce_wait import AllReduceWait, NoAllReduceWait, all_reduce_wait
from trec_pipelines.pipelines.semi_sync import TrainPipelineSemiSync
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    Run,
    assert_runs_equal,
    make_batches,
    make_sharded,
    plain_loop,
    run_pipeline,
)
from trec_pipelines.testing.torchrec_cpu import torchrec_on_cpu

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 7
N_BATCHES = 7
KWARGS = dict(start_batch=2)


def _build() -> Any:
    dmp, _ = make_sharded(DLRM, "table_wise", seed=SEED)
    return dmp, dense_only(dmp)


def _torchrec_run(batches: List[Any]) -> Run:
    dmp, optimizer = _build()
    with torchrec_on_cpu():
        return run_pipeline(UpstreamSemiSync(dmp, optimizer, DEVICE, **KWARGS), batches)


def test_the_embedding_backward_runs_under_the_all_reduce_and_trains_as_torchrec() -> None:
    batches = make_batches(N_BATCHES, seed=DATA_SEED)
    theirs = _torchrec_run(batches)
    dmp, optimizer = _build()
    pipeline = TrainPipelineSemiSync(dmp, optimizer, DEVICE, **KWARGS)
    assert isinstance(pipeline._all_reduce, AllReduceWait)
    in_flight: List[int] = []
    embedding_backward = pipeline.embedding_backward

    def watched(context: Any) -> None:
        # What the dense backward left for the step to wait for.
        in_flight.append(len(pipeline._all_reduce._works))
        embedding_backward(context)

    pipeline.embedding_backward = watched  # type: ignore[method-assign]
    ours = run_pipeline(pipeline, batches)
    assert_runs_equal(theirs, ours, ("torchrec", "trec_pipelines"))
    assert len(in_flight) == N_BATCHES
    assert all(n >= 1 for n in in_flight), in_flight
    assert pipeline._all_reduce._works == []
    # A second pipeline on the model shares the hook (DDP takes one).
    assert all_reduce_wait(dmp, TrainPipelineSemiSync) is pipeline._all_reduce


def test_a_users_comm_hook_keeps_ddps_wait(caplog: Any) -> None:
    batches = make_batches(N_BATCHES, seed=DATA_SEED)
    theirs = _torchrec_run(batches)
    dmp, optimizer = _build()
    dmp._dmp_wrapped_module.register_comm_hook(None, allreduce_hook)
    with caplog.at_level("INFO", logger="trec_pipelines.core.all_reduce_wait"):
        pipeline = TrainPipelineSemiSync(dmp, optimizer, DEVICE, **KWARGS)
    assert isinstance(pipeline._all_reduce, NoAllReduceWait)
    assert "communication hook of its own" in caplog.text
    assert_runs_equal(theirs, run_pipeline(pipeline, batches), ("torchrec", "trec_pipelines"))


def test_a_subclass_with_its_own_embedding_backward_keeps_ddps_wait() -> None:
    calls: List[int] = []

    class Logged(TrainPipelineSemiSync):
        def embedding_backward(self, context: Any) -> None:
            calls.append(context.index)
            super().embedding_backward(context)

    batches = make_batches(N_BATCHES, seed=DATA_SEED)
    theirs = _torchrec_run(batches)
    dmp, optimizer = _build()
    pipeline = Logged(dmp, optimizer, DEVICE, **KWARGS)
    assert isinstance(pipeline._all_reduce, NoAllReduceWait)
    assert_runs_equal(theirs, run_pipeline(pipeline, batches), ("torchrec", "trec_pipelines"))
    assert calls == list(range(N_BATCHES))


def test_a_plain_loop_after_the_pipeline_trains_as_ddp_does() -> None:
    first = make_batches(4, seed=DATA_SEED)
    then = make_batches(4, seed=DATA_SEED + 1)
    hooked, hooked_optimizer = _build()
    ours = TrainPipelineSemiSync(hooked, hooked_optimizer, DEVICE, **KWARGS)
    run_pipeline(ours, first)
    ours.detach()
    plain, plain_optimizer = _build()
    with torchrec_on_cpu():
        theirs = UpstreamSemiSync(plain, plain_optimizer, DEVICE, **KWARGS)
        run_pipeline(theirs, first)
        theirs.detach()
    assert isinstance(all_reduce_wait(hooked, TrainPipelineSemiSync), AllReduceWait)
    assert_runs_equal(
        plain_loop(plain, plain_optimizer, then),
        plain_loop(hooked, hooked_optimizer, then),
        ("DDP's wait", "the hook outside a pipeline"),
    )


def test_the_all_reduce_is_not_deferred_outside_the_pipelines_backward() -> None:
    dmp, optimizer = _build()
    hook = all_reduce_wait(dmp, TrainPipelineSemiSync)
    assert isinstance(hook, AllReduceWait)
    batch = make_batches(1, seed=DATA_SEED)[0]
    optimizer.zero_grad()
    loss, _ = dmp(batch)
    torch.sum(loss, dim=0).backward()
    assert hook._works == []  # DDP waited for it, as without the hook
