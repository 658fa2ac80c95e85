"""StagedTrainPipeline: fill/steady/drain order and flushes; SparseDataDistUtil on a fake model."""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Tuple

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.fault_injection import FlakyIterator
from tests.unit.fakes import (
    ModifyingModel,
    TinyModel,
    _head as fakes_head,
    assert_same_training,
    make_batches,
    optimizer_for,
    plain_loop,
)
from trec_pipelines.core.errors import MalformedBatchError
from trec_pipelines.pipelines.sparse_data_dist_util import SparseDataDistUtil
from trec_pipelines.pipelines.staged import PipelineStage, StagedTrainPipeline

CPU = torch.device("cpu")
CPU_STREAM = torch.Stream(device="cpu")


class Log:
    """Records what each stage and callback did, in order."""

    def __init__(self) -> None:
        self.events: List[str] = []

    def stage(self, name: str) -> PipelineStage:
        def run(batch: str) -> str:
            self.events.append(f"{name}({batch.split('>')[0]})")
            return f"{batch}>{name}"

        return PipelineStage(
            name=name,
            runnable=run,
            stream=None,
            fill_callback=lambda: self.events.append(f"{name}.fill"),
            data_exhausted_callback=lambda: self.events.append(f"{name}.exhausted"),
        )


class Counting:
    """An iterator that counts how many batches were taken from it."""

    def __init__(self, items: List[Any]) -> None:
        self._it = iter(items)
        self.taken = 0

    def __iter__(self) -> "Counting":
        return self

    def __next__(self) -> Any:
        item = next(self._it)
        self.taken += 1
        return item


def three_stages() -> Tuple[Log, StagedTrainPipeline]:
    log = Log()
    return log, StagedTrainPipeline([log.stage("a"), log.stage("b"), log.stage("c")])


def drain_staged(pipeline: StagedTrainPipeline, it: Iterator[Any], limit: int = 100) -> List[Any]:
    out = []
    for _ in range(limit):
        batch = pipeline.progress(it)
        if batch is None:
            return out
        out.append(batch)
    raise AssertionError(f"no None after {limit} calls")


def test_fill_steady_drain_order() -> None:
    log, pipeline = three_stages()
    batches = [f"b{i}" for i in range(5)]
    it = iter(batches)
    results = []
    per_call: List[List[str]] = []
    for _ in range(6):
        start = len(log.events)
        results.append(pipeline.progress(it))
        per_call.append(log.events[start:])
    assert results == [f"b{i}>a>b>c" for i in range(5)] + [None]
    fill = [
        "a(b0)", "a.fill", "b(b0)", "b.fill", "c(b0)", "c.fill",
        "a(b1)", "a.fill", "b(b1)", "b.fill",
        "a(b2)", "a.fill",
    ]  # fmt: skip
    assert per_call[0] == fill + ["a(b3)", "b(b2)", "c(b1)"]
    assert per_call[1] == ["a(b4)", "b(b3)", "c(b2)"]
    assert per_call[2] == ["a.exhausted", "b(b4)", "c(b3)"]
    assert per_call[3] == ["a.exhausted", "b.exhausted", "c(b4)"]
    assert per_call[4] == ["a.exhausted", "b.exhausted", "c.exhausted"]
    assert per_call[5] == ["a.exhausted", "b.exhausted", "c.exhausted"]


def test_recorded_schedule() -> None:
    _, pipeline = three_stages()
    pipeline.enable_schedule_recording()
    drain_staged(pipeline, iter(["x0", "x1", "x2"]))
    assert [str(a) for a in pipeline.schedule_actions] == [
        "P0 a[i0]@default", "P0 b[i0]@default", "P0 c[i0]@default",
        "P0 a[i1]@default", "P0 b[i1]@default",
        "P0 a[i2]@default",
        "P0 b[i2]@default", "P0 c[i1]@default", "P0 WaitBatch[i0]@default",
        "P1 c[i2]@default", "P1 WaitBatch[i1]@default",
        "P2 WaitBatch[i2]@default",
    ]  # fmt: skip
    # The table view: batch k leaves stage s in call k-N+1+s (the fill is call 0).
    assert pipeline.schedule() == [
        ("WaitBatch", "default", [0, 1, 2]),
        ("a", "default", [(0, 1, 2), None, None]),
        ("b", "default", [(0, 1, 2), None, None]),
        ("c", "default", [(0, 1), 2, None]),
    ]


