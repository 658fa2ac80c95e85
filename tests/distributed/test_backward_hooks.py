"""register_backward_hook on 2 gloo ranks: when the work runs, and that training is unchanged.

The hook records itself into a log shared with two markers of the EBC's
output-dist backward (the table-wise pooled all-to-all): ``launch`` when its
backward all-to-all is started, ``wait`` when it is waited on.  With
``OutputDistTensorFinder`` the work must run between the two, once per step;
a ``PARAM_GRAD`` site on a dense module runs once per step too.  Every run
must equal the plain loop bit for bit (the work here only records), and
torchrec's SparseDist, given the same site, records the same sequence.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List

import pytest
import torch
from torchrec.distributed import comm_ops
from torchrec.distributed.train_pipeline.backward_injection import (
    InjectionSite as UpstreamSite,
    InjectionTargetType as UpstreamTargetType,
    OutputDistTensorFinder as UpstreamFinder,
)
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipelineSparseDist as UpstreamSparseDist,
)
from torchrec.distributed.types import ShardingType

import trec_pipelines
from trec_pipelines.model.backward_hooks import (
    FirstGradTensorFinder,
    InjectionSite,
    InjectionTargetType,
    OutputDistTensorFinder,
)
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    assert_runs_equal,
    make_batches,
    make_sharded,
    plain_loop,
    run_pipeline,
)

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 7
N = 6


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> Iterator[List[str]]:
    """Shared log; the pooled all-to-all's backward halves append to it."""
    entries: List[str] = []

    def marking(fn: Callable[..., Any], mark: str) -> Any:
        def backward(*args: Any) -> Any:
            entries.append(mark)
            return fn(*args)

        return staticmethod(backward)

    # Wait.backward starts the backward all-to-all; Req.backward waits for it.
    monkeypatch.setattr(
        comm_ops.All2All_Pooled_Wait,
        "backward",
        marking(comm_ops.All2All_Pooled_Wait.backward, "launch"),
    )
    monkeypatch.setattr(
        comm_ops.All2All_Pooled_Req,
        "backward",
        marking(comm_ops.All2All_Pooled_Req.backward, "wait"),
    )
    yield entries


def output_dist_site() -> InjectionSite:
    return InjectionSite("ebc", OutputDistTensorFinder(ShardingType.TABLE_WISE))


ACTIVATION_CLASSES = [
    trec_pipelines.TrainPipelineSparseDist,
    trec_pipelines.TrainPipelineSparseDistLite,
    trec_pipelines.PrefetchTrainPipelineSparseDist,
]


@pytest.mark.parametrize("cls", ACTIVATION_CLASSES, ids=lambda c: c.__name__)
def test_work_runs_during_the_output_dist_backward(cls: Any, log: List[str]) -> None:
    batches = make_batches(N, seed=DATA_SEED)
    ref = plain_loop(*make_sharded(DLRM, "table_wise", seed=SEED), batches)
    assert log == ["launch", "wait"] * N  # the markers see the plain loop's backward
    log.clear()
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = cls(dmp, optimizer, DEVICE)
    seen: List[Any] = []

    def work(p: Any) -> None:
        seen.append(p)
        log.append("work")

    handle = pipeline.register_backward_hook(output_dist_site(), work)
    ours = run_pipeline(pipeline, batches, model=dmp)
    assert_runs_equal(ref, ours, ("plain_loop", cls.__name__))
    assert log == ["launch", "work", "wait"] * N
    assert seen == [pipeline] * N
    # Removing it stops it; the next epoch trains as before.
    handle.remove()
    log.clear()
    run_pipeline(pipeline, batches[:2], model=dmp)
    assert log == ["launch", "wait"] * 2


def test_torchrec_records_the_same_sequence_and_accepts_its_own_site(log: List[str]) -> None:
    """torchrec's site types work with ours; torchrec's pipeline makes the same log."""
    batches = make_batches(N, seed=DATA_SEED)
    site = UpstreamSite(
        fqn="ebc", tensor_finder=UpstreamFinder(sharding_type=ShardingType.TABLE_WISE)
    )
    runs, logs = [], []
    for cls in (UpstreamSparseDist, trec_pipelines.TrainPipelineSparseDist):
        log.clear()
        dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
        pipeline = cls(dmp, optimizer, DEVICE)
        pipeline.register_backward_hook(site, lambda p: log.append("work"))
        runs.append(run_pipeline(pipeline, batches, model=dmp))
        logs.append(list(log))
    assert logs[0] == logs[1] == ["launch", "work", "wait"] * N
    assert_runs_equal(runs[0], runs[1], ("torchrec", "trec_pipelines"))


