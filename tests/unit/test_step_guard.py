"""A progress() that raises is rolled back: the next call retries its batch.

Faults are injected at every point of a step (before the embedding lookup,
after it, in the backward, in the optimizer step) on the fake model, and each
run is compared with the plain loop that meets the same fault at the same
attempt and retries the batch.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

import pytest
import torch

import trec_pipelines as tp
from tests.fault_injection import FailingBackward, Fault
from tests.unit.fakes import (
    Batch,
    TinyModel,
    _head,
    assert_same_training,
    drain,
    make_batches,
    optimizer_for,
)
from trec_pipelines.data.source import BatchSource

CPU = torch.device("cpu")


class FaultyModel(TinyModel):
    """TinyModel that raises at forward call number ``at`` (counting every attempt),
    ``where``: "before_lookup", "after_lookup" or "backward"; ``every`` keeps failing."""

    def __init__(self, where: str, at: int, every: bool = False) -> None:
        super().__init__()
        self.where, self.at, self.every = where, at, every
        self.calls = 0

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        if torch.fx._symbolic_trace.is_fx_tracing():  # the rewrite's trace is not a step
            return super().forward(batch)
        call, self.calls = self.calls, self.calls + 1
        poison = bool(batch.dense[0, 0] < 0)  # the poison batch (``every``)
        fail = call == self.at or (self.every and poison)
        if fail and self.where == "before_lookup":
            raise Fault("injected before the lookup")
        embedded = self.sparse(batch.sparse).values()
        if fail and self.where == "after_lookup":
            raise Fault("injected after the lookup")
        loss, pred = _head(self, embedded, batch)
        if fail and self.where == "backward":
            loss = FailingBackward.apply(loss)
        return loss, pred


class FaultyOptimizer(torch.optim.SGD):
    """SGD whose step number ``at`` raises before touching anything."""

    def __init__(self, params: Any, at: int) -> None:
        super().__init__(params, lr=0.1)
        self.at, self.steps = at, 0

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        call, self.steps = self.steps, self.steps + 1
        if call == self.at:
            raise Fault("injected in the optimizer")
        return super().step(closure)


class Counting:
    """An iterator that counts how often ``next()`` is called."""

    def __init__(self, batches: List[Any]) -> None:
        self._it, self.pulls = iter(batches), 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        self.pulls += 1
        return next(self._it)


def _optimizer(model: torch.nn.Module, where: str, at: int) -> torch.optim.Optimizer:
    return FaultyOptimizer(model.parameters(), at if where == "optimizer" else -1)


def _model(where: str, at: int, every: bool = False) -> FaultyModel:
    return FaultyModel(where, at if where != "optimizer" else -1, every)


def plain_loop_with_retry(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: List[Any]
) -> List[torch.Tensor]:
    """The plain loop a user writes when a step may fail: retry the batch."""
    outputs = []
    for batch in batches:
        while True:
            try:
                optimizer.zero_grad()
                loss, pred = model(batch)
                torch.sum(loss, dim=0).backward()
                optimizer.step()
            except Fault:
                continue
            outputs.append(pred)
            break
    return outputs


def train_with_retry(pipeline: Any, iterator: Any) -> Tuple[List[torch.Tensor], int]:
    outputs: List[torch.Tensor] = []
    failures = 0
    while True:
        try:
            outputs.append(pipeline.progress(iterator))
        except StopIteration:
            return outputs, failures
        except Fault as error:
            failures += 1
            assert "retries batch" in "".join(getattr(error, "__notes__", []))


def _make(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    cls = getattr(tp, name)
    if name == "TrainPipelineSemiSync":
        return cls(
            model, optimizer, CPU, start_batch=100
        )  # synchronous: the plain loop is its oracle
    if name == "TrainPipelinePT2":
        return cls(
            model, optimizer, CPU, compile_configs=tp.TorchCompileConfig(compile_on_iter=10**6)
        )
    return cls(model, optimizer, CPU)


TRAIN_VARIANTS = [
    "TrainPipelineBase",
    "TrainPipelineSparseDist",
    "TrainPipelineSparseDistLite",
    "TrainPipelineFusedSparseDist",
    "PrefetchTrainPipelineSparseDist",
    "TrainPipelineSemiSync",
    "TrainPipelinePT2",
    "TrainPipelinePEC",
]


@pytest.mark.parametrize("name", TRAIN_VARIANTS)
@pytest.mark.parametrize("where", ["before_lookup", "after_lookup", "backward", "optimizer"])
@pytest.mark.parametrize("at", [0, 2, 5])
def test_failed_step_is_retried_and_training_equals_the_plain_loop(
    name: str, where: str, at: int
) -> None:
    batches = make_batches(6)
    model, ref = _model(where, at), _model(where, at)
    loader = Counting(batches)
    outputs, failures = train_with_retry(_make(name, model, _optimizer(model, where, at)), loader)
    ref_outputs = plain_loop_with_retry(ref, _optimizer(ref, where, at), batches)
    assert failures == 1
    assert loader.pulls == len(batches) + 1, "a batch was pulled twice or an extra one was pulled"
    assert_same_training(outputs, ref_outputs, model, ref)


@pytest.mark.parametrize("name", TRAIN_VARIANTS)
def test_skip_failed_batch_drops_a_poison_batch(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    batches = make_batches(6)
    batches[3].dense[0, 0] = -1.0  # this batch fails every time
    for b in batches[:3] + batches[4:]:
        b.dense[0, 0] = b.dense[0, 0].abs() + 0.01
    model, ref = _model("after_lookup", -1, every=True), _model("after_lookup", -1)
    pipeline = _make(name, model, optimizer_for(model))
    it = iter(batches)
    outputs: List[torch.Tensor] = []
    skipped: List[int] = []
    attempts = 0
    while True:
        try:
            outputs.append(pipeline.progress(it))
        except StopIteration:
            break
        except Fault:
            attempts += 1
            if attempts == 2:  # retried once, failed again: skip it
                skipped.append(pipeline.skip_failed_batch())
                attempts = 0
    ref_outputs = plain_loop_with_retry(ref, optimizer_for(ref), batches[:3] + batches[4:])
    assert skipped == [3]
    assert "batch 3 skipped" in caplog.text
    assert_same_training(outputs, ref_outputs, model, ref)


def test_skip_failed_batch_without_a_failure_says_so() -> None:
    model = TinyModel()
    pipeline = tp.TrainPipelineSparseDist(model, optimizer_for(model), CPU)
    pipeline.progress(iter(make_batches(3)))
    with pytest.raises(RuntimeError, match="did not fail.*nothing to skip"):
        pipeline.skip_failed_batch()


def test_failure_then_reset_drops_the_rolled_back_batches(caplog: pytest.LogCaptureFixture) -> None:
    model = _model("after_lookup", 1)
    pipeline = tp.TrainPipelineSparseDist(model, optimizer_for(model), CPU)
    it = iter(make_batches(6))
    pipeline.progress(it)
    with pytest.raises(Fault):
        pipeline.progress(it)
    pipeline.reset()
    assert "drops 3 in-flight" in caplog.text
    # A new epoch on a new iterator trains normally.
    assert len(drain(pipeline, iter(make_batches(4, seed=9)))) == 4


def test_a_failed_step_no_longer_wedges_the_pipeline_with_called_twice() -> None:
    """The issue's report: after a fault past the lookup every later call failed with
    "called twice (batch 2)"; now the next call retries batch 2 and goes on."""
    model = _model("after_lookup", 2)
    pipeline = tp.TrainPipelineSparseDist(model, optimizer_for(model), CPU)
    it = iter(make_batches(5))
    pipeline.progress(it), pipeline.progress(it)
    with pytest.raises(Fault) as failure:
        pipeline.progress(it)
    assert "retries batch 2" in "".join(failure.value.__notes__)
    assert len(drain(pipeline, it)) == 3


def test_a_step_that_goes_through_after_a_failure_ends_that_failures_standing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0's step fails, and rank 0 resets and trains on: once a step of it went
    through, its failure no longer stands, so rank 1's later errors are not noted as
    "rank 0 failed first" (two ranks' failure news on one store; no watcher)."""
    from torch.distributed import HashStore

    from trec_pipelines.core import peer_failure, step_guard

    monkeypatch.setenv("TREC_PIPELINES_PEER_FAILURE_GRACE", "0")
    store = HashStore()
    rank0 = peer_failure.FailureNews(store, 0, 2, None)
    rank1 = peer_failure.FailureNews(store, 1, 2, None)
    monkeypatch.setattr(step_guard, "news", lambda: rank0)
    model = _model("before_lookup", 1)
    pipeline = tp.TrainPipelineSparseDist(model, optimizer_for(model), CPU)
    it = iter(make_batches(6))
    pipeline.progress(it)
    with pytest.raises(Fault):
        pipeline.progress(it)
    assert list(rank1.peers_failed()) == [0]
    pipeline.reset()
    pipeline.progress(iter(make_batches(4, seed=9)))
    assert rank1.peers_failed() == {}