@pytest.mark.parametrize("n", [0, 1, 2])
def test_short_loaders(n: int) -> None:
    log, pipeline = three_stages()
    assert drain_staged(pipeline, iter([f"b{i}" for i in range(n)])) == [
        f"b{i}>a>b>c" for i in range(n)
    ]
    runs = [e for e in log.events if "(" in e]
    assert sorted(runs) == sorted(f"{s}(b{i})" for s in "abc" for i in range(n))
    assert log.events.count("a.fill") == 3 and log.events.count("c.fill") == 1


def test_new_epoch_after_none() -> None:
    _, pipeline = three_stages()
    assert drain_staged(pipeline, iter(["e0", "e1"])) == ["e0>a>b>c", "e1>a>b>c"]
    second = [f"f{i}" for i in range(4)]
    assert drain_staged(pipeline, iter(second)) == [f"{b}>a>b>c" for b in second]
    # The same exhausted iterator: still nothing.
    it = iter(["g0"])
    assert drain_staged(pipeline, it) == ["g0>a>b>c"]
    assert pipeline.progress(it) is None


def test_flush_drains_then_calls_on_flush_end_once_and_resumes() -> None:
    log = Log()
    it = Counting([f"b{i}" for i in range(10)])
    returned: List[str] = []
    flushes: List[Tuple[int, int]] = []
    pipeline = StagedTrainPipeline(
        [log.stage("a"), log.stage("b"), log.stage("c")],
        on_flush_end=lambda: flushes.append((it.taken, len(returned))),
    )
    while (batch := pipeline.progress(it)) is not None:
        returned.append(batch)
        if len(returned) == 2:
            pipeline.set_flush(True)
    assert returned == [f"b{i}>a>b>c" for i in range(10)]
    # At the end of the flush every batch taken had been returned: none in flight.
    assert len(flushes) == 1
    taken, done = flushes[0]
    assert taken == done == 5
    # Nothing was loaded while flushing, and every batch went through every stage once.
    runs = [e for e in log.events if "(" in e]
    assert sorted(runs) == sorted(f"{s}(b{i})" for s in "abc" for i in range(10))


def test_flush_with_one_stage_and_flush_end_guard() -> None:
    log = Log()
    ended: List[int] = []
    pipeline = StagedTrainPipeline([log.stage("a")], on_flush_end=lambda: ended.append(1))
    it = iter([f"b{i}" for i in range(4)])
    assert pipeline.progress(it) == "b0>a"
    with pytest.raises(RuntimeError, match="in flight"):
        pipeline.flush_end()
    pipeline.set_flush(True)
    assert pipeline.progress(it) == "b1>a"  # in flight when the flush began
    assert ended == []
    assert pipeline.progress(it) == "b2>a"  # drained, flushed, refilled
    assert ended == [1]
    assert drain_staged(pipeline, it) == ["b3>a"]


def test_flush_called_off_leaves_no_gap() -> None:
    _, pipeline = three_stages()
    it = iter([f"b{i}" for i in range(6)])
    out = [pipeline.progress(it)]
    pipeline.set_flush(True)
    out.append(pipeline.progress(it))
    pipeline.set_flush(False)
    out += drain_staged(pipeline, it)
    assert out == [f"b{i}>a>b>c" for i in range(6)]


def test_no_stages_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        StagedTrainPipeline([])


# ---------------------------------------------------------- SparseDataDistUtil


