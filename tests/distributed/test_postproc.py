"""Pipelined postprocs on 2 gloo ranks, against torchrec 1.8.0 and the plain loop.

Our adaptation of upstream's ``test_postproc.py`` (which needs a GPU there) and
of ``test_rewrite_model`` (``test_train_pipelines_utils.py``), on our own models
(:mod:`tests.distributed.postproc_models`).  Each case trains the same model
three ways on the same data: the plain loop, torchrec's class with
``pipeline_postproc=True`` and ours; every step's output and the final weights
must be equal, and ours must pipeline exactly what torchrec pipelines.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import pytest
import torch
import torchrec.distributed.train_pipeline as upstream
import torchrec.distributed.train_pipeline.train_pipelines as upstream_classes
from torch import nn
from torchrec.distributed.train_pipeline.pipeline_context import (
    TrainPipelineContext as UpstreamContext,
)
from torchrec.distributed.train_pipeline.postproc import PipelinedPostproc as UpstreamPostproc

import trec_pipelines
from tests.distributed.postproc_models import (
    DEVICE,
    AddNegatives,
    build,
    make_batches,
    plain,
    run,
)
from trec_pipelines import restore_model, rewrite_model
from trec_pipelines.model.args import (
    ArgInfo,
    CallArgs,
    DictOf,
    GetAttr,
    GetItem,
    ListOf,
    Noop,
    Postproc,
)
from trec_pipelines.model.context import TrainPipelineContext
from trec_pipelines.model.postproc import PipelinedPostproc
from trec_pipelines.testing.dlrm import assert_runs_equal


def three_ways(layout: str, name: str = "TrainPipelineSparseDist") -> Any:
    """Plain loop, torchrec's ``name`` and ours on ``layout``; returns (ours, theirs) pipelines."""
    ref = plain(layout)
    theirs_cls = getattr(upstream, name, None) or getattr(upstream_classes, name)
    theirs, upstream_pipeline, _ = run(theirs_cls, layout, pipeline_postproc=True)
    ours, pipeline, _ = run(getattr(trec_pipelines, name), layout, pipeline_postproc=True)
    assert_runs_equal(ref, theirs, ("plain_loop", "torchrec"))
    assert_runs_equal(ref, ours, ("plain_loop", "trec_pipelines"))
    return pipeline, upstream_pipeline


def fqns(postprocs: List[Any]) -> List[str]:
    """Sorted FQNs: upstream collects its postprocs in a set, so in no fixed order."""
    return sorted(p.fqn for p in postprocs)


def test_one_postproc_shared_by_two_sharded_modules() -> None:
    ours, theirs = three_ways("shared")
    assert len(theirs._pipelined_modules) == len(ours._pipelined_modules) == 2
    # Run once per batch, in the input_dist stage (the forward reuses the output).
    # (torchrec swaps the module for its wrapper; ours keeps it and swaps its forward.)
    assert theirs._model.module.postproc.postproc_module.calls == len(make_batches())
    assert ours._model.module.postproc.calls == len(make_batches())
    assert fqns(theirs._pipelined_postprocs) == fqns(ours._pipelined_postprocs) == ["postproc"]
    (postproc,) = ours._pipelined_postprocs
    for module, field in zip(ours._pipelined_modules, ("ids", "scored"), strict=True):
        assert module.forward.args == CallArgs([ArgInfo([Postproc(postproc), GetAttr(field)])], {})


def test_a_postproc_per_module_reading_batch_fields() -> None:
    ours, theirs = three_ways("keep")
    assert len(theirs._pipelined_modules) == len(ours._pipelined_modules) == 2
    assert (
        fqns(theirs._pipelined_postprocs)
        == fqns(ours._pipelined_postprocs)
        == ["keep_ids", "keep_scored"]
    )
    by_name = {p.fqn: p for p in ours._pipelined_postprocs}
    assert by_name["keep_ids"].args == CallArgs([ArgInfo([GetAttr("ids")])], {})
    assert by_name["keep_scored"].args == CallArgs([ArgInfo([GetAttr("scored")])], {})
    ebc, webc = ours._pipelined_modules
    assert ebc.forward.args == CallArgs([ArgInfo([Postproc(by_name["keep_ids"]), GetItem(0)])], {})
    assert webc.forward.args == CallArgs(
        [ArgInfo([Postproc(by_name["keep_scored"]), GetItem(0)])], {}
    )


def test_postprocs_reading_another_postproc() -> None:
    ours, theirs = three_ways("shared_then_keep")
    assert len(theirs._pipelined_modules) == len(ours._pipelined_modules) == 2
    names = ["keep_ids", "keep_scored", "postproc"]
    assert fqns(theirs._pipelined_postprocs) == fqns(ours._pipelined_postprocs) == names
    by_name = {p.fqn: p for p in ours._pipelined_postprocs}
    parent = by_name["postproc"]
    assert parent.args == CallArgs([ArgInfo([Noop()])], {})
    assert by_name["keep_ids"].args == CallArgs([ArgInfo([Postproc(parent), GetAttr("ids")])], {})
    assert by_name["keep_scored"].args == CallArgs(
        [ArgInfo([Postproc(parent), GetAttr("scored")])], {}
    )
    # The rewrite lists each postproc pipelined, each after the ones it reads.
    assert ours.rewrite_result.postproc_names == ["postproc", "keep_ids", "keep_scored"]