# ------------------------------------------------------- the source's side


def _items(*names: str) -> Iterator[torch.Tensor]:
    return iter([torch.tensor([ord(n)]) for n in names])


def _take(source: BatchSource, it: Iterator[torch.Tensor]) -> Optional[Tuple[str, int]]:
    batch = source.next(it)
    return None if batch is None else (chr(int(batch.item())), source.last_index)


def test_source_rewind_gives_host_batches_back_in_order_with_their_indices() -> None:
    source = BatchSource(keep_in_flight=True)
    it = _items("a", "b", "c", "d", "e")
    assert [_take(source, it) for _ in range(3)] == [("a", 0), ("b", 1), ("c", 2)]
    source.retire()  # "a" trained
    source.fetch_ahead(it, 1)  # "d" held
    assert source.rewind() == 1
    assert source.holding == 3 and source.in_flight == 0
    again = [_take(source, it) for _ in range(4)]
    assert again == [("b", 1), ("c", 2), ("d", 3), ("e", 4)]


def test_source_skip_rewound_drops_the_failed_batch_only() -> None:
    source = BatchSource(keep_in_flight=True)
    it = _items("a", "b", "c")
    _take(source, it), _take(source, it)
    assert source.rewind() == 0
    assert source.skip_rewound() == 0
    assert _take(source, it) == ("b", 1)
    assert _take(source, it) == ("c", 2)
    assert _take(source, it) is None


