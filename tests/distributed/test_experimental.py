"""torchrec's experimental pipelines, ours (trec_pipelines.experimental_pipelines),
against torchrec's same-named class and the plain loop on 2 ranks.

torchrec's experimental classes run on CPU where they need no CUDA stream of
their own: SparseDistT, BwdOpt and TrainEvalHybridPipelineBase do, and are the
oracle; where they differ from the plain loop by design (BwdOpt steps inside the
backward) torchrec's class is the only reference.
"""

from __future__ import annotations

import logging
from typing import Any, List

import pytest
import torch
import torch.distributed as dist
import torchrec.distributed.train_pipeline.experimental_pipelines as upstream
from torch.nn.parallel import DistributedDataParallel

import trec_pipelines
from trec_pipelines import experimental_pipelines
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    Run,
    assert_runs_equal,
    make_batches,
    make_sharded,
    plain_loop_with_eval_pass,
    run_pipeline,
    weights,
)
from trec_pipelines.testing.references import plain_loop_of

DEVICE = devices.device()
SEED, DATA_SEED, EVAL_SEED = 1234, 7, 8


def test_importable_from_the_root_and_from_the_module_named_like_upstream_s() -> None:
    for name in experimental_pipelines.__all__:
        assert getattr(trec_pipelines, name) is getattr(experimental_pipelines, name)
        assert issubclass(getattr(trec_pipelines, name), trec_pipelines.TrainPipelineSparseDist)


