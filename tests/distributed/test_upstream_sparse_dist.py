"""torchrec's SparseDist-family tests, adapted: its TestSparseNN on 2+ gloo ranks.

From upstream's ``test_train_pipelines.py`` (GPU-only there, skipped on CPU):

* ``TrainPipelineSparseDistTest.test_equal_to_non_pipelined`` -- for
  SparseDist, Lite and Fused, table-/column-/row-wise, with and without
  ``execute_all_batches``;
* ``test_multi_dataloader_pipelining`` -- three iterators in a row;
* ``test_custom_fwd`` -- a custom forward whose predictions are reshaped;
* ``EmbeddingTrainPipelineTest.test_equal_to_non_pipelined`` -- SemiSync
  (``start_batch`` 0 and 6, gradients stashed or not);
* ``EvalPipelineSparseDistTest.test_processing`` -- eval over plain tensors;
* ``test_feature_processed_ebc`` -- a position-weighted FP-EBC is pipelined;
* ``test_train_pipelines_utils.test_restore_from_snapshot`` -- without the
  postproc module (postprocs are tested with the postproc pipelining).

Each run is checked against the non-pipelined copy of the model, and against
torchrec 1.8.0's class of the same name where that runs on CPU (SparseDist
and Lite as they are, Fused and SemiSync under the test-only shim).
"""

from __future__ import annotations

import copy
from typing import Any, List, Tuple

import pytest
import torch
import torchrec.distributed.train_pipeline.train_pipelines as upstream
from torch import nn
from torchrec.distributed.fp_embeddingbag import (
    FeatureProcessedEmbeddingBagCollectionSharder,
    ShardedFeatureProcessedEmbeddingBagCollection,
)
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.test_utils.emb_sharder import TestEBCSharder
from torchrec.distributed.test_utils.test_model import ModelInput
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.feature_processor_ import PositionWeightedModule
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

import trec_pipelines
from tests.distributed.upstream_setup import (
    DEVICE,
    FUSED,
    NUM_FLOAT_FEATURES,
    Setting,
    copy_state,
    generate_data,
    non_pipelined,
    optional_run,
    tables,
)
from trec_pipelines.testing.dlrm import Run, assert_runs_equal, current_group, run_pipeline, weights
from trec_pipelines.testing.torchrec_cpu import torchrec_on_cpu

SHARDINGS = ["table_wise", "column_wise", "row_wise"]
# (ours, torchrec's, torchrec needs the CPU shim)
FAMILY: List[Tuple[Any, Any, bool]] = [
    (trec_pipelines.TrainPipelineSparseDist, upstream.TrainPipelineSparseDist, False),
    (trec_pipelines.TrainPipelineSparseDistLite, upstream.TrainPipelineSparseDistLite, False),
    (trec_pipelines.TrainPipelineFusedSparseDist, upstream.TrainPipelineFusedSparseDist, True),
]


def _run_torchrec(
    cls: Any, shim: bool, dmp: nn.Module, optimizer: Any, batches: List[Any], **kwargs: Any
) -> Run:
    if shim:
        with torchrec_on_cpu():
            return optional_run(cls(dmp, optimizer, DEVICE, **kwargs), batches, model=dmp)
    return optional_run(cls(dmp, optimizer, DEVICE, **kwargs), batches, model=dmp)


# Lite has no execute_all_batches (it always trains every batch), upstream and ours.
EQUAL_CASES = [
    pytest.param(
        ours,
        theirs,
        shim,
        execute_all,
        id=f"{ours.__name__}-{'all' if execute_all else 'drop_last_two'}",
    )
    for ours, theirs, shim in FAMILY
    for execute_all in (True, False)
    if execute_all or ours is not trec_pipelines.TrainPipelineSparseDistLite
]