def test_source_without_keep_in_flight_keeps_nothing() -> None:
    source = BatchSource()
    it = _items("a", "b")
    _take(source, it), _take(source, it)
    assert source.in_flight == 0 and source.rewind() is None


# ------------------------------------------------------------- handing over


def _eval_pass(model: torch.nn.Module) -> Any:
    pipeline = tp.EvalPipelineSparseDist(model, None, CPU)
    model.eval()
    drain(pipeline, iter(make_batches(2, seed=7)))
    model.train()
    return pipeline


@pytest.mark.parametrize("keep_eval_alive", [True, False])
def test_a_train_pipeline_takes_the_model_over_from_an_attached_eval_pipeline(
    keep_eval_alive: bool, caplog: pytest.LogCaptureFixture
) -> None:
    batches = make_batches(5)
    model, ref = TinyModel(), TinyModel()
    evaluation = _eval_pass(model)
    if not keep_eval_alive:
        del evaluation
    pipeline = tp.TrainPipelineFusedSparseDist(model, optimizer_for(model), CPU)
    outputs = drain(pipeline, iter(batches))
    assert_same_training(
        outputs, plain_loop_with_retry(ref, optimizer_for(ref), batches), model, ref
    )
    assert (
        "detaching it and taking the model over" if keep_eval_alive else "dropped without detach()"
    ) in caplog.text
    pipeline.detach()
    assert "forward" not in model.sparse.__dict__, "a wrapper was left on the model"


