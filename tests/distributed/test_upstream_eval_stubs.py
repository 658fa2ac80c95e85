"""A subclass of the Eval pipeline that stubs hooks nobody calls, on 2 gloo ranks.

Adapted from upstream's ``EvalPipelineSparseDistTest::test_processing``: there
a subclass of torchrec's ``EvalPipelineSparseDist`` replaces the model rewrite
(``_init_pipelined_modules``) and the first pipeline API's
``_start_sparse_data_dist`` / ``_wait_sparse_data_dist`` with methods that do
nothing, runs over a model that hands back each batch as its output, and
expects the seven one-element batches back in order, then ``StopIteration``.
torchrec's Eval never calls those two methods, so stubbing them is harmless
there; ours must create that class (with one warning per hook), run it, and
give what torchrec's class gives, step by step.  Every stub records its calls:
the rewrite's is called by both, once; the first API's by neither.

Written afresh for this repository; torchrec's class is the reference, on the
same model and data, in the same subclass.  The second test runs that subclass
(first API stubbed, rewrite kept) over a sharded DLRM in eval mode, where a stub
that ran would leave the input dist undone: the predictions must equal the
plain eval loop's and torchrec's (which runs there under the CPU shim).
"""

from __future__ import annotations

import warnings
from typing import Any, List, Tuple, Type

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.train_pipeline.train_pipelines import (
    EvalPipelineSparseDist as UpstreamEval,
)

from tests.distributed.test_upstream_eval import eval_loop
from tests.time_limits import exit_after
from trec_pipelines import EvalPipelineSparseDist
from trec_pipelines.core.subclass_hooks import UncalledHookWarning
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    Run,
    assert_runs_equal,
    make_batches,
    make_sharded,
    run_pipeline,
    weights,
)
from trec_pipelines.testing.torchrec_cpu import shim_active, torchrec_on_cpu

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 7
# Beyond this a run is stuck (a loader thread that never hands over a batch): the
# rank dumps its threads' stacks and exits, and the other fails at the next barrier.
TIME_LIMIT_S = 180
FIRST_API = ["_start_sparse_data_dist", "_wait_sparse_data_dist"]


class Echo(nn.Module):
    """Returns each batch as its output (and no loss), as the upstream test's mock does."""

    def forward(self, batch: torch.Tensor) -> Tuple[None, torch.Tensor]:
        return None, batch


def stubbing(base: Type[Any], stub_rewrite: bool) -> Type[Any]:
    """``base`` with the first pipeline API (and, if ``stub_rewrite``, the model
    rewrite) replaced by methods that only note they were called."""

    class StubbingEval(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.stub_calls: List[str] = []
            super().__init__(*args, **kwargs)

        def _start_sparse_data_dist(self, item: Any, context: Any = None) -> None:
            self.stub_calls.append("_start_sparse_data_dist")

        def _wait_sparse_data_dist(self, context: Any = None) -> None:
            self.stub_calls.append("_wait_sparse_data_dist")

        if stub_rewrite:

            def _init_pipelined_modules(
                self, item: Any, context: Any, pipelined_forward: Any
            ) -> None:
                self.stub_calls.append("_init_pipelined_modules")

    return StubbingEval


def build(base: Type[Any], stub_rewrite: bool) -> Tuple[Type[Any], List[str]]:
    """The stubbing subclass of ``base``, and what its class statement warned about."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cls = stubbing(base, stub_rewrite)
    warned = [str(w.message) for w in caught if issubclass(w.category, UncalledHookWarning)]
    return cls, warned


def drive(pipeline: Any, batches: List[torch.Tensor]) -> List[torch.Tensor]:
    """What ``progress`` returns for each batch; then it must raise StopIteration."""
    it = iter(batches)
    outputs = [pipeline.progress(it).clone() for _ in batches]
    with pytest.raises(StopIteration):
        pipeline.progress(it)
    return outputs


def test_stubbed_first_api_and_rewrite_echo_every_batch_as_torchrec() -> None:
    batches = [torch.tensor([i]) for i in range(7)]
    assert not shim_active()
    ours_cls, ours_warned = build(EvalPipelineSparseDist, stub_rewrite=True)
    # Creating the class is allowed; the rewrite is honoured (no warning for it),
    # the first API's two hooks are named once each.
    assert len(ours_warned) == 2, ours_warned
    for hook, message in zip(FIRST_API, ours_warned, strict=True):
        assert f"overrides {hook}," in message and "no effect" in message, message
    theirs_cls, theirs_warned = build(UpstreamEval, stub_rewrite=True)
    assert theirs_warned == []  # torchrec's class checks nothing

    with exit_after(TIME_LIMIT_S):
        theirs = theirs_cls(Echo().eval(), None, DEVICE)
        theirs_out = drive(theirs, batches)
        ours = ours_cls(Echo().eval(), None, DEVICE)
        ours_out = drive(ours, batches)

    # What upstream's test checks: the i-th step hands back the i-th batch.
    for i, (a, b) in enumerate(zip(theirs_out, ours_out, strict=True)):
        assert torch.equal(a, torch.tensor([i])), ("torchrec", i, a)
        assert torch.equal(b, torch.tensor([i])), ("trec_pipelines", i, b)
    # The stubs ran as in torchrec's class: the rewrite once, the first API never.
    assert theirs.stub_calls == ["_init_pipelined_modules"], theirs.stub_calls
    assert ours.stub_calls == theirs.stub_calls, ours.stub_calls
    # Every rank stepped through all its batches.
    steps = torch.tensor([len(ours_out)])
    dist.all_reduce(steps)
    assert steps.item() == 7 * dist.get_world_size()


def _sharded_eval(cls: Type[Any], batches: List[Any], sharding_type: str) -> Tuple[Run, List[str]]:
    dmp, _ = make_sharded(DLRM, sharding_type, seed=SEED)
    dmp.eval()
    pipeline = cls(dmp, None, DEVICE)
    return run_pipeline(pipeline, batches, model=dmp), pipeline.stub_calls


@pytest.mark.parametrize("sharding_type", ["table_wise", "column_wise"])
def test_stubbed_first_api_changes_nothing_on_a_sharded_model(sharding_type: str) -> None:
    """The first API stubbed on a sharded DLRM in eval mode: if either pipeline called a
    stub, a batch's input dist would never start and its step would fail or differ."""
    batches = make_batches(6, seed=DATA_SEED)
    reference, _ = make_sharded(DLRM, sharding_type, seed=SEED)
    before = weights(reference)
    ref = eval_loop(reference, batches)
    # (The class statement warned in the test above already: it warns once.)
    ours_cls, _ = build(EvalPipelineSparseDist, stub_rewrite=False)
    theirs_cls, _ = build(UpstreamEval, stub_rewrite=False)
    with exit_after(TIME_LIMIT_S):
        with torchrec_on_cpu():
            theirs, theirs_calls = _sharded_eval(theirs_cls, batches, sharding_type)
        assert not shim_active()
        ours, ours_calls = _sharded_eval(ours_cls, batches, sharding_type)
    assert theirs_calls == [] and ours_calls == [], (theirs_calls, ours_calls)
    assert len(ref) == len(batches)
    assert_runs_equal(ref, theirs, ("eval loop", "torchrec's Eval, first API stubbed"))
    assert_runs_equal(ref, ours, ("eval loop", "our Eval, first API stubbed"))
    assert_runs_equal(Run([], before), Run([], ours.weights), ("weights before", "after eval"))
