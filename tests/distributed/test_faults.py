"""Issue #16 on 2 gloo ranks: a failure never wedges a pipeline.

Every run is compared with the plain loop that sees the same batches: after a
fault injected at any point of a step, the plain loop retries the batch, and
the pipeline's next progress() does the same.
"""

from __future__ import annotations

import contextlib
import gc
import os
from datetime import timedelta
from typing import Any, Callable, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.train_pipeline.gradient_accumulation import (
    GradientAccumulationConfig,
    GradientAccumulationWrapper,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import trec_pipelines
from tests.fault_injection import FailingBackward, Fault
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    FEATURES,
    Batch,
    Run,
    _snapshot,
    assert_runs_equal,
    current_group,
    make_batches,
    make_sharded,
    plain_loop,
    plain_loop_with_eval_pass,
    run_pipeline,
    weights,
)
from trec_pipelines.testing.references import kept, plain_loop_of

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 11


class FaultyDLRM(DLRM):
    """DLRM that raises at its forward call number ``at`` (every attempt counts):
    ``where`` is "before_lookup", "after_lookup" (in the over-arch, once the
    embeddings arrived) or "backward"; only on ``ranks`` (every rank if None).
    ``reached``, when set, is called on every rank once that call's embeddings
    arrived (where "after_lookup" raises)."""

    def __init__(self, where: str = "", at: int = -1, ranks: Optional[tuple] = None) -> None:
        super().__init__()
        self.where, self.at, self.ranks = where, at, ranks
        self.calls = 0
        self.reached: Optional[Callable[[], None]] = None

    def forward(self, batch: Batch) -> Any:
        if torch.fx._symbolic_trace.is_fx_tracing():
            return super().forward(batch)
        call, self.calls = self.calls, self.calls + 1
        fail = call == self.at and (self.ranks is None or dist.get_rank() in self.ranks)
        if fail and self.where == "before_lookup":
            raise Fault("injected before the lookup")
        pooled = self.ebc(batch.sparse)
        by_name = pooled.to_dict()  # waits for the embeddings
        if call == self.at and self.reached is not None:
            self.reached()
        if fail and self.where == "after_lookup":
            raise Fault("injected in the over-arch")
        x = torch.cat([self.dense_arch(batch.dense)] + [by_name[f] for f in FEATURES], dim=1)
        logits = self.over_arch(x).squeeze(-1)
        if fail and self.where == "backward":
            logits = FailingBackward.apply(logits)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


class FaultyOptimizer:
    """Wraps an optimizer; its step number ``at`` raises before stepping."""

    def __init__(self, optimizer: Any, at: int) -> None:
        self._optimizer, self.at, self.steps = optimizer, at, 0

    def step(self, *args: Any, **kwargs: Any) -> Any:
        call, self.steps = self.steps, self.steps + 1
        if call == self.at:
            raise Fault("injected in the optimizer")
        return self._optimizer.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def _build(
    where: str, at: int, ranks: Optional[tuple] = None, pg: Optional[dist.ProcessGroup] = None
) -> Any:
    model_at = at if where != "optimizer" else -1
    dmp, optimizer = make_sharded(
        lambda: FaultyDLRM(where, model_at, ranks), "table_wise", seed=SEED, pg=pg
    )
    return dmp, FaultyOptimizer(optimizer, at if where == "optimizer" else -1)


def plain_loop_with_retry(model: Any, optimizer: Any, batches: List[Any]) -> Run:
    model.train()
    outputs = []
    for batch in batches:
        while True:
            try:
                optimizer.zero_grad()
                loss, out = model(batch)
                torch.sum(loss, dim=0).backward()
                optimizer.step()
            except Fault:
                continue
            outputs.append(_snapshot(out))
            break
    return Run(outputs, weights(model))


def plain_loop_with_retry_of(where: str, at: int, batches: List[Any]) -> Run:
    """``plain_loop_with_retry(*_build(where, at), batches)``, trained once per run for
    the same inputs (a test parametrized over the pipelines meets the same fault in
    each; see [Note: one reference per input] in trec_pipelines/testing/references.py)."""
    return kept(
        f"{__name__}.plain_loop_with_retry:FaultyDLRM;table_wise;{SEED}",
        (where, at, batches),
        lambda: plain_loop_with_retry(*_build(where, at), batches),
    )