@pytest.mark.parametrize("layout", ["trainable", "trainable_then_keep"])
def test_postproc_with_trainable_parameters_is_not_pipelined(layout: str) -> None:
    ours, theirs = three_ways(layout)
    assert theirs._pipelined_modules == ours._pipelined_modules == []
    assert theirs._pipelined_postprocs == ours._pipelined_postprocs == []
    refused = dict(ours.rewrite_result.refused_postprocs)
    assert "it has parameters (scale)" in refused["postproc"]
    assert "postproc NOT pipelined: postproc: it has parameters" in ours.rewrite_result.report()


def test_input_modified_inline_keeps_only_that_tower_unpipelined() -> None:
    ours, theirs = three_ways("inline_edit")
    assert [m._is_weighted for m in theirs._pipelined_modules] == [True]
    assert [m._is_weighted for m in ours._pipelined_modules] == [True]
    assert fqns(theirs._pipelined_postprocs) == fqns(ours._pipelined_postprocs) == ["keep_scored"]
    assert ours._pipelined_postprocs[0].postproc_module is ours._model.module.keep_scored
    assert "keep_ids" in dict(ours.rewrite_result.refused_postprocs)
    ((name, reason),) = ours.rewrite_result.not_pipelined
    assert name == "ebc" and "keep_ids" in reason


def test_postproc_outputs_are_cached_in_their_batch_context() -> None:
    """After one step the current batch holds every postproc's output and the
    newly copied one none; the next step fills that one (same dict object)."""
    order = ["postproc", "keep_ids", "keep_scored"]
    cached: List[List[List[str]]] = []
    for cls in (upstream.TrainPipelineSparseDist, trec_pipelines.TrainPipelineSparseDist):
        dmp, optimizer = build("shared_then_keep")
        pipeline = cls(dmp, optimizer, DEVICE, pipeline_postproc=True)
        it = iter(make_batches())
        pipeline.progress(it)
        current, upcoming = (
            pipeline.contexts[0].postproc_fwd_results,
            pipeline.contexts[1].postproc_fwd_results,
        )
        seen = [list(current), list(upcoming)]
        pipeline.progress(it)
        seen.append(list(upcoming))
        cached.append(seen)
    theirs, ours = cached
    assert ours == theirs == [order, [], order]


def test_postproc_of_a_nested_model() -> None:
    class Outer(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, batch: Any) -> Any:
            return self.inner(batch)

    ref = plain("shared", wrap=Outer)
    theirs, upstream_pipeline, _ = run(
        upstream.TrainPipelineSparseDist, "shared", wrap=Outer, pipeline_postproc=True
    )
    ours, pipeline, _ = run(
        trec_pipelines.TrainPipelineSparseDist, "shared", wrap=Outer, pipeline_postproc=True
    )
    assert_runs_equal(ref, theirs, ("plain_loop", "torchrec"))
    assert_runs_equal(ref, ours, ("plain_loop", "trec_pipelines"))
    assert len(upstream_pipeline._pipelined_modules) == len(pipeline._pipelined_modules) == 2
    assert fqns(pipeline._pipelined_postprocs) == ["inner.postproc"]
    assert len(upstream_pipeline._pipelined_postprocs) == 1


def test_postproc_taking_collections_of_fields_constants_and_postproc_outputs() -> None:
    ours, theirs = three_ways("collections")
    assert len(theirs._pipelined_modules) == len(ours._pipelined_modules) == 2
    names = ["keep_ids", "keep_scored", "mix", "tenth"]
    assert fqns(theirs._pipelined_postprocs) == fqns(ours._pipelined_postprocs) == names
    by_name = {p.fqn: p for p in ours._pipelined_postprocs}
    dense, tenth = ArgInfo([GetAttr("dense")]), ArgInfo([Postproc(by_name["tenth"])])
    assert by_name["mix"].args == CallArgs(
        [
            ArgInfo([Noop()]),
            ArgInfo([ListOf([1, dense, tenth])]),
            ArgInfo([DictOf({"one": 1, "dense": dense, "tenth": tenth})]),
        ],
        {},
    )


# ------------------------------------------------------------------ rewrite