@pytest.mark.parametrize("sharding_type", SHARDINGS)
@pytest.mark.parametrize("ours_cls, theirs_cls, shim, execute_all_batches", EQUAL_CASES)
def test_equal_to_non_pipelined(
    ours_cls: Any, theirs_cls: Any, shim: bool, execute_all_batches: bool, sharding_type: str
) -> None:
    batches = generate_data(num_batches=6, batch_size=8, seed=1)
    (ref_dmp, ref_opt), (their_dmp, their_opt), (dmp, opt) = Setting(sharding_type).pair(3)
    # Without execute_all_batches the last two batches are loaded but never trained.
    trained = batches if execute_all_batches else batches[:-2]
    kwargs = (
        {}
        if ours_cls is trec_pipelines.TrainPipelineSparseDistLite
        else {"execute_all_batches": execute_all_batches}
    )
    ref = non_pipelined(ref_dmp, ref_opt, trained)
    theirs = _run_torchrec(theirs_cls, shim, their_dmp, their_opt, batches, **kwargs)
    ours = optional_run(ours_cls(dmp, opt, DEVICE, **kwargs), batches, model=dmp)
    assert len(ref) == len(trained)
    assert_runs_equal(ref, theirs, ("non_pipelined", "torchrec"))
    assert_runs_equal(ref, ours, ("non_pipelined", ours_cls.__name__))


def test_multi_dataloader_pipelining() -> None:
    """Three iterators one after the other give the predictions of one pass."""
    batches = generate_data(num_batches=7, batch_size=4, seed=2)
    (ref_dmp, ref_opt), (their_dmp, their_opt), (dmp, opt) = Setting("table_wise").pair(3)
    ref = non_pipelined(ref_dmp, ref_opt, batches)
    runs = []
    for pipeline, model in (
        (
            upstream.TrainPipelineSparseDist(
                their_dmp, their_opt, DEVICE, execute_all_batches=True
            ),
            their_dmp,
        ),
        (trec_pipelines.TrainPipelineSparseDist(dmp, opt, DEVICE, execute_all_batches=True), dmp),
    ):
        outputs: List[torch.Tensor] = []
        for part in (batches[:-3], batches[-3:-2], batches[-2:]):
            outputs.extend(run_pipeline(pipeline, part, model=model))
        assert len(pipeline._pipelined_modules) == 2  # the unweighted and the weighted EBC
        runs.append(Run(outputs, weights(model)))
    assert_runs_equal(ref, runs[0], ("non_pipelined", "torchrec"))
    assert_runs_equal(ref, runs[1], ("non_pipelined", "trec_pipelines"))


@pytest.mark.parametrize(
    "ours_cls, theirs_cls, shim", FAMILY, ids=lambda x: getattr(x, "__name__", str(x))
)
def test_custom_fwd(ours_cls: Any, theirs_cls: Any, shim: bool) -> None:
    """The pipeline returns what custom_model_fwd returns (here predictions repeated)."""
    batches = generate_data(num_batches=4, batch_size=8, seed=3)
    (ref_dmp, ref_opt), (their_dmp, their_opt), (dmp, opt) = Setting("row_wise").pair(3)
    ref = non_pipelined(ref_dmp, ref_opt, batches)

    def doubling(model: nn.Module) -> Any:
        def forward(batch: Any) -> Tuple[torch.Tensor, torch.Tensor]:
            loss, pred = model(batch)
            return loss, pred.expand(pred.size(0) * 2, -1)

        return forward

    theirs = _run_torchrec(
        theirs_cls, shim, their_dmp, their_opt, batches, custom_model_fwd=doubling(their_dmp)
    )
    ours = optional_run(
        ours_cls(dmp, opt, DEVICE, custom_model_fwd=doubling(dmp)), batches, model=dmp
    )
    doubled = Run([p.expand(p.size(0) * 2, -1) for p in ref], ref.weights)
    assert all(p.size(0) == 16 for p in ours)
    assert_runs_equal(doubled, theirs, ("non_pipelined, doubled", "torchrec"))
    assert_runs_equal(doubled, ours, ("non_pipelined, doubled", ours_cls.__name__))