# ------------------------------------------------------------ SparseDistT


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
@pytest.mark.parametrize("sharding_type", ["table_wise", "column_wise", "data_parallel"])
def test_sparse_dist_t_equals_torchrec_and_the_plain_loop(
    sharding_type: str, inplace: bool
) -> None:
    batches = make_batches(seed=DATA_SEED)
    ref = plain_loop_of(DLRM, sharding_type, batches, seed=SEED)
    theirs = run_pipeline(
        upstream.TrainPipelineSparseDistT(
            *make_sharded(DLRM, sharding_type, seed=SEED),
            DEVICE,
            enable_inplace_copy_batch=inplace,
        ),
        batches,
    )
    dmp, optimizer = make_sharded(DLRM, sharding_type, seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDistT(
        dmp, optimizer, DEVICE, enable_inplace_copy_batch=inplace
    )
    ours = run_pipeline(pipeline, batches, model=dmp)
    assert_runs_equal(ref, theirs, ("plain_loop", "torchrec"))
    assert_runs_equal(ref, ours, ("plain_loop", "trec_pipelines"))
    # CPU: no device copy to issue, so no thread (logged); with streams, the worker.
    assert (pipeline._copy_worker is not None) == devices.on_gpu()


# ------------------------------------------------------------ BwdOpt


def _synchronous_ddp(dmp: torch.nn.Module) -> None:
    """Make every DDP all-reduce of ``dmp`` finish before the backward goes on.

    The in-backward step reads dense gradients that DDP (gradient_as_bucket_view,
    torchrec's default) all-reduces in place on another thread: two runs of
    torchrec's own class differ from the third step on.  With the reduction
    synchronous, both libraries are deterministic and can be compared.
    """

    def reduce_now(group, bucket):  # type: ignore[no-untyped-def]  # DDP reads the annotations
        buffer = bucket.buffer()
        dist.all_reduce(buffer, group=group)
        buffer.div_(dist.get_world_size(group))
        done: Any = torch.futures.Future()
        done.set_result(buffer)
        return done

    ddps = [m for m in dmp.modules() if isinstance(m, DistributedDataParallel)]
    assert ddps, "the test DLRM's dense part is DDP-wrapped"
    for ddp in ddps:
        ddp.register_comm_hook(ddp.process_group, reduce_now)


def _bwd_opt(side: Any, sharding: str, **kwargs: Any) -> Run:
    batches = make_batches(seed=DATA_SEED)
    dmp, optimizer = make_sharded(DLRM, sharding, seed=SEED)
    _synchronous_ddp(dmp)
    pipeline = side.TrainPipelineSparseDistBwdOpt(dmp, optimizer, DEVICE, "ebc", **kwargs)
    return run_pipeline(pipeline, batches, model=dmp)


@pytest.mark.parametrize("sharding_type", ["table_wise", "column_wise"])
def test_bwd_opt_equals_torchrec(sharding_type: str) -> None:
    """The step inside the backward sees the gradients as they are at that point
    (what autograd has not reached yet is not stepped), so this is not the plain
    loop; it is torchrec's, with DDP's all-reduce made synchronous in both."""
    from torchrec.distributed.types import ShardingType

    kind = ShardingType.TABLE_WISE if sharding_type == "table_wise" else ShardingType.COLUMN_WISE
    theirs = _bwd_opt(upstream, sharding_type, sharding_type=kind)
    ours = _bwd_opt(trec_pipelines, sharding_type, sharding_type=kind)
    assert_runs_equal(theirs, ours, ("torchrec", "trec_pipelines"))
    ref = plain_loop_of(DLRM, sharding_type, make_batches(seed=DATA_SEED), seed=SEED)
    assert not torch.equal(ref[-1], ours[-1])  # a different schedule indeed


def test_bwd_opt_recorded_step_runs_inside_the_backward() -> None:
    """The recorded schedule: each step's OptimizerStep starts after its Backward
    starts and ends before it ends (and SparseDist's runs after it)."""
    batches = make_batches(5, seed=DATA_SEED)
    for name in ("TrainPipelineSparseDistBwdOpt", "TrainPipelineSparseDist"):
        dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
        args = ("ebc",) if name.endswith("BwdOpt") else ()
        pipeline = getattr(trec_pipelines, name)(dmp, optimizer, DEVICE, *args)
        pipeline.enable_schedule_recording()
        run_pipeline(pipeline, batches, model=dmp)
        spans = {(a.task, a.batch): a for a in pipeline._recording.recorder.actions}
        for batch in range(5):
            step, backward = spans[("OptimizerStep", batch)], spans[("Backward", batch)]
            inside = backward.cpu_start < step.cpu_start and step.cpu_end < backward.cpu_end
            assert inside == name.endswith("BwdOpt"), (name, batch)


def test_bwd_opt_with_a_site_that_has_no_collective_says_so() -> None:
    """A data_parallel output dist is no collective: there is nothing to step at,
    and the first step says which site and what to pick instead (torchrec's class
    never steps the optimizer there, silently)."""
    from torchrec.distributed.types import ShardingType

    dmp, optimizer = make_sharded(DLRM, "data_parallel", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDistBwdOpt(
        dmp, optimizer, DEVICE, "ebc", sharding_type=ShardingType.DATA_PARALLEL
    )
    with pytest.raises(RuntimeError, match="found nothing to hook in the forward of 'ebc'"):
        pipeline.progress(iter(make_batches(4, seed=DATA_SEED)))


# ------------------------------------------------------------ TrainEvalHybrid


def test_hybrid_training_equals_torchrec_and_the_plain_loop() -> None:
    batches = make_batches(seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    theirs = run_pipeline(
        upstream.TrainEvalHybridPipelineBase(*make_sharded(DLRM, "table_wise", seed=SEED), DEVICE),
        batches,
    )
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    ours = run_pipeline(
        trec_pipelines.TrainEvalHybridPipelineBase(dmp, optimizer, DEVICE), batches, model=dmp
    )
    assert_runs_equal(ref, theirs, ("plain_loop", "torchrec"))
    assert_runs_equal(ref, ours, ("plain_loop", "trec_pipelines"))


def _train(pipeline: Any, it: Any, n: int) -> List[torch.Tensor]:
    return [pipeline.progress(it).detach().clone() for _ in range(n)]


def _drain(pipeline: Any, it: Any) -> List[torch.Tensor]:
    outputs = []
    while True:
        try:
            outputs.append(pipeline.progress(it).detach().clone())
        except StopIteration:
            return outputs


def test_hybrid_train_eval_train_equals_the_plain_loop_with_an_eval_pass() -> None:
    """Train 3 steps, evaluate a whole eval iterator in eval mode, train to the end:
    every train batch trained once, in order, and every eval batch evaluated once
    under no_grad, with the weights of step 3."""
    train, evaluation, at = make_batches(8, seed=DATA_SEED), make_batches(5, seed=EVAL_SEED), 3
    ref_first, ref_eval, ref_rest = plain_loop_with_eval_pass(
        *make_sharded(DLRM, "table_wise", seed=SEED), train, evaluation, at
    )
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainEvalHybridPipelineBase(dmp, optimizer, DEVICE)
    train_it = iter(train)
    first = _train(pipeline, train_it, at)
    dmp.eval()
    evaluated = _drain(pipeline, iter(evaluation))
    dmp.train()
    rest = _drain(pipeline, train_it)
    assert_runs_equal(
        Run(list(ref_first) + list(ref_rest), ref_rest.weights),
        Run(first + rest, weights(dmp)),
        ("plain loop", "hybrid"),
    )
    assert len(evaluated) == len(ref_eval)
    for step, (want, got) in enumerate(zip(ref_eval, evaluated, strict=True)):
        assert torch.equal(want, got), f"eval step {step}"
        assert not got.requires_grad  # under no_grad


@pytest.mark.parametrize("name", ["TrainEvalHybridPipelineBase", "TrainPipelineSparseDist"])
def test_hybrid_eval_forward_runs_under_no_grad(name: str) -> None:
    """The hybrid's eval forward builds no autograd graph; SparseDist's keeps it
    (as torchrec's SparseDist does), which is what the hybrid changes."""
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = getattr(trec_pipelines, name)(dmp, optimizer, DEVICE)
    grad_enabled: List[bool] = []
    dmp.module.over_arch.register_forward_hook(
        lambda *_: grad_enabled.append(torch.is_grad_enabled())
    )
    dmp.train()
    pipeline.progress(it := iter(make_batches(6, seed=EVAL_SEED)))
    dmp.eval()
    pipeline.progress(it)
    assert grad_enabled == [True, name != "TrainEvalHybridPipelineBase"]


# ------------------------------------------------------------ the stash variants


class RecordingStashing(trec_pipelines.sparse.stashing.Stashing):
    """Stands in for torchrec's MemoryStashingManager: logs each call, in order."""

    def __init__(self, log: List[str], enabled: bool = True) -> None:
        self.log = log
        self.enabled = enabled
        self._restore_started = False

    def set_delay_stash(self, delay: bool) -> None:
        self.log.append(f"delay={delay}")

    def execute_pending_stashes(self) -> None:
        self.log.append("execute_pending")

    def restore_embedding_weights(self) -> None:
        self.log.append("restore_weights")

    def restore_cache(self) -> None:
        self.log.append("restore_cache")

    def start_optimizer_restore(self) -> None:
        self._restore_started = True
        self.log.append("restore_start")

    def finish_optimizer_restore(self) -> bool:
        started, self._restore_started = self._restore_started, False
        self.log.append("restore_done" if started else "restore_now")
        return started

    def finish_optimizer_stash(self) -> None:
        self.log.append("stash_issued")

    def start_optimizer_stash(self, optimizer: torch.optim.Optimizer) -> None:
        self.log.append("stash_start")


class LoggedStep:
    """Wraps an optimizer so its step (and zero_grad) appear in the log."""

    def __init__(self, optimizer: Any, log: List[str]) -> None:
        self._optimizer, self._log = optimizer, log

    def step(self, *args: Any, **kwargs: Any) -> Any:
        self._log.append("step")
        return self._optimizer.step(*args, **kwargs)

    def zero_grad(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.zero_grad(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


STASH_VARIANTS = {
    "TrainPipelineSparseDistOptStash": {"site_fqn": "ebc"},
    "TrainPipelineSparseDistEmbStash": {"site_fqn": "over_arch"},
    "TrainPipelinePrefetchEMS": {"site_fqn": "over_arch"},
}


@pytest.mark.parametrize("name", sorted(STASH_VARIANTS))
@pytest.mark.parametrize("sharding_type", ["table_wise", "column_wise"])
def test_stash_variant_trains_as_the_plain_loop(name: str, sharding_type: str) -> None:
    """On CPU nothing is stashed (the tables and the optimizer state are in host
    memory already): the schedule with its stash points equals the plain loop."""
    batches = make_batches(seed=DATA_SEED)
    ref = plain_loop_of(DLRM, sharding_type, batches, seed=SEED)
    from torchrec.distributed.types import ShardingType

    dmp, optimizer = make_sharded(DLRM, sharding_type, seed=SEED)
    kwargs = dict(STASH_VARIANTS[name])
    if name == "TrainPipelineSparseDistOptStash":  # its site's output dist
        kwargs["sharding_type"] = ShardingType(sharding_type)
    pipeline = getattr(trec_pipelines, name)(dmp, optimizer, DEVICE, **kwargs)
    assert pipeline._stashing.enabled == devices.on_gpu()
    ours = run_pipeline(pipeline, batches, model=dmp)
    assert_runs_equal(ref, ours, ("plain_loop", name))


@devices.cpu_only("torchrec's stash classes make a CUDA stream in their constructor")
@pytest.mark.parametrize("name", sorted(STASH_VARIANTS))
def test_torchrec_stash_classes_do_not_run_on_cpu(name: str) -> None:
    """Why the plain loop is the oracle above: torchrec's own classes can't be built."""
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    with pytest.raises((RuntimeError, AssertionError, AttributeError, TypeError, ValueError)):
        getattr(upstream, name)(dmp, optimizer, DEVICE, **STASH_VARIANTS[name])


def _logged_run(name: str, steps: int, **kwargs: Any) -> List[str]:
    log: List[str] = []
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = getattr(trec_pipelines, name)(
        dmp, LoggedStep(optimizer, log), DEVICE, **{**STASH_VARIANTS[name], **kwargs}
    )
    pipeline._stashing = RecordingStashing(log)
    dmp.module.over_arch.register_forward_hook(lambda *_: log.append("over_arch forward"))
    dmp.module.over_arch.register_full_backward_hook(lambda *_: log.append("over_arch backward"))
    it = iter(make_batches(steps, seed=DATA_SEED))
    for step in range(steps):
        log.append(f"-- step {step}")
        pipeline.progress(it)
    return log


def test_opt_stash_restores_inside_the_backward_and_stashes_after_the_step() -> None:
    log = _logged_run("TrainPipelineSparseDistOptStash", 2)
    one_step = [
        "over_arch forward",
        "stash_issued",  # the previous step's stash, before this backward restores
        "over_arch backward",
        "restore_start",  # at ebc's output dist: after the dense top's backward
        "restore_done",
        "step",
        "stash_start",
    ]
    assert log == ["-- step 0", *one_step, "-- step 1", *one_step]


def test_opt_stash_restores_before_the_step_when_the_backward_did_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log: List[str] = []
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDistOptStash(
        dmp, LoggedStep(optimizer, log), DEVICE, "ebc"
    )
    pipeline._stashing = RecordingStashing(log)
    pipeline._restore_now = lambda: None  # the site's hook runs, but starts nothing
    with caplog.at_level(logging.WARNING):
        pipeline.progress(iter(make_batches(3, seed=DATA_SEED)))
    assert log == ["stash_issued", "restore_now", "step", "stash_start"]
    assert "restored before the step instead" in caplog.text


@pytest.mark.parametrize("delay", ["no", "backward", "stash_site"])
def test_emb_stash_restores_at_its_site_and_runs_delayed_stashes_where_asked(delay: str) -> None:
    kwargs: Any = {
        "no": {},
        "backward": {"delay_stash": True},
        "stash_site": {"delay_stash": True, "stash_site_fqn": "over_arch"},
    }[delay]
    log = _logged_run("TrainPipelineSparseDistEmbStash", 2, **kwargs)
    forward = (
        ["execute_pending", "over_arch forward"] if delay == "stash_site" else ["over_arch forward"]
    )
    # PARAM_GRAD at over_arch's first parameter: once its gradient is complete.
    backward = (
        ["execute_pending", "restore_weights"] if delay == "backward" else ["restore_weights"]
    )
    one_step = [*forward, *backward, "over_arch backward", "step"]
    assert log == ["-- step 0", *one_step, "-- step 1", *one_step]


def test_prefetch_ems_restores_cur_and_prefetches_nxt_before_the_backward() -> None:
    """The order of the restores and the prefetch, with the ebc taken for a module
    that has a cache (its plain fused tables have none, and are left out of the
    prefetch otherwise: see the test after this one)."""
    from unittest import mock

    from trec_pipelines.pipelines import prefetch_ems

    log: List[str] = []
    prefetched: List[int] = []
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelinePrefetchEMS(
        dmp, LoggedStep(optimizer, log), DEVICE, "over_arch"
    )
    pipeline._stashing = RecordingStashing(log)
    ebc = dmp.module.ebc
    real_prefetch = ebc.prefetch

    def prefetch(*args: Any, **kwargs: Any) -> Any:
        prefetched.append(pipeline.contexts[1].index)
        log.append("prefetch")
        return real_prefetch(*args, **kwargs)

    ebc.prefetch = prefetch
    batches = make_batches(4, seed=DATA_SEED)
    with mock.patch.object(prefetch_ems, "reads_a_cache", lambda module: True):
        ours = run_pipeline(pipeline, batches, model=dmp)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    assert_runs_equal(ref, ours, ("plain_loop", "PrefetchEMS"))
    # cur's weights and caches, then nxt's rows; the site's own restore in the backward.
    steady = ["restore_weights", "restore_cache", "prefetch", "restore_weights", "step"]
    last = ["restore_weights", "restore_cache", "restore_weights", "step"]
    assert log == steady * 3 + last
    assert prefetched == [1, 2, 3]


# ------------------------------------------------------------ EvalPipelineCPUSparse


def _plain_eval(batches: List[Any]) -> List[torch.Tensor]:
    dmp, _ = make_sharded(DLRM, "data_parallel", seed=SEED)
    dmp.eval()
    with torch.no_grad():
        return [dmp(batch)[1] for batch in batches]


@pytest.mark.parametrize("multi_thread", [False, True], ids=["inline", "thread"])
@pytest.mark.parametrize("depth", [1, 2])
def test_cpu_sparse_eval_equals_the_plain_eval_loop(depth: int, multi_thread: bool) -> None:
    """Tables data_parallel on the host: every batch evaluated once, in order, each
    output equal to the model's own eval forward; two epochs without reset()."""
    batches = make_batches(7, seed=EVAL_SEED)
    want = _plain_eval(batches)
    dmp, optimizer = make_sharded(DLRM, "data_parallel", seed=SEED)
    dmp.eval()
    pipeline = trec_pipelines.EvalPipelineCPUSparse(
        dmp, optimizer, DEVICE, pipeline_depth=depth, multi_thread=multi_thread
    )
    for epoch in range(2):
        got = _drain(pipeline, iter(batches))
        assert len(got) == len(want), f"epoch {epoch}"
        for step, (w, g) in enumerate(zip(want, got, strict=True)):
            assert torch.equal(w, g), f"epoch {epoch} step {step}"
    (pipelined,) = pipeline.rewrite_result.pipelined
    assert pipelined.name == "ebc"


def test_cpu_sparse_eval_refuses_another_depth() -> None:
    dmp, optimizer = make_sharded(DLRM, "data_parallel", seed=SEED)
    with pytest.raises(ValueError, match="pipeline_depth must be 1 or 2, got 3"):
        trec_pipelines.EvalPipelineCPUSparse(dmp, optimizer, DEVICE, pipeline_depth=3)


def test_cpu_sparse_eval_schedule() -> None:
    """Depth 2, recorded: call k evaluates batch k, copies k+1, then runs the host
    stage of k+2 (the fill, in call 0, runs 0's and 1's host stage and copies 0)."""
    dmp, optimizer = make_sharded(DLRM, "data_parallel", seed=SEED)
    dmp.eval()
    pipeline = trec_pipelines.EvalPipelineCPUSparse(dmp, optimizer, DEVICE)
    pipeline.enable_schedule_recording()
    assert len(_drain(pipeline, iter(make_batches(5, seed=EVAL_SEED)))) == 5
    rows = {(task, stream): cells for task, stream, cells in pipeline.schedule()}
    assert rows[("Forward", "default")] == [0, 1, 2, 3, 4]
    assert rows[("H2D", "memcpy")][:4] == [(0, 1), 2, 3, 4]
    assert rows[("EmbLookup", "default")][:4] == [(0, 1, 2), 3, 4, None]


@devices.cpu_only("torchrec's class pins host memory, which needs a GPU")
def test_torchrec_cpu_sparse_eval_does_not_run_on_cpu() -> None:
    dmp, optimizer = make_sharded(DLRM, "data_parallel", seed=SEED)
    dmp.eval()
    pipeline = upstream.EvalPipelineCPUSparse(dmp, optimizer, DEVICE)
    with pytest.raises(RuntimeError):
        pipeline.progress(iter(make_batches(3, seed=EVAL_SEED)))


# ------------------------------------------------------------ what a stash moves


def _local_weight_bytes(dmp: torch.nn.Module, tables: List[str]) -> int:
    """This rank's shards of ``tables``, from the sharded state dict (not the kernels)."""
    total = 0
    for key, value in dmp.state_dict().items():
        table = key.split(".")[-2] if key.endswith(".weight") else None
        if table in tables and hasattr(value, "local_shards"):
            for shard in value.local_shards():
                total += shard.tensor.numel() * shard.tensor.element_size()
    return total


@pytest.mark.parametrize("name", ["TrainPipelineSparseDistEmbStash", "TrainPipelinePrefetchEMS"])
@pytest.mark.parametrize("sharding_type", ["table_wise", "column_wise"])
def test_emb_stash_plan_is_the_local_shards_of_the_marked_tables(
    name: str, sharding_type: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every table marked ``stash_weights``: the plan is this rank's shards of all of
    them (their kernels hold nothing else), reported once at the first step."""
    import dataclasses
    from unittest import mock

    from trec_pipelines.testing import dlrm

    # The tests' DLRM is built from dlrm.TESTS_SPEC: the same shapes, every table marked.
    spec = dataclasses.replace(dlrm.TESTS_SPEC, stash_weights=True)
    marked = spec.table_configs()
    assert marked and all(t.stash_weights for t in marked)
    with mock.patch.object(dlrm, "TESTS_SPEC", spec):
        dmp, optimizer = make_sharded(DLRM, sharding_type, seed=SEED)
    pipeline = getattr(trec_pipelines, name)(dmp, optimizer, DEVICE, **STASH_VARIANTS[name])
    names = [t.name for t in marked]
    expected = _local_weight_bytes(dmp, names)
    assert expected > 0
    plan = pipeline.stash_plan()
    assert plan.embedding_weight_bytes == expected
    assert sorted(set(plan.embedding_tables)) == sorted(
        t for t in names if _local_weight_bytes(dmp, [t]) > 0
    )
    assert (plan.optimizer_state_bytes, plan.moved) == (0, devices.on_gpu())
    with caplog.at_level(logging.INFO, logger="trec_pipelines.sparse.stashing"):
        run_pipeline(pipeline, make_batches(3, seed=DATA_SEED), model=dmp)
    said = [r for r in caplog.records if r.name == "trec_pipelines.sparse.stashing"]
    assert len(said) == 1 and said[0].levelno == logging.INFO, said
    assert f"{expected / 2**20:.2f} MiB of embedding weights" in said[0].getMessage()


def test_emb_stash_with_no_marked_table_says_it_stashes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """torchrec's class trains as SparseDist without a word when no table is marked."""
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDistEmbStash(
        dmp, optimizer, DEVICE, site_fqn="over_arch"
    )
    assert pipeline.stash_plan().total_bytes == 0
    with caplog.at_level(logging.WARNING, logger="trec_pipelines.sparse.stashing"):
        run_pipeline(pipeline, make_batches(2, seed=DATA_SEED), model=dmp)
    warned = [r.getMessage() for r in caplog.records if r.name == "trec_pipelines.sparse.stashing"]
    assert len(warned) == 1 and "stash_weights=True" in warned[0], warned


def test_opt_stash_plan_is_the_large_plain_optimizer_state(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The bench recipe's optimizer (fused embedding state + Adagrad over a small
    dense part) gives the manager nothing; an Adam state of 1 MiB or more it takes."""
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDistOptStash(
        dmp, optimizer, DEVICE, site_fqn="ebc"
    )
    with caplog.at_level(logging.WARNING, logger="trec_pipelines.sparse.stashing"):
        run_pipeline(pipeline, make_batches(2, seed=DATA_SEED), model=dmp)
    assert pipeline.stash_plan().total_bytes == 0
    warned = [r.getMessage() for r in caplog.records if r.name == "trec_pipelines.sparse.stashing"]
    assert len(warned) == 1 and "1 MiB or more" in warned[0], warned

    big = torch.nn.Parameter(torch.zeros(512, 1024, device=DEVICE))  # 2 MiB
    small = torch.nn.Parameter(torch.zeros(16, device=DEVICE))
    adam = torch.optim.Adam([big, small])
    (big.sum() + small.sum()).backward()
    adam.step()  # Adam makes its state at the first step
    plan = trec_pipelines.sparse.stashing.plan_stash(
        trec_pipelines.sparse.stashing.Stashing(), optimizer=adam
    )
    # exp_avg and exp_avg_sq of ``big``; ``small``'s and the step counters stay.
    assert (plan.optimizer_state_bytes, plan.optimizer_state_tensors) == (2 * 2 * 2**20, 2)


def test_prefetch_ems_leaves_modules_without_a_cache_out_of_its_prefetch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The DLRM's tables are plain fused ones, with no cache to fill: the next batch's
    input dist is not waited for before the backward (it stays an awaitable in flight,
    as in SparseDist), and the results are the plain loop's."""
    from torchrec.distributed.types import NoWait

    batches = make_batches(seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelinePrefetchEMS(dmp, optimizer, DEVICE, "over_arch")
    it = iter(batches)
    outputs = []
    with caplog.at_level(logging.INFO, logger="trec_pipelines.pipelines.prefetch_ems"):
        while True:
            try:
                outputs.append(pipeline.progress(it).detach().clone())
            except StopIteration:
                break
            if len(outputs) == 1:
                in_flight = pipeline.contexts[0].input_dist_tensors_requests
                assert in_flight, "no input dist in flight for the next batch"
                assert not any(isinstance(r, NoWait) for r in in_flight.values()), in_flight
    assert any("reads no cache" in r.getMessage() for r in caplog.records), caplog.records
    ours = Run(outputs, weights(dmp))
    assert_runs_equal(ref, ours, ("plain_loop", "TrainPipelinePrefetchEMS"))