def test_rewrite_model_with_and_without_postprocs() -> None:
    """Upstream's test_rewrite_model: without postproc pipelining the towers
    behind the shared postproc keep their forwards; with it both are wrapped,
    their arguments start at the postproc, and the state dict is unchanged."""
    dmp, _ = build("shared")
    batch = make_batches(1)[0]
    keys = list(dmp.state_dict())

    class Marker:
        def __init__(self, name: str, call_args: CallArgs, module: Any) -> None:
            self.call_args = call_args

        def set_context(self, context: Any) -> None:
            pass

    # torchrec's own function on its own copy, for what it pipelines.
    theirs_dmp, _ = build("shared")
    from torchrec.distributed.train_pipeline.utils import _rewrite_model

    their_modules, *_ = _rewrite_model(
        model=theirs_dmp, context=UpstreamContext(), dist_stream=None, batch=None
    )
    assert their_modules == []
    their_modules, _, _, their_postprocs, _ = _rewrite_model(
        model=theirs_dmp,
        context=UpstreamContext(),
        dist_stream=None,
        batch=None,
        pipeline_postproc=True,
    )
    assert len(their_modules) == 2 and [type(p) for p in their_postprocs] == [UpstreamPostproc]

    without = rewrite_model(dmp, batch, Marker, "fx")
    assert without.pipelined == () and [n for n, _ in without.not_pipelined] == ["ebc", "webc"]
    assert not isinstance(dmp.module.ebc.forward, Marker)
    restore_model(without)

    with_postprocs = rewrite_model(
        dmp,
        batch,
        Marker,
        "fx",
        make_postproc=lambda fqn, module, args: PipelinedPostproc(
            module, fqn, args, TrainPipelineContext(), None, None
        ),
    )
    assert with_postprocs.names == ["ebc", "webc"]
    (postproc,) = with_postprocs.postprocs
    assert postproc.postproc_module is dmp.module.postproc and isinstance(
        dmp.module.postproc, AddNegatives
    )
    assert dmp.module.postproc.forward is postproc
    for tower in (dmp.module.ebc, dmp.module.webc):
        assert isinstance(tower.forward, Marker)
        assert tower.forward.call_args.args[0].postprocs() == [postproc]
    assert list(dmp.state_dict()) == keys
    missing, unexpected = dmp.load_state_dict(dmp.state_dict())
    assert missing == [] and unexpected == []
    restore_model(with_postprocs)
    assert "forward" not in dmp.module.postproc.__dict__


# ------------------------------------------------------------ every variant


def test_lite_with_postprocs_against_torchrec() -> None:
    ours, theirs = three_ways("collections", "TrainPipelineSparseDistLite")
    assert len(theirs._pipelined_modules) == len(ours._pipelined_modules) == 2
    assert fqns(theirs._pipelined_postprocs) == fqns(ours._pipelined_postprocs)


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("TrainPipelineFusedSparseDist", {}),
        ("TrainPipelineFusedSparseDist", {"emb_lookup_stream": "new"}),
        ("TrainPipelineSemiSync", {}),
        ("PrefetchTrainPipelineSparseDist", {}),
    ],
)
def test_variants_torchrec_cannot_run_on_cpu_against_the_plain_loop(name: str, kwargs: Any) -> None:
    """pipeline_postproc defaults to True for these, as upstream."""
    ref = plain("collections")
    ours, pipeline, dmp = run(getattr(trec_pipelines, name), "collections", **kwargs)
    assert_runs_equal(ref, ours, ("plain_loop", name))
    assert len(pipeline._pipelined_modules) == 2
    assert fqns(pipeline._pipelined_postprocs) == ["keep_ids", "keep_scored", "mix", "tenth"]


def _eval_run(cls: Any, layout: str, **kwargs: Any) -> Tuple[List[torch.Tensor], Any]:
    dmp, optimizer = build(layout)
    dmp.eval()
    pipeline = cls(dmp, optimizer, DEVICE, **kwargs)
    outputs = []
    it = iter(make_batches())
    while True:
        try:
            out = pipeline.progress(it)
        except StopIteration:
            break
        outputs.append((out[1] if isinstance(out, tuple) else out).detach().clone())
    return outputs, pipeline


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("EvalPipelineSparseDist", {"pipeline_postproc": True}),
        ("EvalPipelineFusedSparseDist", {"emb_lookup_stream": "new"}),
        (
            "EvalPipelineFusedSparseDist",
            {"emb_lookup_stream": "new", "enable_embedding_lookup_prefetch": True},
        ),
    ],
)
def test_eval_variants_with_postprocs(name: str, kwargs: Any) -> None:
    """Against eval-mode forwards, and torchrec's EvalPipelineSparseDist (which runs on CPU)."""
    layout = "shared_then_keep"
    dmp, _ = build(layout)
    dmp.eval()
    with torch.no_grad():
        expected = [dmp(batch)[1] for batch in make_batches()]
    ours, pipeline = _eval_run(getattr(trec_pipelines, name), layout, **kwargs)
    assert len(ours) == len(expected) and all(
        torch.equal(a, b) for a, b in zip(ours, expected, strict=True)
    )
    assert fqns(pipeline._pipelined_postprocs) == ["keep_ids", "keep_scored", "postproc"]
    if name == "EvalPipelineSparseDist":
        theirs, upstream_pipeline = _eval_run(
            upstream.EvalPipelineSparseDist, layout, pipeline_postproc=True
        )
        assert len(theirs) == len(ours) and all(
            torch.equal(a, b) for a, b in zip(theirs, ours, strict=True)
        )
        assert len(upstream_pipeline._pipelined_postprocs) == 3