@pytest.mark.parametrize("stash_gradients", [False, True], ids=["no_stash", "stash"])
@pytest.mark.parametrize("start_batch", [0, 6])
@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise"])
def test_semi_sync_equal_to_torchrec(
    sharding_type: str, start_batch: int, stash_gradients: bool
) -> None:
    """Upstream checks SemiSync against a hand-written semi-synchronous loop;
    here torchrec's class (under the shim) is that oracle, step by step."""
    batches = generate_data(num_batches=10, batch_size=8, seed=4)
    setting = Setting(sharding_type, fused_params={"stochastic_rounding": False})
    (their_dmp, their_opt), (dmp, opt) = setting.pair(2)
    kwargs = dict(
        execute_all_batches=True, start_batch=start_batch, stash_gradients=stash_gradients
    )

    def drive(pipeline: Any, model: nn.Module) -> Tuple[Run, List[bool]]:
        """Run to the end, noting is_semi_sync() after each step, as upstream does."""
        it, outputs, modes = iter(batches), [], []
        while True:
            try:
                outputs.append(pipeline.progress(it).detach().clone())
            except StopIteration:
                return Run(outputs, weights(model)), modes
            modes.append(pipeline.is_semi_sync())

    with torchrec_on_cpu():
        theirs, their_modes = drive(
            upstream.TrainPipelineSemiSync(their_dmp, their_opt, DEVICE, **kwargs), their_dmp
        )
    ours, our_modes = drive(trec_pipelines.TrainPipelineSemiSync(dmp, opt, DEVICE, **kwargs), dmp)
    assert len(ours) == len(batches)
    assert_runs_equal(theirs, ours, ("torchrec", "trec_pipelines"))
    # Upstream's check, on every step but the last (whose answer is about a
    # batch that does not exist): semi-sync once batch start_batch - 1 is done.
    assert our_modes == their_modes
    assert our_modes[:-1] == [step + 1 >= start_batch for step in range(len(batches) - 1)]


