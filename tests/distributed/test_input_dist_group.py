"""input_dist_group (issue #21): the pipelined input_dist on a dedicated process group.

Every variant that pipelines the input_dist trains bit for bit the same with
"dedicated" (the default) and "shared", and both equal the plain loop; the
dedicated group carries the input_dist and nothing else, is made once per
sharding group and reused, and detach() leaves the model's modules as they were.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import trec_pipelines
from trec_pipelines.core import input_dist_group as idg, streams
from trec_pipelines.pipelines.sparse_data_dist_util import SparseDataDistUtil
from trec_pipelines.pipelines.staged import PipelineStage, StagedTrainPipeline
from trec_pipelines.sparse import input_dist
from trec_pipelines.sparse.input_dist import SplitsFusion, SplitsOnlyKJTAllToAll
from trec_pipelines.testing import StreamRecorder, devices
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
SEED, DATA_SEED = 321, 5

TRAIN_VARIANTS = [
    "TrainPipelineSparseDist",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "PrefetchTrainPipelineSparseDist",
    "TrainPipelinePEC",  # a DLRM of EmbeddingBagCollections: its PEC verbs do nothing
]
EVAL_VARIANTS = ["EvalPipelineSparseDist", "EvalPipelineFusedSparseDist"]


def _pipeline(name: str, dmp: Any, optimizer: Any, **kwargs: Any) -> Any:
    # SemiSync synchronous (start_batch past the data): the plain loop is its oracle.
    extra = {"start_batch": 100} if name == "TrainPipelineSemiSync" else {}
    return getattr(trec_pipelines, name)(dmp, optimizer, DEVICE, **extra, **kwargs)


def _kjt_all_to_alls(model: torch.nn.Module) -> List[KJTAllToAll]:
    # The sharded EBC keeps its input_dists in a plain list, out of modules()' reach.
    return input_dist._kjt_all_to_alls([model.module.ebc])


def _splits_only(model: torch.nn.Module) -> List[SplitsOnlyKJTAllToAll]:
    found = [m.__dict__.get("forward") for m in _kjt_all_to_alls(model)]
    return [f for f in found if isinstance(f, SplitsOnlyKJTAllToAll)]


@contextlib.contextmanager
def _all_to_alls_issued() -> Iterator[List[Tuple[dist.ProcessGroup, str]]]:
    """Every ``all_to_all_single`` issued inside (torchrec's input and output dists
    both use it): its group and the (recording) stream current at the call."""
    calls: List[Tuple[dist.ProcessGroup, str]] = []
    original = dist.all_to_all_single

    def spy(*args: Any, **kwargs: Any) -> Any:
        stream = streams.current_stream(DEVICE)
        calls.append((kwargs.get("group"), getattr(stream, "name", "default")))
        return original(*args, **kwargs)

    dist.all_to_all_single = spy
    try:
        yield calls
    finally:
        dist.all_to_all_single = original


@pytest.mark.parametrize("name", TRAIN_VARIANTS)
def test_dedicated_and_shared_train_the_same_as_the_plain_loop(name: str) -> None:
    batches = make_batches(6, seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    runs = {}
    for group in ("dedicated", "shared"):
        dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
        pipeline = _pipeline(name, dmp, optimizer, input_dist_group=group)
        runs[group] = run_pipeline(pipeline, batches, model=dmp)
        used = {f._pg for f in _splits_only(dmp)}
        assert used, f"{name}: no splits-only input_dist on the model"
        if group == "dedicated":
            assert current_group() not in used
            assert used == set(pipeline._pipelined.fusion.groups.values())
        else:
            assert used == {current_group()} and not pipeline._pipelined.fusion.groups
    assert_runs_equal(ref, runs["dedicated"], ("plain loop", f"{name}, dedicated"))
    assert_runs_equal(runs["shared"], runs["dedicated"], (f"{name}, shared", f"{name}, dedicated"))


@pytest.mark.parametrize("name", EVAL_VARIANTS)
def test_eval_dedicated_and_shared_predict_the_same(name: str) -> None:
    batches = make_batches(5, seed=DATA_SEED)
    runs = {}
    for group in ("dedicated", "shared"):
        dmp, _ = make_sharded(DLRM, "table_wise", seed=SEED)
        dmp.eval()
        with torch.no_grad():
            runs[group] = run_pipeline(
                _pipeline(name, dmp, None, input_dist_group=group), batches, model=dmp
            )
    dmp, _ = make_sharded(DLRM, "table_wise", seed=SEED)
    dmp.eval()
    with torch.no_grad():
        expected = [dmp(b)[1] for b in batches]
    for step, (want, got) in enumerate(zip(expected, runs["dedicated"], strict=True)):
        assert torch.equal(want, got), (
            f"{name}, dedicated: step {step} differs from the plain forward"
        )
    assert_runs_equal(runs["shared"], runs["dedicated"], (f"{name}, shared", f"{name}, dedicated"))


def test_staged_sparse_data_dist_util_runs_on_the_dedicated_group() -> None:
    batches = make_batches(6, seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    sdd = SparseDataDistUtil(dmp, data_dist_stream=None)
    pipeline = StagedTrainPipeline(
        [
            PipelineStage("h2d", lambda b: b.to(DEVICE), None),
            PipelineStage(
                "sdd", sdd.start_sparse_data_dist, None, fill_callback=sdd.wait_sdd_fill_callback
            ),
        ]
    )
    it = iter(batches)
    outputs = []
    while (batch := pipeline.progress(it)) is not None:
        optimizer.zero_grad()
        loss, out = dmp(batch)
        torch.sum(loss, dim=0).backward()
        optimizer.step()
        outputs.append(out.detach().clone())
    assert len(outputs) == len(batches)
    for step, (want, got) in enumerate(zip(ref, outputs, strict=True)):
        assert torch.equal(want, got), f"step {step} differs from the plain loop"
    used = {f._pg for f in _splits_only(dmp)}
    assert used and current_group() not in used


def test_input_dist_runs_on_the_dedicated_group_on_the_data_dist_stream() -> None:
    """Under the recording stream backend: after the first batch (whose input_dist
    builds the modules' all-to-alls on the model's group), every input_dist
    all-to-all goes to the dedicated group on the data_dist stream, the
    embeddings' all-to-alls stay on the model's group on the default stream, and
    the stream protocol holds."""
    batches = make_batches(5, seed=DATA_SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    with StreamRecorder() as recorder, _all_to_alls_issued() as calls:
        pipeline = recorder.watch(trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE))
        run_pipeline(pipeline, batches, model=dmp)
        # Stop recording while the spy is still in place: the recording's
        # all-to-all wrapper went in over the spy and must come out before the
        # spy puts back what it saved (else later recordings see no all-to-all).
        pipeline.disable_schedule_recording()
        del pipeline
    # Every rule: the forward wrapper finishes the input_dist (the tensors wait
    # and torchrec's KJT permute) on the data_dist stream inside the Forward
    # verb, and the default stream waits for it before the verb ends (rule d).
    recorder.assert_protocol()
    model_group = current_group()
    dedicated = {idg.dedicated_of(model_group)}
    on_dedicated = [stream for group, stream in calls if group in dedicated]
    on_model = [(i, stream) for i, (group, stream) in enumerate(calls) if group is model_group]
    assert on_dedicated and set(on_dedicated) == {"data_dist"}, calls
    first_dedicated = next(i for i, (group, _) in enumerate(calls) if group in dedicated)
    # The model's group: the first batch's input_dist, then the embeddings' all-to-alls only.
    late_input_dist = [i for i, stream in on_model if stream == "data_dist" and i > first_dedicated]
    assert not late_input_dist, calls
    assert {stream for i, stream in on_model if i > first_dedicated} == {"default"}, calls


def test_one_dedicated_group_per_sharding_group_reused_and_detach_restores() -> None:
    batches = make_batches(4, seed=DATA_SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    first = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    run_pipeline(first, batches[:2], model=dmp)
    assert _kjt_all_to_alls(dmp), "the model's input_dists exist after its first batch"
    groups = first._pipelined.fusion.groups
    assert set(groups) == {current_group()} and groups[current_group()] is not current_group()
    first.detach()
    # The model's own modules: their own group and their class's forward.
    for module in _kjt_all_to_alls(dmp):
        assert module._pg is current_group() and "forward" not in module.__dict__
    # A second pipeline (another variant) on the same model reuses the group.
    second = trec_pipelines.TrainPipelineFusedSparseDist(dmp, optimizer, DEVICE)
    run_pipeline(second, batches[2:], model=dmp)
    assert second._pipelined.fusion.groups == groups
    # attach() after detach() reuses the pipeline's groups, without a collective.
    second.detach()
    second.attach()
    assert {f._pg for f in _splits_only(dmp)} == set(groups.values())
    second.detach()


def test_a_bad_choice_is_refused_with_the_choices() -> None:
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    with pytest.raises(ValueError, match="'dedicated'.*'shared'|dedicated.*shared"):
        trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE, input_dist_group="private")


@pytest.mark.skipif(
    int(os.environ.get("WORLD_SIZE", "1")) < 4,
    reason="two sharding groups of two ranks need 4 ranks (the distributed-4 tier)",
)
def test_two_sharding_groups_each_get_their_own_dedicated_group() -> None:
    """As 2D sharding (DMPCollection): ranks {0,1} and {2,3} each hold their own
    sharding group.  Every rank makes both dedicated groups in one order (no
    new_group deadlock), keeps only its own, and an all-to-all on it reaches
    exactly its half."""
    world = dist.get_world_size()
    halves = [list(range(0, world // 2)), list(range(world // 2, world))]
    groups = [dist.new_group(ranks=h, backend=devices.backend()) for h in halves]
    half = 0 if dist.get_rank() in halves[0] else 1
    mine = groups[half]
    made_before = len(idg._dedicated)
    try:
        got = idg.dedicated_groups([mine])
        assert list(got) == [mine] and got[mine] is not mine
        assert dist.get_process_group_ranks(got[mine]) == halves[half]
        assert len(idg._dedicated) == made_before + 1  # its own half's group only
        # Resolving again makes nothing new and returns the same group.
        assert idg.dedicated_groups([mine]) == got
        sent = torch.full((len(halves[half]),), float(dist.get_rank()))
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=got[mine])
        assert received.tolist() == [float(r) for r in halves[half]]
    finally:
        idg.release_input_dist_groups(mine)
        dist.destroy_process_group(mine)


def test_one_rank_groups_alone_make_no_world_collective() -> None:
    """Rank 0 resolves the groups of a pipeline it runs alone over a one-rank group
    (the bench's overhead phase) while the other ranks do nothing: nothing to
    duplicate, so no world collective they would have to join; then every rank
    meets at a barrier.  (The pipeline itself is not built here: torchrec 1.9.2's
    sharding of a model on one rank makes process groups of its own, which the
    other ranks would have to make too.)"""
    solo = dist.new_group(ranks=[0], backend=devices.backend())
    try:
        if dist.get_rank() == 0:
            assert idg.dedicated_groups([solo]) == {}
            fusion = SplitsFusion("dedicated")
            fusion.fuse([])
            assert fusion.groups == {}
        dist.barrier(group=current_group())
    finally:
        if dist.get_rank() == 0:
            dist.destroy_process_group(solo)


def test_the_splits_only_forward_names_the_keys_of_its_rank_in_its_group() -> None:
    """The splits-only forward keeps this rank's place in its group from its
    construction: on a group of rank 1 alone, rank 1 is the group's rank 0 and
    gets every key (its place in the world, 1, names none), on every call."""
    last = dist.get_world_size() - 1
    solo = dist.new_group(ranks=[last], backend=devices.backend())
    try:
        if dist.get_rank() == last:
            forward = SplitsOnlyKJTAllToAll(solo, [2], stagger=1)
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 0, 1, 1])
            )
            for _ in range(2):
                meta = forward(kjt)
                assert meta.keys == ["a", "b"]
                assert meta.pg is solo
        dist.barrier(group=current_group())
    finally:
        if dist.get_rank() == last:
            dist.destroy_process_group(solo)