@pytest.fixture(autouse=True)
def context_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run SparseDataDistUtil with its context checks on: they must hold throughout."""
    monkeypatch.setattr(SparseDataDistUtil, "_WITH_CONTEXT_ASSERTIONS", True)


def h2d_stage() -> PipelineStage:
    return PipelineStage("h2d", lambda batch: batch.to(CPU, non_blocking=True), CPU_STREAM)


def train_staged(
    model: TinyModel,
    pipeline: StagedTrainPipeline,
    batches: List[Any],
    optimizer: torch.optim.Optimizer,
    between: Optional[Callable[[int], None]] = None,
    on_error: Optional[Callable[[Exception], None]] = None,
) -> List[torch.Tensor]:
    """The caller's loop over the batches the pipeline hands out; a progress()
    that raises goes to ``on_error`` (which fails on what it does not expect)
    and the loop calls progress() again."""
    it = iter(batches)
    outputs = []
    for _ in range(4 * len(batches) + 10):
        try:
            batch = pipeline.progress(it)
        except Exception as error:
            if on_error is None:
                raise
            on_error(error)
            continue
        if batch is None:
            return outputs
        optimizer.zero_grad()
        loss, pred = model(batch)
        torch.sum(loss, dim=0).backward()
        optimizer.step()
        outputs.append(pred)
        if between is not None:
            between(len(outputs))
    raise AssertionError("progress() never returned None")


@pytest.mark.parametrize("n", [0, 1, 2, 7])
def test_sdd_stage_matches_plain_loop(n: int) -> None:
    batches = make_batches(n)
    ref_model = TinyModel()
    ref = plain_loop(ref_model, batches)
    model = TinyModel()
    sdd = SparseDataDistUtil(model, data_dist_stream=CPU_STREAM)
    pipeline = StagedTrainPipeline([h2d_stage(), sdd.start_sparse_data_dist_stage()])
    ours = train_staged(model, pipeline, batches, optimizer_for(model))
    assert_same_training(ours, ref, model, ref_model)
    kinds = [kind for kind, _ in model.log]
    assert kinds.count("input_dist") == kinds.count("compute") == n
    if n >= 2:
        assert sdd.rewrite_result is not None and sdd.rewrite_result.names == ["sparse"]
        # Batch 1's input_dist was started before batch 0's lookup.
        assert kinds[:3] == ["input_dist", "input_dist", "compute"]


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_sdd_applies_the_on_unpipelined_policy(
    policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A module whose input the model transforms cannot be pipelined: "warn" logs it
    and trains it unpipelined, "raise" refuses, naming the module and the fix."""
    batches = make_batches(4)
    model, ref_model = ModifyingModel(), ModifyingModel()
    sdd = SparseDataDistUtil(model, data_dist_stream=None, on_unpipelined=policy)
    pipeline = StagedTrainPipeline([h2d_stage(), sdd.start_sparse_data_dist_stage()])
    if policy == "raise":
        with pytest.raises(RuntimeError, match="(?s)NOT pipelined: sparse.*on_unpipelined='warn'"):
            train_staged(model, pipeline, batches, optimizer_for(model))
        return
    ours = train_staged(model, pipeline, batches, optimizer_for(model))
    assert_same_training(ours, plain_loop(ref_model, batches), model, ref_model)
    assert sdd.rewrite_result is not None and sdd.rewrite_result.names == []
    assert "sharded module 'sparse' is NOT pipelined" in caplog.text


def test_sdd_with_prefetch_stage_matches_plain_loop() -> None:
    batches = make_batches(6)
    ref_model = TinyModel()
    ref = plain_loop(ref_model, batches)
    model = TinyModel()
    sdd = SparseDataDistUtil(model, data_dist_stream=None, prefetch_stream=CPU_STREAM)
    pipeline = StagedTrainPipeline(
        [
            h2d_stage(),
            sdd.start_sparse_data_dist_stage(),
            PipelineStage("prefetch", sdd.prefetch, sdd.prefetch_stream),
        ]
    )
    ours = train_staged(model, pipeline, batches, optimizer_for(model))
    assert_same_training(ours, ref, model, ref_model)


def test_sdd_with_lookup_stage_frozen_embeddings_matches_plain_loop() -> None:
    # The lookup stage looks batch i+1 up before batch i's optimizer step
    # (semi-synchronous); with the embedding frozen that staleness is moot
    # and the result must be the plain loop's exactly.
    def dense_optimizer(model: TinyModel) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for n, p in model.named_parameters() if "bag" not in n], lr=0.1)

    batches = make_batches(6)
    ref_model = TinyModel()
    ref_opt = dense_optimizer(ref_model)
    ref = []
    for batch in batches:
        ref_opt.zero_grad()
        loss, pred = ref_model(batch)
        torch.sum(loss, dim=0).backward()
        ref_opt.step()
        ref.append(pred)
    model = TinyModel()
    sdd = SparseDataDistUtil(model, data_dist_stream=None, embedding_lookup_stream=CPU_STREAM)
    pipeline = StagedTrainPipeline(
        [h2d_stage(), sdd.start_sparse_data_dist_stage(), sdd.start_embedding_lookup_stage()]
    )
    ours = train_staged(model, pipeline, batches, dense_optimizer(model))
    assert_same_training(ours, ref, model, ref_model)
    kinds = [kind for kind, _ in model.log]
    assert kinds.count("input_dist") == kinds.count("compute") == len(batches)
    # Batch 1's lookup ran in the first progress(), before batch 0 was trained.
    assert kinds[:5] == ["input_dist", "compute", "input_dist", "input_dist", "compute"]