def test_train_and_eval_pipelines_alternate_on_one_model() -> None:
    batches = make_batches(6)
    model, ref = TinyModel(), TinyModel()
    train = tp.TrainPipelineSemiSync(model, optimizer_for(model), CPU, start_batch=100)
    evaluation = tp.EvalPipelineSparseDist(model, None, CPU)
    it = iter(batches)
    outputs = [train.progress(it) for _ in range(2)]
    for _ in range(2):
        model.eval()
        drain(evaluation, iter(make_batches(2, seed=7)))
        model.train()
        outputs.append(train.progress(it))
    outputs += drain(train, it)
    assert_same_training(
        outputs, plain_loop_with_retry(ref, optimizer_for(ref), batches), model, ref
    )


def test_semi_sync_stash_survives_a_failed_optimizer_step() -> None:
    """With stash_gradients the step swaps in the previous batch's gradients before
    stepping; if the step then fails, the retry must find the stash as it was."""
    model = TinyModel()
    optimizer = FaultyOptimizer(model.parameters(), at=3)
    pipeline = tp.TrainPipelineSemiSync(model, optimizer, CPU, start_batch=1, stash_gradients=True)
    it = iter(make_batches(6))
    for _ in range(4):  # batch 1 only stashes (its step is skipped): steps 0, 1, 2 run
        pipeline.progress(it)
    before = {name: grad.clone() for name, grad in pipeline._gradients.items()}
    with pytest.raises(Fault):
        pipeline.progress(it)
    assert before.keys() == pipeline._gradients.keys()
    assert all(torch.equal(before[name], pipeline._gradients[name]) for name in before)
    assert len(drain(pipeline, it)) == 2


# ------------------------------------------------------------ a peer that is gone


class _PeerGoneModel(TinyModel):
    """TinyModel whose forward number ``at`` raises what gloo raises once a peer's
    process ended in the middle of a collective."""

    def __init__(self, message: str, at: int) -> None:
        super().__init__()
        self.message, self.at, self.calls = message, at, 0

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        if not torch.fx._symbolic_trace.is_fx_tracing():
            call, self.calls = self.calls, self.calls + 1
            if call == self.at:
                raise RuntimeError(self.message)
        return super().forward(batch)


GLOO_CLOSED = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
    "[127.0.0.1]:43027"
)


def test_a_step_cut_by_a_gone_peer_says_restart_not_retry() -> None:
    model = _PeerGoneModel(GLOO_CLOSED, 1)
    pipeline = tp.TrainPipelineSparseDist(model, optimizer_for(model), CPU)
    it = iter(make_batches(4))
    pipeline.progress(it)
    with pytest.raises(RuntimeError, match="Connection closed by peer") as failure:
        pipeline.progress(it)
    notes = "".join(failure.value.__notes__)
    assert "while training batch 1 because the peer at [127.0.0.1]:43027 is gone" in notes
    assert "no retry can succeed in this job" in notes
    assert "Restart the job from the last checkpoint" in notes
    assert "retries batch" not in notes and "skip_failed_batch() first" not in notes


@pytest.mark.parametrize(
    "message,peer",
    [
        (GLOO_CLOSED, "the peer at [127.0.0.1]:43027"),
        (
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error "
            "[10.0.0.2]:5511: Connection reset by peer",
            "the peer at [10.0.0.2]:5511",
        ),
        (
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:318] Write error "
            "[10.0.0.2]:5511: Broken pipe",
            "the peer at [10.0.0.2]:5511",
        ),
        (
            "NCCL error: remote process exited or there was a network error, ncclRemoteError",
            "a peer",
        ),
        ("[Errno 32] Broken pipe", None),  # a pipe of the user's own, not a peer's socket
        ("injected after the lookup", None),
        ("Timed out waiting 1800000ms for recv operation to complete", None),
    ],
)
def test_gone_peer_reads_the_process_groups_words(message: str, peer: Optional[str]) -> None:
    from trec_pipelines.core.peer_failure import gone_peer

    assert gone_peer(RuntimeError(message)) == peer
