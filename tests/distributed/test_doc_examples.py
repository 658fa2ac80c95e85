"""The code the guides and the README show (docs/examples/), run on the test DLRM
(the quickstart also on its own model): each must do what its page says, checked
against the plain loop."""

from __future__ import annotations

import tempfile
from typing import Any, List

import pytest
import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader
from torchrec.datasets.random import RandomRecDataset

from docs.examples import checkpoint, my_variant, quickstart, schedule, staged
from tests.elastic.train_with_checkpoints import Batches
from trec_pipelines import TrainPipelineSparseDist
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
from trec_pipelines.testing.references import plain_loop_of, plain_loop_restarted

DEVICE = devices.device()
SEED, RESTART_SEED, DATA_SEED = 1234, 99, 11
N = 7


def _outputs(raw: List[Any]) -> List[torch.Tensor]:
    return [out.detach().clone() for out in raw]


def test_quickstart_trains_as_the_plain_loop(capsys: Any) -> None:
    batches = make_batches(N, seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    ours = Run(_outputs(quickstart.train_one_epoch(dmp, optimizer, batches, DEVICE)), weights(dmp))
    assert_runs_equal(ref, ours, ("plain loop", "quickstart"))
    if dist.get_rank() == 0:  # the report names the pipelined module
        assert "pipelined (fx): ebc" in capsys.readouterr().out


def test_quickstart_model_trains_as_the_plain_loop() -> None:
    """The README's own model and data (a torchrec DLRM, RandomRecDataset), built
    twice by the example: the pipeline's losses and weights are the plain loop's."""
    data = RandomRecDataset(
        keys=quickstart.FEATURES,
        batch_size=64,
        hash_size=1000,
        ids_per_feature=3,
        num_dense=8,
        manual_seed=dist.get_rank(),
        num_batches=N,
    )
    cpu = torch.device("cpu")
    model, optimizer = quickstart.build_model(cpu)
    ref = Run(
        [staged.train_step(model, optimizer, batch)[0].clone() for batch in data],
        weights(model),
    )
    model, optimizer = quickstart.build_model(cpu)
    outputs = quickstart.train_one_epoch(model, optimizer, data, cpu)
    assert_runs_equal(ref, Run([loss for loss, _, _ in outputs], weights(model)))


def test_checkpoint_recipe_resumes_the_batches_in_flight() -> None:
    """Save after 3 steps, resume into a new model, pipeline and loader: the run
    equals the plain loop's over all the batches, none lost or trained twice (on
    more than 2 ranks the plain loop restarted at the same step, as in
    test_resume: DDP's rebuilt buckets change a sum's order in the last bits)."""
    batches = make_batches(N, seed=DATA_SEED)
    ref = plain_loop_restarted(batches, 3, SEED, RESTART_SEED)
    # The same directory on every rank (each writes its own file in it).
    name = [tempfile.mkdtemp(prefix="trec_doc_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    directory = str(name[0])

    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    loader = StatefulDataLoader(Batches(batches), batch_size=None)
    pipeline = checkpoint.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    it = iter(loader)
    before = _outputs([pipeline.progress(it) for _ in range(3)])
    checkpoint.save(directory, pipeline, dmp, optimizer, loader)
    dist.barrier()

    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED + 1)  # other weights: all loaded
    loader = StatefulDataLoader(Batches(batches), batch_size=None)
    pipeline, it = checkpoint.resume(directory, dmp, optimizer, loader, DEVICE)
    after: List[torch.Tensor] = []
    while True:
        try:
            after.append(pipeline.progress(it).detach().clone())
        except StopIteration:
            break
    assert_runs_equal(ref, Run(before + after, weights(dmp)), ("plain loop", "resumed"))


def test_resumed_batches_are_not_pulled_through_next_batch_again() -> None:
    """The checkpoint guide's word on an overridden ``_next_batch``: the batches in flight
    restored by ``load_state_dict`` were pulled through it by the saving run and are
    trained without being pulled again; over both runs every batch is pulled once."""
    batches = make_batches(N, seed=DATA_SEED)
    pulls: List[float] = []

    class Counting(checkpoint.TrainPipelineSparseDist):
        def _next_batch(self, dataloader_iter: Any) -> Any:
            batch = super()._next_batch(dataloader_iter)
            if batch is not None:
                pulls.append(batch.dense.sum().item())
            return batch

    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    loader = StatefulDataLoader(Batches(batches), batch_size=None)
    pipeline, it = Counting(dmp, optimizer, DEVICE), iter(loader)
    for _ in range(3):
        pipeline.progress(it)
    state, loader_state = pipeline.state_dict(), loader.state_dict()
    saved = list(pulls)
    assert len(saved) == 5  # 3 trained and 2 in flight (SparseDist's cur and nxt)

    pulls.clear()
    resumed = Counting(*make_sharded(DLRM, "table_wise", seed=SEED), DEVICE)
    resumed.load_state_dict(state)
    loader = StatefulDataLoader(Batches(batches), batch_size=None)
    loader.load_state_dict(loader_state)
    it = iter(loader)
    trained = 0
    while True:
        try:
            resumed.progress(it)
        except StopIteration:
            break
        trained += 1
    # 4 trained after the resume: the 2 restored, unpulled, then the 2 after them, pulled.
    assert trained == N - 3 and len(pulls) == N - len(saved) == 2
    every = [b.dense.sum().item() for b in batches]
    assert saved + pulls == every


def test_schedule_example_records_the_steady_state(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)  # export_trace writes trace.json here
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = schedule.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    rows, ledger = schedule.record(pipeline, iter(make_batches(N, seed=DATA_SEED)))
    by_task = {(task, stream): cells for task, stream, cells in rows}
    # SparseDist's steady state: step k trains batch k and copies batch k+2.
    assert by_task[("Forward", "default")][3] == 3
    assert by_task[("H2D", "memcpy")][3] == 5
    # Three in flight, and the batch pulled a step ahead while the ranks agree on it.
    assert ledger.max_batches == 4
    assert (tmp_path / "trace.json").stat().st_size > 0


@pytest.mark.parametrize("prefetch", [False, True], ids=["two_stages", "prefetch"])
def test_staged_example_trains_as_the_plain_loop(prefetch: bool) -> None:
    """The guide's pipeline, built by the same function as on CUDA with every
    stream None: the loop's outputs and the weights are the plain loop's."""
    batches = make_batches(N, seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    streams = staged.make_streams(DEVICE)
    assert DEVICE.type != "cpu" or streams == staged.Streams(None, None, None)
    pipeline, sdd = staged.build_pipeline(dmp, DEVICE, streams, prefetch=prefetch)
    assert pipeline.num_stages == (3 if prefetch else 2)
    outputs = staged.train_epoch(pipeline, dmp, optimizer, batches)
    assert_runs_equal(ref, Run(_outputs(outputs), weights(dmp)), ("plain loop", "staged"))
    assert sdd.rewrite_result is not None and sdd.rewrite_result.names == ["ebc"]


@pytest.mark.parametrize("prefetch", [False, True], ids=["two_stages", "prefetch"])
def test_staged_example_flush_then_evaluate(prefetch: bool) -> None:
    """set_flush(True) after 2 steps: the batches in flight (one per stage) are
    trained, then on_flush_end evaluates with nothing in flight, then training
    carries on; equal to the plain loop evaluating after 2 + num_stages batches."""
    train, evaluation = make_batches(N, seed=DATA_SEED), make_batches(2, seed=DATA_SEED + 1)
    stages = 3 if prefetch else 2
    first, evaluated_ref, rest = plain_loop_with_eval_pass(
        *make_sharded(DLRM, "table_wise", seed=SEED), train, evaluation, at=2 + stages
    )
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    evaluated: List[List[Any]] = []
    pipeline, sdd = staged.build_pipeline(
        dmp,
        DEVICE,
        staged.make_streams(DEVICE),
        prefetch=prefetch,
        on_flush_end=lambda: evaluated.append(staged.evaluate(sdd, dmp, evaluation, DEVICE)),
    )
    outputs = staged.train_epoch(pipeline, dmp, optimizer, train, flush_after=2)
    assert_runs_equal(
        Run(list(first) + list(rest), rest.weights),
        Run(_outputs(outputs), weights(dmp)),
        ("plain loop", "staged, flushed"),
    )
    assert len(evaluated) == 1
    assert_runs_equal(Run(evaluated_ref, {}), Run(_outputs(evaluated[0]), {}))


def test_staged_example_evaluates_mid_epoch_with_batches_in_flight() -> None:
    """evaluate() between two steps, no flush: detach() keeps the batches in
    flight and the next progress() pipelines the model again."""
    train, evaluation = make_batches(N, seed=DATA_SEED), make_batches(2, seed=DATA_SEED + 1)
    first, evaluated_ref, rest = plain_loop_with_eval_pass(
        *make_sharded(DLRM, "table_wise", seed=SEED), train, evaluation, at=3
    )
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline, sdd = staged.build_pipeline(dmp, DEVICE, staged.make_streams(DEVICE), prefetch=True)
    outputs, evaluated = [], []
    it = iter(train)
    while (batch := pipeline.progress(it)) is not None:
        outputs.append(staged.train_step(dmp, optimizer, batch))
        if len(outputs) == 3:
            evaluated = staged.evaluate(sdd, dmp, evaluation, DEVICE)
    assert_runs_equal(
        Run(list(first) + list(rest), rest.weights),
        Run(_outputs(outputs), weights(dmp)),
        ("plain loop", "staged, evaluated mid-epoch"),
    )
    assert_runs_equal(Run(evaluated_ref, {}), Run(_outputs(evaluated), {}))


def test_my_variant_trains_as_the_plain_loop() -> None:
    """The variant of the writing-a-variant guide: every step's output and the final
    weights are the plain loop's, and it holds the four batches it declares."""
    batches = make_batches(N, seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = my_variant.TrainPipelineCopyAhead(dmp, optimizer, DEVICE)
    it = iter(batches)
    outputs = [pipeline.progress(it).detach().clone()]
    assert len(pipeline.batches) == 3  # after the first step: nxt and two copied ahead
    while True:
        try:
            outputs.append(pipeline.progress(it).detach().clone())
        except StopIteration:
            break
    assert_runs_equal(ref, Run(outputs, weights(dmp)), ("plain loop", "my variant"))


def test_my_variant_on_uneven_data_stops_where_sparse_dist_stops() -> None:
    """Rank 0 holds 7 batches, rank 1 holds 5: the variant ends every rank's epoch at
    the same step as TrainPipelineSparseDist, with the same outputs and weights
    (the ranks' agreement on each pull, which the variant inherits)."""
    batches = make_batches(N if dist.get_rank() == 0 else N - 2, seed=DATA_SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    ref = run_pipeline(TrainPipelineSparseDist(dmp, optimizer, DEVICE), batches)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    ours = run_pipeline(my_variant.TrainPipelineCopyAhead(dmp, optimizer, DEVICE), batches)
    assert len(ours) == N - 2
    assert_runs_equal(ref, ours, ("TrainPipelineSparseDist", "my variant"))


def test_my_variant_resumes_and_retries_as_the_core_gives_it() -> None:
    """An iterator that fails once (the step is rolled back and retried), then a
    checkpoint after 3 steps, resumed into a new variant: the run is the plain loop's."""
    batches = make_batches(N, seed=DATA_SEED)
    ref = plain_loop_restarted(batches, 3, SEED, RESTART_SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = my_variant.TrainPipelineCopyAhead(dmp, optimizer, DEVICE)
    loader = StatefulDataLoader(Batches(batches), batch_size=None)
    it, failed = _FailingOnce(iter(loader), at=6), 0
    before: List[torch.Tensor] = []
    while len(before) < 3:
        try:
            before.append(pipeline.progress(it).detach().clone())
        except _Fault:
            failed += 1  # rolled back: the next call retries the step
    assert failed == 1
    state = {"pipeline": pipeline.state_dict(), "loader": loader.state_dict()}
    state.update(model=dmp.state_dict(), optimizer=optimizer.state_dict())

    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=RESTART_SEED)
    dmp.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    pipeline = my_variant.TrainPipelineCopyAhead(dmp, optimizer, DEVICE)
    pipeline.load_state_dict(state["pipeline"])
    loader = StatefulDataLoader(Batches(batches), batch_size=None)
    loader.load_state_dict(state["loader"])
    it = iter(loader)
    after: List[torch.Tensor] = []
    while True:
        try:
            after.append(pipeline.progress(it).detach().clone())
        except StopIteration:
            break
    assert_runs_equal(ref, Run(before + after, weights(dmp)), ("plain loop", "my variant"))


class _Fault(RuntimeError):
    pass


class _FailingOnce:
    """An iterator that raises once, at its ``at``-th ``next()``."""

    def __init__(self, it: Any, at: int) -> None:
        self.it, self.at, self.calls = it, at, 0

    def __iter__(self) -> "_FailingOnce":
        return self

    def __next__(self) -> Any:
        self.calls += 1
        if self.calls == self.at:
            raise _Fault("the data iterator failed once")
        return next(self.it)