@pytest.mark.parametrize(
    "cls",
    [
        trec_pipelines.TrainPipelineSparseDist,
        trec_pipelines.TrainPipelineFusedSparseDist,
        trec_pipelines.TrainPipelineSemiSync,
        trec_pipelines.PrefetchTrainPipelineSparseDist,
    ],
    ids=lambda c: c.__name__,
)
def test_param_grad_site_on_a_dense_module(cls: Any) -> None:
    """Every SparseDist-family pipeline: the work runs once per step, after
    the module's gradient is complete, and training matches the plain loop
    (SemiSync: torchrec's own SemiSync is checked in test_semi_sync; here it
    must equal ours without the hook)."""
    batches = make_batches(N, seed=DATA_SEED)
    runs = []
    for with_hook in (False, True):
        dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
        pipeline = cls(dmp, optimizer, DEVICE)
        grads: List[torch.Tensor] = []
        if with_hook:
            site = InjectionSite(
                "over_arch",
                FirstGradTensorFinder(),
                target_type=InjectionTargetType.PARAM_GRAD,
                hook_position=0.0,
            )
            layer = dmp.module.over_arch[0].weight

            def work(
                p: Any, mine: Any = pipeline, sink: List[Any] = grads, weight: Any = layer
            ) -> None:
                assert p is mine
                sink.append(weight.grad.detach().clone())

            pipeline.register_backward_hook(site, work)
        runs.append(run_pipeline(pipeline, batches, model=dmp))
    assert_runs_equal(runs[0], runs[1], ("without hook", "with hook"))
    assert len(grads) == N and all(g.abs().sum() > 0 for g in grads)
    if cls is trec_pipelines.TrainPipelineSparseDist:
        ref = plain_loop(*make_sharded(DLRM, "table_wise", seed=SEED), batches)
        assert_runs_equal(ref, runs[1], ("plain_loop", "with hook"))


def test_bad_sites_say_what_to_do() -> None:
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    with pytest.raises(ValueError, match="no module 'nope'"):
        pipeline.register_backward_hook(
            InjectionSite("nope", FirstGradTensorFinder()), lambda p: None
        )
    with pytest.raises(ValueError, match="can take a gradient hook"):
        # Sharded tables are updated in fbgemm's fused backward: no hook fires there.
        pipeline.register_backward_hook(
            InjectionSite(
                "ebc", FirstGradTensorFinder(), target_type=InjectionTargetType.PARAM_GRAD
            ),
            lambda p: None,
        )
    # torchrec's enum is read by value.
    pipeline.register_backward_hook(
        UpstreamSite(
            fqn="dense_arch",
            tensor_finder=FirstGradTensorFinder(),
            target_type=UpstreamTargetType.PARAM_GRAD,
        ),
        lambda p: None,
    ).remove()
    # A Fused pipeline's EBC returns embeddings looked up outside its forward: no output-dist token.
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    fused = trec_pipelines.TrainPipelineFusedSparseDist(dmp, optimizer, DEVICE)
    fused.register_backward_hook(output_dist_site(), lambda p: None)
    with pytest.raises(RuntimeError, match="PARAM_GRAD"):
        run_pipeline(fused, make_batches(2, seed=DATA_SEED), model=dmp)


@pytest.mark.parametrize(
    "cls",
    [trec_pipelines.EvalPipelineSparseDist, trec_pipelines.EvalPipelineFusedSparseDist],
    ids=lambda c: c.__name__,
)
def test_eval_pipelines_accept_a_hook_that_never_runs(cls: Any, log: List[str]) -> None:
    """No backward in eval: registering is allowed (as upstream) and changes nothing."""
    batches = make_batches(N, seed=DATA_SEED)
    ref_model, _ = make_sharded(DLRM, "table_wise", seed=SEED)
    ref_model.eval()
    with torch.no_grad():
        ref = [ref_model(b)[1] for b in batches]
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    dmp.eval()
    pipeline = cls(dmp, optimizer, DEVICE)
    site = (
        output_dist_site()
        if cls is trec_pipelines.EvalPipelineSparseDist
        else InjectionSite(
            "over_arch", FirstGradTensorFinder(), target_type=InjectionTargetType.PARAM_GRAD
        )
    )
    pipeline.register_backward_hook(site, lambda p: log.append("work"))
    ours = run_pipeline(pipeline, batches, model=dmp)
    assert len(ours) == N and all(torch.equal(a, b) for a, b in zip(ref, ours, strict=True))
    assert log == []