@pytest.mark.parametrize(
    "cls",
    [trec_pipelines.EvalPipelineSparseDist, trec_pipelines.EvalPipelineFusedSparseDist],
    ids=lambda c: c.__name__,
)
def test_eval_processing_of_plain_tensors(cls: Any) -> None:
    """Upstream's test_processing without mocks: a model with no sharded module
    returning ``(None, batch)`` gets tensors as batches; each comes back in order."""

    class Echo(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.unused = nn.Linear(1, 1)

        def forward(self, item: torch.Tensor) -> Tuple[None, torch.Tensor]:
            return None, item

    data = [torch.tensor([i]) for i in range(7)]
    pipeline = cls(Echo(), None, DEVICE)
    it = iter(data)
    assert [pipeline.progress(it).item() for _ in range(7)] == list(range(7))
    with pytest.raises(StopIteration):
        pipeline.progress(it)


class PositionWeightedSparse(nn.Module):
    """Upstream's feature-processed model: a weighted EBC fed through one
    PositionWeightedModule per feature, its pooled outputs concatenated as the
    predictions and their mean as the loss; it reads ``batch.idlist_features``."""

    def __init__(self, max_lengths: List[int]) -> None:
        super().__init__()
        plain, _ = tables()
        names = [f for t in plain for f in t.feature_names]
        self.names = names
        self.fp_ebc = FeatureProcessedEmbeddingBagCollection(
            EmbeddingBagCollection(tables=plain, device=DEVICE, is_weighted=True),
            {
                name: PositionWeightedModule(max_feature_length=n)
                for name, n in zip(names, max_lengths, strict=True)
            },  # type: ignore[misc]
        )
        for param in self.parameters():
            nn.init.normal_(param, mean=0.0, std=0.01)

    def forward(self, batch: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        pooled = self.fp_ebc(batch.idlist_features)
        pred = torch.cat([pooled[name] for name in self.names], dim=1)
        return pred.mean(), pred


def test_feature_processed_ebc() -> None:
    max_lengths = [10, 10, 12, 12]
    plain, _ = tables()
    torch.manual_seed(0)
    model = PositionWeightedSparse(max_lengths)
    rank = torch.distributed.get_rank()
    torch.manual_seed(100 + rank)
    batches = [
        ModelInput.generate(
            tables=plain,
            weighted_tables=[],
            batch_size=4,
            world_size=1,
            num_float_features=NUM_FLOAT_FEATURES,
            max_feature_lengths=max_lengths,
        )[1][0]
        for _ in range(5)
    ]
    sharder = FeatureProcessedEmbeddingBagCollectionSharder(TestEBCSharder("table_wise", FUSED))
    copies = []
    for _ in range(3):
        dmp = DistributedModelParallel(
            module=copy.deepcopy(model),
            env=ShardingEnv.from_process_group(current_group()),
            device=DEVICE,
            sharders=[sharder],  # type: ignore[list-item]
        )
        copies.append((dmp, torch.optim.SGD(dmp.parameters(), lr=0.1)))
    with torch.no_grad():
        for dmp, _ in copies[1:]:
            copy_state(copies[0][0].state_dict(), dmp.state_dict())
    (ref_dmp, ref_opt), (their_dmp, their_opt), (dmp, opt) = copies
    ref = non_pipelined(ref_dmp, ref_opt, batches)
    theirs = optional_run(
        upstream.TrainPipelineSparseDist(their_dmp, their_opt, DEVICE), batches, model=their_dmp
    )
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, opt, DEVICE)
    ours = optional_run(pipeline, batches, model=dmp)
    assert_runs_equal(ref, theirs, ("non_pipelined", "torchrec"))
    assert_runs_equal(ref, ours, ("non_pipelined", "trec_pipelines"))
    (pipelined,) = pipeline.rewrite_result.modules
    assert isinstance(pipelined, ShardedFeatureProcessedEmbeddingBagCollection)


def test_restore_from_snapshot() -> None:
    """Upstream's snapshot test without postprocs: a model rewritten by the
    pipeline saves the state dict a plain sharded copy has, each loads the
    other's, and training goes on from the loaded state as it would have."""
    batches = generate_data(num_batches=6, batch_size=4, seed=8)
    (ref_dmp, ref_opt), (src_dmp, src_opt), (dst_dmp, dst_opt) = Setting("table_wise").pair(3)
    ref = non_pipelined(ref_dmp, ref_opt, batches)
    source = trec_pipelines.TrainPipelineSparseDist(src_dmp, src_opt, DEVICE)
    it = iter(batches[:3])
    first = [source.progress(it).detach().clone() for _ in range(3)]
    with pytest.raises(StopIteration):
        source.progress(it)
    assert source.rewrite_result is not None and source.rewrite_result.modules  # still rewritten
    snapshot = src_dmp.state_dict()
    plain_state = ref_dmp.state_dict()
    assert snapshot.keys() == plain_state.keys()
    # Pipelined -> sharded: the plain copy picks up where the pipeline stopped.
    missing, unexpected = dst_dmp.load_state_dict(snapshot)
    assert (missing, unexpected) == ([], [])
    rest = non_pipelined(dst_dmp, dst_opt, batches[3:])
    assert_runs_equal(
        ref, Run(first + list(rest), rest.weights), ("non_pipelined", "pipelined then restored")
    )
    # Sharded -> pipelined: load into the rewritten model, which then trains on.
    missing, unexpected = src_dmp.load_state_dict(ref_dmp.state_dict())
    assert (missing, unexpected) == ([], [])
    assert_runs_equal(Run([], weights(ref_dmp)), Run([], weights(src_dmp)))