def test_sdd_flush_mid_stream_matches_plain_loop() -> None:
    batches = make_batches(8)
    ref_model = TinyModel()
    ref = plain_loop(ref_model, batches)
    model = TinyModel()
    sdd = SparseDataDistUtil(model, data_dist_stream=None)
    flushed: List[int] = []
    pipeline = StagedTrainPipeline(
        [h2d_stage(), sdd.start_sparse_data_dist_stage()], on_flush_end=lambda: flushed.append(1)
    )

    def between(done: int) -> None:
        if done == 3:
            pipeline.set_flush(True)

    ours = train_staged(model, pipeline, batches, optimizer_for(model), between)
    assert flushed == [1]
    assert_same_training(ours, ref, model, ref_model)


def test_sdd_detach_mid_stream_then_resume() -> None:
    batches = make_batches(6)
    probe = make_batches(1, seed=99)[0]
    ref_model = TinyModel()
    ref = plain_loop(ref_model, batches)
    model = TinyModel()
    sdd = SparseDataDistUtil(model, data_dist_stream=None)
    pipeline = StagedTrainPipeline([h2d_stage(), sdd.start_sparse_data_dist_stage()])
    probes: List[torch.Tensor] = []

    def between(done: int) -> None:
        if done == 2:
            assert sdd.detach() is model
            with torch.no_grad():
                probes.append(model(probe)[1])  # the model's own forward, no pipeline
            with torch.no_grad():
                expected = TinyModel()
                expected.load_state_dict(model.state_dict())
                probes.append(expected(probe)[1])

    ours = train_staged(model, pipeline, batches, optimizer_for(model), between)
    assert_same_training(ours, ref, model, ref_model)
    assert torch.equal(probes[0], probes[1])


def test_sdd_prefetch_and_lookup_together_is_an_error() -> None:
    with pytest.raises(ValueError, match="not both"):
        SparseDataDistUtil(
            TinyModel(), None, prefetch_stream=CPU_STREAM, embedding_lookup_stream=CPU_STREAM
        )
    # The same, when one mode comes from a stream and the other from a stage.
    with pytest.raises(ValueError, match="use one of the two"):
        SparseDataDistUtil(
            TinyModel(), None, prefetch_stream=CPU_STREAM
        ).start_embedding_lookup_stage()
    sdd = SparseDataDistUtil(TinyModel(), None)
    with pytest.raises(ValueError, match="use one of the two"):
        StagedTrainPipeline(
            [
                PipelineStage("prefetch", sdd.prefetch, None),
                sdd.start_embedding_lookup_stage(),
            ]
        )


def test_sdd_modes_come_from_the_stages_when_streams_are_none() -> None:
    """A CPU user leaves every stream None; the stage list says what runs."""
    plain = SparseDataDistUtil(TinyModel(), None)
    StagedTrainPipeline([plain.start_sparse_data_dist_stage()])
    assert (plain._with_prefetch, plain._with_embedding_lookup, plain._num_contexts) == (
        False,
        False,
        2,
    )

    prefetching = SparseDataDistUtil(TinyModel(), None)
    StagedTrainPipeline(
        [
            prefetching.start_sparse_data_dist_stage(),
            PipelineStage("prefetch", prefetching.prefetch, None),
        ]
    )
    assert (prefetching._with_prefetch, prefetching._num_contexts) == (True, 3)

    looking_up = SparseDataDistUtil(TinyModel(), None)
    stage = looking_up.start_embedding_lookup_stage()
    assert stage.stream is None
    assert (looking_up._with_embedding_lookup, looking_up._num_contexts) == (True, 3)

    # Not declared (a lambda hides the verb): the error says what to pass.
    hidden = SparseDataDistUtil(TinyModel(), None)
    with pytest.raises(RuntimeError, match="prefetch_stream"):
        hidden.prefetch(object())


def test_sdd_prefetch_stage_with_none_streams_matches_plain_loop_and_is_late_declared_error() -> (
    None
):
    batches = make_batches(6)
    ref_model = TinyModel()
    ref = plain_loop(ref_model, batches)
    model = TinyModel()
    sdd = SparseDataDistUtil(model, data_dist_stream=None)  # every stream None, as on CPU
    stages = [
        PipelineStage("h2d", lambda b: b, None),
        sdd.start_sparse_data_dist_stage(),
        PipelineStage("prefetch", sdd.prefetch, None),
    ]
    ours = train_staged(model, StagedTrainPipeline(stages), batches, optimizer_for(model))
    assert_same_training(ours, ref, model, ref_model)
    # A prefetch stage declared once batches have gone through input_dist
    # would change how many are in flight: refused, with the fix.
    late = SparseDataDistUtil(TinyModel(), None)
    first = StagedTrainPipeline([h2d_stage(), late.start_sparse_data_dist_stage()])
    first.progress(iter(make_batches(3)))
    with pytest.raises(RuntimeError, match="before the first progress"):
        StagedTrainPipeline(
            [
                h2d_stage(),
                late.start_sparse_data_dist_stage(),
                PipelineStage("p", late.prefetch, None),
            ]
        )