def train_noting_faults(pipeline: Any, batches: List[Any], model: Any) -> Tuple[Run, List[str]]:
    """Train ``batches``, calling ``progress()`` again after each injected fault
    (each must say the batch is retried); the run and the faults' messages (their
    first lines), in order."""
    it = iter(batches)
    outputs = []
    faults: List[str] = []
    while True:
        try:
            outputs.append(_snapshot(pipeline.progress(it)))
        except StopIteration:
            break
        except Fault as error:
            assert "retries batch" in "".join(error.__notes__), error.__notes__
            # The fault's own message: on Python 3.10 the notes follow it in str(error).
            faults.append(str(error).splitlines()[0])
    return Run(outputs, weights(model)), faults


def train_with_retry(pipeline: Any, batches: List[Any], model: Any) -> Run:
    run, faults = train_noting_faults(pipeline, batches, model)
    assert len(faults) == 1, faults
    return run


def _pipeline(name: str, dmp: Any, optimizer: Any, **kwargs: Any) -> Any:
    # SemiSync stays synchronous (start_batch past the data): the plain loop is its oracle.
    extra = {"start_batch": 100} if name == "TrainPipelineSemiSync" else {}
    return getattr(trec_pipelines, name)(dmp, optimizer, DEVICE, **extra, **kwargs)


def _eval_pipeline(name: str, dmp: Any) -> Any:
    """An eval pipeline of ``EVAL_VARIANTS`` (``Class+thread``: with its loader thread)."""
    cls_name, _, mode = name.partition("+")
    thread = {"loader_thread": True} if mode == "thread" else {}
    return getattr(trec_pipelines, cls_name)(dmp, None, DEVICE, **thread)


VARIANTS = [
    "TrainPipelineSparseDist",
    "TrainPipelineSemiSync",
    "TrainPipelineFusedSparseDist",
    "PrefetchTrainPipelineSparseDist",
    "TrainPipelineSparseDistLite",
    "TrainPipelineBase",
    "TrainPipelinePEC",  # a DLRM of EmbeddingBagCollections: its PEC verbs do nothing
]


@pytest.mark.parametrize("where", ["before_lookup", "after_lookup", "backward", "optimizer"])
@pytest.mark.parametrize("name", VARIANTS)
def test_fault_in_a_step_is_retried_and_training_equals_the_plain_loop(
    name: str, where: str
) -> None:
    batches = make_batches(6, seed=DATA_SEED)
    ref = plain_loop_with_retry_of(where, 3, batches)
    dmp, optimizer = _build(where, 3)
    ours = train_with_retry(_pipeline(name, dmp, optimizer), batches, dmp)
    assert_runs_equal(ref, ours, ("plain loop with retry", name))


def _poison(dmp: Any, poison: Any) -> None:
    """Make ``dmp``'s forward raise :class:`Fault` on ``poison``, every time."""
    original_forward = dmp.module.forward

    def forward(batch: Any) -> Any:
        loss, out = original_forward(batch)
        if torch.equal(batch.dense, poison.dense):
            raise Fault("poison batch")
        return loss, out

    dmp.module.forward = forward