# ------------------------------------------------------- failures (issue #16)


class FailOnce:
    """Raises RuntimeError("injected") on call number ``at`` of ``run``, before running it."""

    def __init__(self, run: Callable[[Any], Any], at: int) -> None:
        self._run, self._at, self.calls = run, at, 0

    def __call__(self, batch: Any) -> Any:
        call, self.calls = self.calls, self.calls + 1
        if call == self._at:
            raise RuntimeError("injected")
        return self._run(batch)


def progress_until_none(
    pipeline: StagedTrainPipeline,
    it: Iterator[Any],
    on_error: Optional[Callable[[RuntimeError], None]] = None,
) -> Tuple[List[Any], int]:
    """Call progress() until None, again after each RuntimeError (passed to
    ``on_error`` first, if given): (batches, errors)."""
    out, errors = [], 0
    for _ in range(100):
        try:
            batch = pipeline.progress(it)
        except RuntimeError as error:
            errors += 1
            if on_error is not None:
                on_error(error)
            continue
        if batch is None:
            return out, errors
        out.append(batch)
    raise AssertionError("no None after 100 calls")


@pytest.mark.parametrize("at", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("failing", ["a", "b", "c"])
def test_a_stage_that_raises_runs_again_on_the_same_batch(failing: str, at: int) -> None:
    log, pipeline = three_stages()
    stage = pipeline._pipeline_stages["abc".index(failing)]
    stage.runnable = FailOnce(stage.runnable, at)
    it = Counting([f"b{i}" for i in range(5)])
    out, errors = progress_until_none(pipeline, it)
    assert errors == 1
    assert out == [f"b{i}>a>b>c" for i in range(5)]
    assert it.taken == 5
    runs = [e for e in log.events if "(" in e]
    assert sorted(runs) == sorted(f"{s}(b{i})" for s in "abc" for i in range(5))
    # Each fill callback ran once, after its stage.
    assert log.events.count("a.fill") == 3 and log.events.count("c.fill") == 1


@pytest.mark.parametrize("at", [0, 2, 3, 5])
def test_an_iterator_that_raises_loses_and_repeats_no_batch(at: int) -> None:
    log, pipeline = three_stages()
    out, errors = progress_until_none(pipeline, FlakyIterator([f"b{i}" for i in range(5)], at))
    assert errors == 1
    assert out == [f"b{i}>a>b>c" for i in range(5)]
    assert log.events.count("a(b0)") == 1


class FaultyTinyModel(TinyModel):
    """Raises on forward call ``at`` after the sparse module ran (every attempt counts)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, batch: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        if torch.fx._symbolic_trace.is_fx_tracing():
            return super().forward(batch)
        call, self.calls = self.calls, self.calls + 1
        embedded = self.sparse(batch.sparse).values()
        if call == self.at:
            raise RuntimeError("injected after the lookup")
        return fakes_head(self, embedded, batch)


def train_staged_on_failure(
    model: TinyModel,
    pipeline: StagedTrainPipeline,
    batches: List[Any],
    retry: bool,
    repeat: int = 0,
) -> List[torch.Tensor]:
    """The caller's loop: a failed forward is retried or left behind; the forward
    of batch ``repeat`` runs twice (as after a backward that raised)."""
    optimizer = optimizer_for(model)
    it = iter(batches)
    outputs = []
    while (batch := pipeline.progress(it)) is not None:
        optimizer.zero_grad()
        if len(outputs) == repeat:
            model(batch)
        try:
            loss, pred = model(batch)
        except RuntimeError:
            if not retry:
                continue
            loss, pred = model(batch)
        torch.sum(loss, dim=0).backward()
        optimizer.step()
        outputs.append(pred)
    return outputs


@pytest.mark.parametrize("third_stage", [None, "prefetch"])
@pytest.mark.parametrize("at", [0, 2, 4])
def test_sdd_retried_forward_redoes_the_input_dist_and_matches_plain_loop(
    at: int, third_stage: Optional[str]
) -> None:
    batches = make_batches(5)
    ref_model = TinyModel()
    ref = plain_loop(ref_model, batches)
    model = FaultyTinyModel(at)
    sdd = SparseDataDistUtil(model, data_dist_stream=None)
    stages = [h2d_stage(), sdd.start_sparse_data_dist_stage()]
    if third_stage == "prefetch":
        stages.append(PipelineStage("prefetch", sdd.prefetch, None))
    ours = train_staged_on_failure(
        model, StagedTrainPipeline(stages), batches, retry=True, repeat=-1
    )
    assert_same_training(ours, ref, model, ref_model)
    kinds = [kind for kind, _ in model.log]
    # The retry ran the failed batch's input_dist and lookup once more.
    assert kinds.count("input_dist") == kinds.count("compute") == len(batches) + 1


@pytest.mark.parametrize("repeat", [0, 3, 4])
def test_sdd_forward_repeated_after_it_finished_reads_its_own_batch(repeat: int) -> None:
    batches = make_batches(5)
    ref_model = TinyModel()
    ref = plain_loop(ref_model, batches)
    model = TinyModel()
    sdd = SparseDataDistUtil(model, data_dist_stream=None)
    pipeline = StagedTrainPipeline([h2d_stage(), sdd.start_sparse_data_dist_stage()])
    ours = train_staged_on_failure(model, pipeline, batches, retry=True, repeat=repeat)
    assert_same_training(ours, ref, model, ref_model)


@pytest.mark.parametrize("third_stage", [None, "prefetch"])
@pytest.mark.parametrize("at", [0, 2, 4])
def test_sdd_skipped_batch_matches_plain_loop_without_it(
    at: int, third_stage: Optional[str]
) -> None:
    batches = make_batches(5)
    ref_model = TinyModel()
    ref = plain_loop(ref_model, batches[:at] + batches[at + 1 :])
    model = FaultyTinyModel(at)
    sdd = SparseDataDistUtil(model, data_dist_stream=None)
    stages = [h2d_stage(), sdd.start_sparse_data_dist_stage()]
    if third_stage == "prefetch":
        stages.append(PipelineStage("prefetch", sdd.prefetch, None))
    ours = train_staged_on_failure(
        model, StagedTrainPipeline(stages), batches, retry=False, repeat=-1
    )
    assert_same_training(ours, ref, model, ref_model)


# ------------------------------------ malformed and poison batches (issue #16)


class Seen:
    """A stage runnable that passes the batch on and lists the batches it saw."""

    def __init__(self) -> None:
        self.batches: List[Any] = []

    def __call__(self, batch: Any) -> Any:
        self.batches.append(batch)
        return batch


def seen_stages(n: int = 3) -> Tuple[List[Seen], StagedTrainPipeline]:
    seen = [Seen() for _ in range(n)]
    return seen, StagedTrainPipeline([PipelineStage(f"s{i}", s, None) for i, s in enumerate(seen)])


def malformed_copy(batch: Any) -> Any:
    """``batch`` with 3 values of its KJT cut off (its lengths no longer add up)."""
    from tests.unit.fakes import Batch

    kjt = batch.sparse
    bad = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values()[:-3], lengths=kjt.lengths())
    return Batch(batch.dense, bad, batch.labels)


def progress_through_malformed(
    pipeline: StagedTrainPipeline, batches: List[Any], at: int
) -> List[Any]:
    """Everything progress() returns, with the MalformedBatchError of batch ``at`` on the way."""
    it = iter(batches)
    out: List[Any] = []
    with pytest.raises(
        MalformedBatchError,
        match=rf"batch {at}: KeyedJaggedTensor batch.sparse: key 'f1'.*3 missing.*next progress\(\) goes on",
    ):
        while True:
            batch = pipeline.progress(it)
            assert batch is not None, "the data ended before the malformed batch raised"
            out.append(batch)
    return out + drain_staged(pipeline, it)


@pytest.mark.parametrize("at", [0, 1, 3, 5])
def test_a_malformed_batch_raises_before_stage_0_and_the_rest_comes_out(at: int) -> None:
    """0 and 1 are loaded in the fill, 3 in the steady state, 5 last."""
    batches = make_batches(6)
    for batch in batches:  # every other batch has its f1 values past 3
        assert batch.sparse.values().numel() >= 3
    batches[at] = malformed_copy(batches[at])
    good = batches[:at] + batches[at + 1 :]
    seen, pipeline = seen_stages()
    out = progress_through_malformed(pipeline, batches, at)
    assert [id(b) for b in out] == [id(b) for b in good]
    for stage in seen:  # no stage ever saw it, and each saw the others once, in order
        assert [id(b) for b in stage.batches] == [id(b) for b in good]
    assert pipeline.rejected == 1
    with pytest.raises(RuntimeError, match="no stage failed"):
        pipeline.skip_failed_batch()


def test_a_malformed_batch_then_skip_says_it_is_already_dropped() -> None:
    batches = make_batches(3)
    batches[1] = malformed_copy(batches[1])
    _, pipeline = seen_stages()
    with pytest.raises(MalformedBatchError):
        pipeline.progress(iter(batches))
    with pytest.raises(RuntimeError, match="batch 1 was malformed and is already dropped"):
        pipeline.skip_failed_batch()


@pytest.mark.parametrize("at", [0, 2, 4])
def test_sdd_malformed_batch_training_equals_the_plain_loop_without_it(at: int) -> None:
    batches = make_batches(5)
    batches[at] = malformed_copy(batches[at])
    ref_model = TinyModel()
    ref = plain_loop(ref_model, batches[:at] + batches[at + 1 :])
    model = TinyModel()
    sdd = SparseDataDistUtil(model, data_dist_stream=None)
    pipeline = StagedTrainPipeline([h2d_stage(), sdd.start_sparse_data_dist_stage()])
    rejected: List[Exception] = []
    ours = train_staged(model, pipeline, batches, optimizer_for(model), on_error=rejected.append)
    assert [type(error) for error in rejected] == [MalformedBatchError]
    assert_same_training(ours, ref, model, ref_model)
    assert pipeline.rejected == 1


def test_validate_batches_false_lets_a_malformed_batch_through() -> None:
    batches = make_batches(4)
    batches[2] = malformed_copy(batches[2])
    seen = Seen()
    pipeline = StagedTrainPipeline([PipelineStage("s0", seen, None)], validate_batches=False)
    out = drain_staged(pipeline, iter(batches))
    assert [id(b) for b in out] == [id(b) for b in batches]
    assert [id(b) for b in seen.batches] == [id(b) for b in batches]
    assert pipeline.rejected == 0


def test_batches_without_kjts_pass_validation() -> None:
    _, pipeline = three_stages()  # strings: nothing to check
    assert drain_staged(pipeline, iter(["x", "y"])) == ["x>a>b>c", "y>a>b>c"]


class Poisoned:
    """A stage runnable that raises RuntimeError("poison") every time it gets a
    batch ``is_poison`` picks, and runs ``run`` on every other one."""

    def __init__(self, run: Callable[[Any], Any], is_poison: Callable[[Any], bool]) -> None:
        self._run, self._is_poison, self.raised = run, is_poison, 0

    def __call__(self, batch: Any) -> Any:
        if self._is_poison(batch):
            self.raised += 1
            raise RuntimeError("poison")
        return self._run(batch)


def progress_skipping(
    pipeline: StagedTrainPipeline, it: Iterator[Any], retries: int = 1
) -> Tuple[List[Any], List[int]]:
    """Call progress() until None; after a RuntimeError, call it again ``retries``
    times (the stage fails again), then skip: (batches, the skipped indices)."""
    skipped: List[int] = []
    failures = 0

    def on_error(error: RuntimeError) -> None:
        nonlocal failures
        assert "poison" in str(error)
        failures += 1
        if failures > retries:
            skipped.append(pipeline.skip_failed_batch())
            failures = 0

    out, _ = progress_until_none(pipeline, it, on_error)
    return out, skipped


@pytest.mark.parametrize("at", [0, 1, 2, 4, 5])
@pytest.mark.parametrize("failing", ["a", "b", "c"])
def test_skip_failed_batch_drops_a_poison_batch_and_the_rest_comes_out(
    failing: str, at: int
) -> None:
    """Batch 0 goes through every stage in the fill, 2 only through a; 4 and 5 in the steady state."""
    log, pipeline = three_stages()
    stage = pipeline._pipeline_stages["abc".index(failing)]
    poison = f"b{at}"
    stage.runnable = Poisoned(stage.runnable, lambda batch: batch.split(">")[0] == poison)
    it = Counting([f"b{i}" for i in range(6)])
    out, skipped = progress_skipping(pipeline, it)
    assert skipped == [at]
    assert out == [f"b{i}>a>b>c" for i in range(6) if i != at]
    assert stage.runnable.raised == 2  # tried, retried once, skipped
    assert it.taken == 6
    runs = [e for e in log.events if "(" in e]
    # Each stage ran once on every other batch; the stages before the failing one
    # also ran on the poison batch, the ones after it never saw it.
    before = "abc"[: "abc".index(failing)]
    assert sorted(runs) == sorted(
        [f"{s}(b{i})" for s in "abc" for i in range(6) if i != at]
        + [f"{s}({poison})" for s in before]
    )
    # Batch k runs stages 0 .. 2-k in the fill; a skip there runs the stages
    # before the failed one, fill callbacks included, on the next batch too.
    in_fill = at + "abc".index(failing) <= 2
    for i, s in enumerate("abc"):
        assert log.events.count(f"{s}.fill") == 3 - i + (in_fill and s in before)


def test_skip_failed_batch_with_one_stage_and_two_poison_batches() -> None:
    log = Log()
    stage = log.stage("a")
    stage.runnable = Poisoned(stage.runnable, lambda batch: batch in ("b1", "b2"))
    pipeline = StagedTrainPipeline([stage])
    out, skipped = progress_skipping(pipeline, iter([f"b{i}" for i in range(4)]), retries=0)
    assert skipped == [1, 2]
    assert out == ["b0>a", "b3>a"]


def test_skip_failed_batch_when_nothing_failed_in_a_stage_is_an_error() -> None:
    _, pipeline = three_stages()
    with pytest.raises(RuntimeError, match="did not raise, so no stage failed on a batch"):
        pipeline.skip_failed_batch()  # before any progress()
    it = FlakyIterator([f"b{i}" for i in range(5)], at=4)
    assert pipeline.progress(it) == "b0>a>b>c"
    with pytest.raises(RuntimeError, match="did not raise"):
        pipeline.skip_failed_batch()
    with pytest.raises(RuntimeError, match="injected"):
        pipeline.progress(it)  # the iterator raises: no batch yet
    with pytest.raises(RuntimeError, match="the data iterator raised .*injected.* none to skip"):
        pipeline.skip_failed_batch()
    assert drain_staged(pipeline, it) == [f"b{i}>a>b>c" for i in range(1, 5)]


def test_skip_failed_batch_twice_is_an_error_and_a_fill_callback_has_no_batch() -> None:
    log, pipeline = three_stages()
    stage = pipeline._pipeline_stages[1]
    stage.runnable = Poisoned(stage.runnable, lambda batch: batch.startswith("b1"))
    it = iter([f"b{i}" for i in range(4)])
    with pytest.raises(RuntimeError, match="poison"):
        pipeline.progress(it)
    assert pipeline.skip_failed_batch() == 1
    with pytest.raises(RuntimeError, match="did not raise"):
        pipeline.skip_failed_batch()  # the failure it was about is handled

    calls = []

    def fill_callback() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("callback")

    _, other = three_stages()
    other._pipeline_stages[0].fill_callback = fill_callback
    other_it = iter(["x0", "x1"])
    with pytest.raises(RuntimeError, match="callback"):
        other.progress(other_it)
    with pytest.raises(RuntimeError, match="stage 'a''s fill_callback raised .*none to skip"):
        other.skip_failed_batch()
    assert drain_staged(other, other_it) == ["x0>a>b>c", "x1>a>b>c"]
    assert drain_staged(pipeline, it) == ["b0>a>b>c", "b2>a>b>c", "b3>a>b>c"]


def _is_batch(poison: Any) -> Callable[[Any], bool]:
    return lambda batch: torch.equal(batch.dense, poison.dense)


@pytest.mark.parametrize("at", [0, 1, 3, 4])
@pytest.mark.parametrize(
    "failing,third_stage",
    [("h2d", None), ("input_dist", None), ("input_dist", "prefetch"), ("prefetch", "prefetch")],
)
def test_sdd_poison_batch_skipped_training_equals_the_plain_loop_without_it(
    failing: str, third_stage: Optional[str], at: int
) -> None:
    batches = make_batches(5)
    ref_model = TinyModel()
    ref = plain_loop(ref_model, batches[:at] + batches[at + 1 :])
    model = TinyModel()
    sdd = SparseDataDistUtil(model, data_dist_stream=None)
    poisoned = _is_batch(batches[at])
    stages = [h2d_stage(), sdd.start_sparse_data_dist_stage()]
    if third_stage == "prefetch":
        sdd.stage_declared("prefetch")  # a wrapped runnable hides whose prefetch it is
        stages.append(PipelineStage("prefetch", sdd.prefetch, None))
    stage = stages[["h2d", "input_dist", "prefetch"].index(failing)]
    stage.runnable = Poisoned(stage.runnable, poisoned)
    pipeline = StagedTrainPipeline(stages)
    skipped: List[int] = []

    def skip(error: Exception) -> None:
        assert isinstance(error, RuntimeError) and "poison" in str(error), error
        skipped.append(pipeline.skip_failed_batch())

    ours = train_staged(model, pipeline, batches, optimizer_for(model), on_error=skip)
    assert skipped == [at]
    assert_same_training(ours, ref, model, ref_model)
    kinds = [kind for kind, _ in model.log]
    # The skipped batch's lookup never ran; its input_dist only if a later stage failed.
    assert kinds.count("compute") == len(batches) - 1