@pytest.mark.parametrize(
    "name", ["TrainPipelineSparseDist", "TrainPipelineSemiSync", "TrainPipelinePEC"]
)
def test_skip_failed_batch_on_every_rank(name: str) -> None:
    """A batch that fails every time is skipped; training equals the plain loop without it."""
    batches = make_batches(6, seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches[:2] + batches[3:], seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = _pipeline(name, dmp, optimizer)
    _poison(dmp, batches[2])
    it = iter(batches)
    outputs, skipped = [], []
    while True:
        try:
            outputs.append(_snapshot(pipeline.progress(it)))
        except StopIteration:
            break
        except Fault:
            skipped.append(pipeline.skip_failed_batch())
    assert skipped == [2]
    assert_runs_equal(ref, Run(outputs, weights(dmp)), ("plain loop without batch 2", name))


def test_skip_failed_batch_on_one_rank_only_raises_out_of_step_on_every_rank() -> None:
    """Batch 2 fails on every rank; rank 0 skips it, the others retry it.  Their
    collectives would now pair batch 3 with batch 2: every rank raises
    OutOfStepError instead, naming where each rank is (a rank left waiting
    would fail by the model's group timing out after 20 s, a different error)."""
    rank = dist.get_rank()
    short = dist.new_group(backend=devices.backend(), timeout=timedelta(seconds=20))
    batches = make_batches(8, seed=DATA_SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED, pg=short)
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    _poison(dmp, batches[2])
    it = iter(batches)
    with pytest.raises(Fault):
        while True:
            pipeline.progress(it)
    if rank == 0:
        assert pipeline.skip_failed_batch() == 2
    with pytest.raises(trec_pipelines.OutOfStepError, match="the ranks are out of step"):
        for _ in range(3):
            pipeline.progress(it)


def test_after_an_eval_pipeline_left_attached_training_equals_the_plain_loop() -> None:
    """Train, an eval pipeline run to its end without detach(), train again: both
    pipelines take the model over in turn; no misleading "called twice"."""
    train, evaluation = make_batches(6, seed=DATA_SEED), make_batches(3, seed=DATA_SEED + 1)
    ref_dmp, ref_optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    ref_first, ref_eval, ref_rest = plain_loop_with_eval_pass(
        ref_dmp, ref_optimizer, train, evaluation, 2
    )

    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSemiSync(dmp, optimizer, DEVICE, start_batch=100)
    it = iter(train)
    first = [_snapshot(pipeline.progress(it)) for _ in range(2)]
    dmp.eval()
    evaluated = run_pipeline(
        trec_pipelines.EvalPipelineSparseDist(dmp, None, DEVICE), evaluation, model=dmp
    )
    dmp.train()
    rest = run_pipeline(pipeline, it, model=dmp)
    for ours, expected in zip(evaluated, ref_eval, strict=True):
        assert torch.equal(ours, expected)
    assert_runs_equal(
        Run(list(ref_first) + list(ref_rest), ref_rest.weights),
        Run(first + list(rest), rest.weights),
    )


def test_a_new_train_pipeline_takes_over_from_an_eval_pipeline() -> None:
    train, evaluation = make_batches(4, seed=DATA_SEED), make_batches(2, seed=DATA_SEED + 1)
    ref = plain_loop_of(DLRM, "table_wise", train, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    dmp.eval()
    run_pipeline(trec_pipelines.EvalPipelineSparseDist(dmp, None, DEVICE), evaluation, model=dmp)
    dmp.train()
    ours = run_pipeline(
        trec_pipelines.TrainPipelineFusedSparseDist(dmp, optimizer, DEVICE), train, model=dmp
    )
    assert_runs_equal(ref, ours, ("plain loop", "Fused after an attached eval pipeline"))


# ------------------------------------------------------------- one rank fails


def test_a_fault_on_one_rank_ends_the_other_with_an_error_not_a_hang() -> None:
    """Rank 0 raises in the over-arch of step 2 and stops; the other ranks go on into
    the backward's all-reduce, which rank 0 never joins: they get the process group's
    timeout error (a short one here; or, beyond two ranks, a peer's closed
    connection), with the pipeline's note, instead of hanging."""
    rank = dist.get_rank()
    # The model's groups (its own, and those the pipeline makes from it) keep a
    # 120 s hang guard while the model is built and trains its healthy steps (a
    # busy machine may hold one rank back for seconds there); their timeout
    # becomes 4 s on every rank where rank 0 raises, so it times the collectives
    # rank 0 never joins, and the work left pending on them, and nothing else.
    groups_before = set(dist.distributed_c10d._world.pg_map)
    short = dist.new_group(backend=devices.backend(), timeout=timedelta(seconds=120))
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        dist.get_world_size(),
        is_master=False,
        timeout=timedelta(seconds=120),
    )
    dmp, optimizer = _build("after_lookup", 2, ranks=(0,), pg=short)
    (model,) = [m for m in dmp.modules() if isinstance(m, FaultyDLRM)]

    # torch 2.14's public name; the private one before it (deprecated there).
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout

    def shorten() -> None:
        for group in set(dist.distributed_c10d._world.pg_map) - groups_before:
            set_timeout(timedelta(seconds=4), group)

    model.reached = shorten
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    it = iter(make_batches(6, seed=DATA_SEED))
    pipeline.progress(it), pipeline.progress(it)
    with pytest.raises(Exception) as failure:
        pipeline.progress(it)
    notes = "".join(getattr(failure.value, "__notes__", []))
    if rank == 0:
        assert isinstance(failure.value, Fault)
        # Keep the group alive until every other rank has had its error.
        others = range(1, dist.get_world_size())
        store.wait(
            [f"trec_pipelines_tests/faults/rank{r}_done" for r in others], timedelta(seconds=120)
        )
    else:
        store.set(f"trec_pipelines_tests/faults/rank{rank}_done", "1")
        assert not isinstance(failure.value, Fault)
        # The ranks waiting on rank 0 time out; with more than two ranks, one
        # waiting on a peer that has already timed out may see that peer's
        # connection close first (gloo: "closed by peer", or "reset by peer"
        # when the socket is torn down mid-read).  Either is an error, not a hang.
        message = str(failure.value).lower()
        assert any(
            s in message for s in ("timed out", "timeout", "closed by peer", "reset by peer")
        ), message
    assert f"rank {rank}: TrainPipelineSparseDist.progress() raised while training batch 2" in notes
    assert "other ranks" in notes or "do the same on every rank" in notes


# ---------------------------------------------------------------- bad batches


def _malformed(batch: Batch, drop: int) -> Batch:
    kjt = batch.sparse
    bad = KeyedJaggedTensor(
        keys=kjt.keys(), values=kjt.values()[: kjt.values().numel() - drop], lengths=kjt.lengths()
    )
    return Batch(batch.dense, bad, batch.labels)


@pytest.mark.parametrize(
    "name", ["TrainPipelineSparseDist", "TrainPipelineSemiSync", "TrainPipelineBase"]
)
def test_malformed_kjt_raises_before_training_on_both_ranks(name: str) -> None:
    batches = make_batches(6, seed=DATA_SEED)
    good = batches[:2] + batches[3:]
    batches[2] = _malformed(batches[2], drop=3)
    ref = plain_loop_of(DLRM, "table_wise", good, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = _pipeline(name, dmp, optimizer)
    it = iter(batches)
    outputs = []
    # Malformed on every rank: the ranks agree on it, and each says what is wrong.
    expected = r"batch 2: malformed on ranks [0-9, ]+, dropped on every rank.*key '.*'.*3 missing"
    with pytest.raises(ValueError, match=expected):
        while True:
            outputs.append(_snapshot(pipeline.progress(it)))
    outputs += list(run_pipeline(pipeline, it, model=dmp))
    assert_runs_equal(ref, Run(outputs, weights(dmp)), ("plain loop without batch 2", name))


# "+thread": EvalPipelineSparseDist loading on its thread (CPU loads inline by default),
# which then runs the agreement.
EVAL_VARIANTS = [
    "EvalPipelineSparseDist",
    "EvalPipelineSparseDist+thread",
    "EvalPipelineFusedSparseDist",
]


@pytest.mark.parametrize("name", VARIANTS + EVAL_VARIANTS)
def test_malformed_kjt_on_one_rank_raises_on_every_rank_in_the_same_step(name: str) -> None:
    """With default arguments the ranks agree on each batch ([Note: agreeing on
    each batch]): batch 3 is malformed on the last rank only.  Every rank raises for it in the
    same progress() call, naming that rank and the batch, and goes on in step:
    training (or evaluation) equals the plain loop over the batches without it.
    The model's group times out after 20 s (PG_TIMEOUT: 120 s), so a rank left
    waiting in a collective fails the test quickly instead of hanging it."""
    rank, bad = dist.get_rank(), dist.get_world_size() - 1
    short = dist.new_group(backend=devices.backend(), timeout=timedelta(seconds=20))
    batches = make_batches(6, seed=DATA_SEED)
    good = batches[:3] + batches[4:]
    if rank == bad:
        batches[3] = _malformed(batches[3], drop=batches[3].sparse.values().numel() // 2)
    ref_dmp, ref_optimizer = make_sharded(DLRM, "table_wise", seed=SEED, pg=short)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED, pg=short)
    if name in EVAL_VARIANTS:
        ref_dmp.eval()
        dmp.eval()
        with torch.no_grad():
            ref = Run([ref_dmp(b)[1] for b in good], weights(ref_dmp))
        pipeline = _eval_pipeline(name, dmp)
    else:
        ref = plain_loop(ref_dmp, ref_optimizer, good)
        pipeline = _pipeline(name, dmp, optimizer)
    it = iter(batches)
    outputs: List[torch.Tensor] = []
    errors: List[Any] = []
    while True:
        try:
            outputs.append(_snapshot(pipeline.progress(it)))
        except StopIteration:
            break
        except trec_pipelines.MalformedBatchError as error:
            errors.append((len(outputs), str(error)))
    assert len(errors) == 1, errors
    at, message = errors[0]
    assert f"batch 3: malformed on rank {bad}, dropped on every rank" in message, message
    assert ("missing" if rank == bad else "this rank's batch is fine") in message, message
    steps: List[Optional[int]] = [None] * dist.get_world_size()
    dist.all_gather_object(steps, at, group=short)
    assert steps == [at] * len(steps), f"the ranks raised after different steps: {steps}"
    assert pipeline._source.rejected == 1
    assert_runs_equal(ref, Run(outputs, weights(dmp)), ("plain loop without batch 3", name))


@pytest.mark.parametrize("where", ["before_lookup", "after_lookup"])
@pytest.mark.parametrize("name", EVAL_VARIANTS)
def test_an_eval_forward_that_raises_on_every_rank_is_evaluated_again(
    name: str, where: str
) -> None:
    """Every rank's forward raises at batch 3 (before its lookup, or once the
    embeddings arrived); every rank calls progress() again, which evaluates batch
    3 again (the ranks agree on the retry) and goes on: the outputs equal the
    plain forward of each batch, once.  The model's group times out after 20 s,
    so a rank left waiting fails the test quickly instead of hanging it."""
    short = dist.new_group(backend=devices.backend(), timeout=timedelta(seconds=20))
    batches = make_batches(6, seed=DATA_SEED)
    ref_dmp, _ = _build("", -1, pg=short)
    ref_dmp.eval()
    with torch.no_grad():
        ref = Run([_snapshot(ref_dmp(b)[1]) for b in batches], weights(ref_dmp))
    dmp, _ = _build(where, 3, pg=short)
    dmp.eval()
    pipeline = _eval_pipeline(name, dmp)
    it = iter(batches)
    outputs: List[torch.Tensor] = []
    failed: List[int] = []
    while True:
        try:
            outputs.append(_snapshot(pipeline.progress(it)))
        except StopIteration:
            break
        except Fault as error:
            assert "evaluating batch 3" in "".join(error.__notes__), error.__notes__
            failed.append(len(outputs))
    assert failed == [3]
    assert_runs_equal(ref, Run(outputs, weights(dmp)), ("plain forward", name))


def test_the_ranks_agree_by_default_and_not_with_sync_exhaustion_false() -> None:
    """By default the ranks agree on each pull (on a gloo group of their own,
    destroyed once the pipeline is collected): SparseDist's codes ride its splits
    exchange, Base's have an all-reduce of their own; ``sync_exhaustion=False``
    agrees on nothing and makes no group."""
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    off = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE, sync_exhaustion=False)
    assert off._agreement is None
    del off
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    assert pipeline._agreement is not None and pipeline._agreement.carried
    agreed = pipeline._agreement.group
    assert agreed is not current_group() and dist.get_backend(agreed) == "gloo"
    run_pipeline(pipeline, make_batches(3, seed=DATA_SEED), model=dmp)
    assert pipeline._agreement.carried, "a world-spanning splits exchange carries the codes"
    del pipeline
    gc.collect()
    base = trec_pipelines.TrainPipelineBase(dmp, optimizer, DEVICE)
    assert base._agreement is not None and not base._agreement.carried
    # The next pipeline's constructor destroyed the collected pipeline's group.
    with pytest.raises((KeyError, ValueError, RuntimeError)):
        dist.get_process_group_ranks(agreed)


# ------------------------------------------------------- gradient accumulation


def _no_sync(model: torch.nn.Module) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for module in model.modules():
        if isinstance(module, DistributedDataParallel):
            stack.enter_context(module.no_sync())
    return stack


def plain_accumulation_loop(model: Any, optimizer: Any, batches: List[Any], steps: int) -> Run:
    """Accumulate ``steps`` micro-batches per optimizer step; gradients are
    all-reduced on the first micro-batch and on each cycle's last (as torchrec's
    GradientAccumulationWrapper does with num_warmup_steps=1)."""
    model.train()
    outputs = []
    for i, batch in enumerate(batches):
        last_of_cycle = (i + 1) % steps == 0
        with contextlib.nullcontext() if (i == 0 or last_of_cycle) else _no_sync(model):
            if i % steps == 0:
                optimizer.zero_grad(set_to_none=True)
            loss, out = model(batch)
            torch.sum(loss, dim=0).backward()
            if last_of_cycle:
                optimizer.step()
        outputs.append(_snapshot(out))
    if len(batches) % steps:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return Run(outputs, weights(model))


@pytest.mark.parametrize("name", VARIANTS)
def test_gradient_accumulation_equals_the_plain_accumulation_loop(name: str) -> None:
    batches = make_batches(7, seed=DATA_SEED)
    ref = plain_accumulation_loop(*make_sharded(DLRM, "table_wise", seed=SEED), batches, steps=3)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = _pipeline(name, dmp, optimizer)
    wrapped = GradientAccumulationWrapper(
        pipeline, optimizer, dmp, GradientAccumulationConfig(num_steps=3)
    )
    ours = run_pipeline(wrapped, batches, model=dmp)
    assert_runs_equal(
        ref, ours, ("plain accumulation loop", f"{name} under GradientAccumulationWrapper")
    )


def _unrewriting(name: str, dmp: Any, optimizer: Any) -> Any:
    """Base, or PT2 kept eager (compile_on_iter past the data: the hand-over
    happens before anything would compile, and compiling is slow here)."""
    if name == "TrainPipelinePT2":
        config = trec_pipelines.TorchCompileConfig(compile_on_iter=1000)
        return trec_pipelines.TrainPipelinePT2(dmp, optimizer, DEVICE, compile_configs=config)
    return trec_pipelines.TrainPipelineBase(dmp, optimizer, DEVICE)


@pytest.mark.parametrize("eval_name", ["EvalPipelineSparseDist", "EvalPipelineFusedSparseDist"])
@pytest.mark.parametrize("name", ["TrainPipelineBase", "TrainPipelinePT2"])
def test_base_and_pt2_take_the_model_over_from_an_eval_pipeline(name: str, eval_name: str) -> None:
    """An eval pipeline left attached, then Base / PT2 (which run the model's own
    forward) train, then the eval pipeline runs again: each takes the model over
    in turn; no "called twice in one forward", results as the plain loop's."""
    train, evaluation = make_batches(5, seed=DATA_SEED), make_batches(2, seed=DATA_SEED + 1)
    ref_dmp, ref_optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    ref_dmp.eval()
    with torch.no_grad():
        ref_before = [ref_dmp(b)[1] for b in evaluation]
    ref_dmp.train()
    ref = plain_loop(ref_dmp, ref_optimizer, train)
    ref_dmp.eval()
    with torch.no_grad():
        ref_after = [ref_dmp(b)[1] for b in evaluation]

    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    evaluator = getattr(trec_pipelines, eval_name)(dmp, None, DEVICE)
    dmp.eval()
    with torch.no_grad():
        before = run_pipeline(evaluator, evaluation, model=dmp)
    dmp.train()
    ours = run_pipeline(_unrewriting(name, dmp, optimizer), train, model=dmp)
    dmp.eval()
    with torch.no_grad():
        after = run_pipeline(evaluator, evaluation, model=dmp)
    assert_runs_equal(ref, ours, ("plain loop", f"{name} after an attached {eval_name}"))
    for step, (want, got) in enumerate(
        zip(ref_before + ref_after, list(before) + list(after), strict=True)
    ):
        assert torch.equal(want, got), f"eval step {step} differs from the plain forward"
