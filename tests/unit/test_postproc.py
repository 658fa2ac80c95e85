"""Postproc modules (``pipeline_postproc=True``) on the fake sharded module.

What is pipelined and what is refused (with the reason), how each argument is
read, that a postproc runs once per batch in the input_dist stage and the
forward reuses its output, and that detach/attach put the postprocs' own
forwards back and wrap them again.  Training is compared with the plain loop;
the 2-rank tier (tests/distributed/test_postproc.py) compares with torchrec.
"""

from __future__ import annotations

from typing import Any, Callable, List

import pytest
import torch

from tests.unit.fakes import assert_same_training, drain, make_batches, optimizer_for, plain_loop
from tests.unit.postproc_fakes import (
    CalledTwiceModel,
    CollectionArgsModel,
    HashIds,
    InlineEditModel,
    LearnedScale,
    PostprocModel,
)
from trec_pipelines import (
    EvalPipelineSparseDist,
    PrefetchTrainPipelineSparseDist,
    TrainPipelineFusedSparseDist,
    TrainPipelineSemiSync,
    TrainPipelineSparseDist,
    TrainPipelineSparseDistCompAutograd,
    TrainPipelineSparseDistLite,
    restore_model,
    rewrite_model,
    use_context_for_postprocs,
)
from trec_pipelines.model.args import (
    ArgInfo,
    ArgInfoStepFactory,
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

CPU = torch.device("cpu")


def _pipeline(model: torch.nn.Module, cls: Any = TrainPipelineSparseDist, **kwargs: Any) -> Any:
    return cls(model, optimizer_for(model), CPU, **kwargs)


def _trains_like_plain_loop(
    model_factory: Callable[[], torch.nn.Module], n: int = 5, **kwargs: Any
) -> Any:
    batches = make_batches(n)
    model, ref = model_factory(), model_factory()
    pipeline = _pipeline(model, **kwargs)
    outputs = drain(pipeline, iter(batches))
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)
    return pipeline


# ------------------------------------------------------------ what is pipelined


def test_postproc_chain_is_pipelined_and_each_argument_read_back() -> None:
    pipeline = _trains_like_plain_loop(PostprocModel, pipeline_postproc=True)
    result = pipeline.rewrite_result
    assert result.names == ["sparse"] and result.not_pipelined == ()
    hasher, as_list = pipeline._pipelined_postprocs
    assert (hasher.fqn, as_list.fqn) == ("hasher", "as_list")  # each after what it reads
    assert hasher.args.args == [ArgInfo([Noop()])]  # the batch itself
    assert as_list.args.args == [ArgInfo([Postproc(hasher), GetAttr("sparse")])]
    (module,) = pipeline._pipelined_modules
    assert module.forward.args.args == [ArgInfo([Postproc(as_list), GetItem(0)])]
    assert str(module.forward.args) == "(as_list(...)[0])"
    assert (
        pipeline._model.hasher.forward is hasher
        and hasher.postproc_module is pipeline._model.hasher
    )
    report = result.report()
    assert "postproc pipelined: hasher(batch)" in report
    assert "postproc pipelined: as_list(hasher(...).sparse)" in report


def test_each_postproc_runs_once_per_batch() -> None:
    model = PostprocModel()
    pipeline = _pipeline(model, pipeline_postproc=True)
    outputs = drain(pipeline, iter(make_batches(4)))
    assert len(outputs) == 4
    # Postprocs are FX leaves: tracing never runs them, so these are the stages' calls.
    assert model.hasher.calls == 4 and model.as_list.calls == 4


def test_forward_gets_the_output_cached_in_the_context() -> None:
    model = PostprocModel()
    pipeline = _pipeline(model, pipeline_postproc=True)
    it = iter(make_batches(5))
    pipeline.progress(it)
    cur, nxt = pipeline.contexts[0], pipeline.contexts[1]
    assert list(cur.postproc_fwd_results) == ["hasher", "as_list"]  # input_dist stage done
    assert nxt.postproc_fwd_results == {}  # only copied so far
    cached = cur.postproc_fwd_results["hasher"]
    seen: List[Any] = []
    handle = model.hasher.register_forward_hook(lambda m, i, o: seen.append(o))
    try:
        pipeline.progress(it)
    finally:
        handle.remove()
    assert seen == [cached]  # the model's call returned the stage's output, not a new one
    assert list(nxt.postproc_fwd_results) == ["hasher", "as_list"]  # filled by that progress()


def test_without_pipeline_postproc_the_module_is_left_alone_and_says_how() -> None:
    pipeline = _trains_like_plain_loop(PostprocModel)
    result = pipeline.rewrite_result
    ((name, reason),) = result.not_pipelined
    assert name == "sparse" and "output of module 'as_list'" in reason
    assert "pipeline_postproc=True" in reason
    assert result.postprocs == () and pipeline._pipelined_postprocs == []
    assert "forward" not in pipeline._model.hasher.__dict__


# --------------------------------------------------------------- refusals


def test_postproc_with_parameters_is_refused_with_its_modules() -> None:
    pipeline = _trains_like_plain_loop(
        lambda: PostprocModel(LearnedScale()), pipeline_postproc=True
    )
    result = pipeline.rewrite_result
    assert result.pipelined == () and result.postprocs == ()
    assert pipeline._pipelined_modules == [] and pipeline._pipelined_postprocs == []
    refused = dict(result.refused_postprocs)
    assert "parameters (scale)" in refused["hasher"]
    assert "postproc NOT pipelined: hasher: it has parameters (scale)" in result.report()
    # as_list itself is fine but reads the refused one: refused too, saying why.
    assert refused["as_list"] == "it reads the output of module 'hasher', which can't run ahead"


def test_postproc_called_twice_is_refused() -> None:
    pipeline = _trains_like_plain_loop(CalledTwiceModel, pipeline_postproc=True)
    assert pipeline.rewrite_result.pipelined == ()
    assert "called 2 times" in dict(pipeline.rewrite_result.refused_postprocs)["hasher"]


def test_postproc_with_a_forward_hook_is_refused() -> None:
    def hooked() -> PostprocModel:
        model = PostprocModel()
        model.as_list.register_forward_hook(lambda m, i, o: None)
        return model

    pipeline = _trains_like_plain_loop(hooked, pipeline_postproc=True)
    assert "forward hooks" in dict(pipeline.rewrite_result.refused_postprocs)["as_list"]
    assert pipeline.rewrite_result.pipelined == ()


def test_input_modified_inline_before_the_postproc_is_refused() -> None:
    pipeline = _trains_like_plain_loop(InlineEditModel, pipeline_postproc=True)
    result = pipeline.rewrite_result
    assert result.pipelined == () and result.postprocs == ()
    assert "modifies the input" in dict(result.refused_postprocs)["as_list"]


# ------------------------------------------------------- collection arguments


def test_postproc_taking_a_list_and_a_dict_of_batch_fields_and_postproc_outputs() -> None:
    pipeline = _trains_like_plain_loop(CollectionArgsModel, pipeline_postproc=True)
    assert pipeline.rewrite_result.names == ["sparse"]
    tenth, mix = pipeline._pipelined_postprocs
    assert (tenth.fqn, mix.fqn) == ("tenth", "mix")
    batch_arg, listed, named = mix.args.args
    assert batch_arg == ArgInfo([Noop()])
    dense, from_tenth = ArgInfo([GetAttr("dense")]), ArgInfo([Postproc(tenth)])
    assert listed == ArgInfo([ListOf([1, dense, from_tenth])])
    assert named == ArgInfo([DictOf({"one": 1, "dense": dense, "tenth": from_tenth})])


# ------------------------------------------------------------ every variant


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (TrainPipelineSparseDist, {"pipeline_postproc": True}),
        (TrainPipelineSparseDistLite, {"pipeline_postproc": True}),
        (TrainPipelineFusedSparseDist, {}),  # pipeline_postproc defaults to True, as upstream
        (TrainPipelineSemiSync, {"start_batch": 10}),  # default True; sync steps match the loop
        (PrefetchTrainPipelineSparseDist, {}),  # default True
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_every_training_variant_pipelines_the_postprocs(cls: Any, kwargs: Any) -> None:
    pipeline = _trains_like_plain_loop(PostprocModel, cls=cls, **kwargs)
    assert pipeline.rewrite_result.names == ["sparse"]
    assert [p.fqn for p in pipeline._pipelined_postprocs] == ["hasher", "as_list"]
    assert pipeline._model.hasher.calls == 5


def test_compiled_autograd_variant_pipelines_the_postprocs() -> None:
    def model() -> PostprocModel:
        m = PostprocModel()
        # Compiled autograd with the "eager" backend: the captured backward runs op by op.
        m._compiled_autograd_options = {"backend": "eager", "dynamic": True, "fullgraph": False}
        return m

    pipeline = _trains_like_plain_loop(
        model, cls=TrainPipelineSparseDistCompAutograd, pipeline_postproc=True
    )
    assert [p.fqn for p in pipeline._pipelined_postprocs] == ["hasher", "as_list"]
    assert pipeline._model.hasher.calls == 5


def test_eval_pipeline_pipelines_the_postprocs() -> None:
    batches = make_batches(4)
    model, ref = PostprocModel().eval(), PostprocModel().eval()
    pipeline = EvalPipelineSparseDist(model, None, CPU, pipeline_postproc=True)
    outputs = drain(pipeline, iter(batches))
    with torch.no_grad():
        expected = [ref(batch)[1] for batch in batches]
    assert len(outputs) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))
    assert [p.fqn for p in pipeline._pipelined_postprocs] == ["hasher", "as_list"]


# ------------------------------------------------------ detach / attach / rewrite


def test_detach_puts_the_postprocs_back_and_attach_wraps_the_same_ones_again() -> None:
    batches = make_batches(6)
    model, ref = PostprocModel(), PostprocModel()
    state_before = list(model.state_dict())
    pipeline = _pipeline(model, pipeline_postproc=True)
    it = iter(batches)
    outputs = [pipeline.progress(it), pipeline.progress(it)]
    wrappers = pipeline._pipelined_postprocs
    assert model.hasher.forward is wrappers[0]
    detached = pipeline.detach()
    assert "forward" not in detached.hasher.__dict__ and "forward" not in detached.as_list.__dict__
    assert "forward" not in detached.sparse.__dict__
    outputs.append(pipeline.progress(it))  # attaches again
    assert pipeline._pipelined_postprocs == wrappers and model.hasher.forward is wrappers[0]
    pipeline.detach()
    pipeline.attach()
    outputs += drain(pipeline, it)
    assert list(model.state_dict()) == state_before
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)


def test_rewrite_and_restore_keep_the_state_dict() -> None:
    """Upstream swaps the postproc module itself and needs state_dict shims;
    swapping only its forward leaves the model's structure alone."""
    model = PostprocModel()
    keys = list(model.state_dict())
    made: List[PipelinedPostproc] = []

    def make_postproc(fqn: str, module: torch.nn.Module, args: Any) -> PipelinedPostproc:
        made.append(PipelinedPostproc(module, fqn, args, TrainPipelineContext(), None, None))
        return made[-1]

    plain = rewrite_model(model, make_batches(1)[0], lambda n, a, m: lambda *x: None, "fx")
    assert plain.pipelined == () and "forward" not in model.hasher.__dict__
    restore_model(plain)
    result = rewrite_model(
        model,
        make_batches(1)[0],
        lambda n, a, m: lambda *x: None,
        "fx",
        make_postproc=make_postproc,
    )
    assert result.names == ["sparse"] and list(result.postprocs) == made
    assert isinstance(model.hasher.forward, PipelinedPostproc)
    assert list(model.state_dict()) == keys
    missing, unexpected = model.load_state_dict(model.state_dict())
    assert missing == [] and unexpected == []
    restore_model(result)
    assert all("forward" not in m.__dict__ for m in (model.hasher, model.as_list, model.sparse))


def test_a_postproc_called_outside_its_stage_runs_its_own_forward() -> None:
    module = HashIds()
    wrapper = PipelinedPostproc(
        module, "hasher", CallArgs([ArgInfo([Noop()])], {}), TrainPipelineContext(), None, None
    )
    batch = make_batches(1)[0]
    out = wrapper(batch)
    assert torch.equal(out.dense, batch.dense * 2.0) and module.calls == 1


def test_a_recipe_built_with_torchrecs_factory_runs_the_postproc_once_per_batch_context() -> None:
    """The torchrec way: the wrapper holds a context, pointed at the batch being
    distributed by use_context_for_postprocs; a postproc step caches there."""
    module = HashIds()
    forward_context = TrainPipelineContext(index=0)
    wrapper = PipelinedPostproc(
        module, "hasher", CallArgs([ArgInfo([Noop()])], {}), forward_context, None, None
    )
    recipe = CallArgs(
        [ArgInfo([ArgInfoStepFactory.postproc(wrapper), ArgInfoStepFactory.get_attr("dense")])], {}
    )
    assert str(recipe) == "(hasher(...).dense)"
    batch = make_batches(1)[0]
    first_context, second_context = TrainPipelineContext(index=1), TrainPipelineContext(index=2)
    with use_context_for_postprocs([wrapper], first_context):
        assert wrapper.get_context() is first_context
        (dense,), _ = recipe.build_args_kwargs(batch)
        (again,), _ = recipe.build_args_kwargs(batch)
    assert wrapper.get_context() is forward_context  # given back for the forward
    assert module.calls == 1 and again is dense and torch.equal(dense, batch.dense * 2.0)
    with use_context_for_postprocs([wrapper], second_context):
        recipe.build_args_kwargs(batch)
    assert module.calls == 2 and forward_context.postproc_fwd_results == {}
    # The model's call in the forward of the first batch reads its cached output.
    wrapper.set_context(first_context)
    assert wrapper(batch) is first_context.postproc_fwd_results["hasher"] and module.calls == 2


def test_the_wrapper_shows_the_modules_own_names_and_state() -> None:
    module = HashIds()
    wrapper = PipelinedPostproc(
        module, "hasher", CallArgs([ArgInfo([Noop()])], {}), TrainPipelineContext(), None, None
    )
    assert list(wrapper.state_dict()) == list(module.state_dict()) == ["offset"]
    assert [n for n, _ in wrapper.named_buffers()] == ["offset"]
    assert [n for n, _ in wrapper.named_parameters()] == []
    assert [m for _, m in wrapper.named_modules()] == [wrapper, module]
    wrapper.load_state_dict({"offset": torch.tensor(3)})
    assert int(module.offset) == 3


def test_sparse_data_dist_util_runs_the_postprocs_in_its_input_dist_stage() -> None:
    from tests.unit.test_staged import h2d_stage, train_staged
    from trec_pipelines import SparseDataDistUtil, StagedTrainPipeline

    batches = make_batches(6)
    model, ref = PostprocModel(), PostprocModel()
    sdd = SparseDataDistUtil(model, data_dist_stream=None, pipeline_postproc=True)
    pipeline = StagedTrainPipeline([h2d_stage(), sdd.start_sparse_data_dist_stage()])
    outputs = train_staged(model, pipeline, batches, optimizer_for(model))
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)
    assert sdd.rewrite_result is not None and sdd.rewrite_result.names == ["sparse"]
    assert [p.fqn for p in sdd._pipelined_postprocs] == ["hasher", "as_list"]
    assert model.hasher.calls == len(batches)


def test_eval_progress_after_detach_attaches_again() -> None:
    batches = make_batches(5)
    model, ref = PostprocModel().eval(), PostprocModel().eval()
    pipeline = EvalPipelineSparseDist(model, None, CPU, pipeline_postproc=True)
    it = iter(batches)
    outputs = [pipeline.progress(it), pipeline.progress(it)]
    pipeline.detach()
    assert "forward" not in model.hasher.__dict__ and "forward" not in model.sparse.__dict__
    outputs += drain(pipeline, it)  # the first call attaches again
    with torch.no_grad():
        expected = [ref(batch)[1] for batch in batches]
    assert len(outputs) == len(expected) and all(
        torch.equal(a, b) for a, b in zip(outputs, expected, strict=True)
    )
    assert model.hasher.calls == len(batches)


def test_record_stream_tree_reaches_every_tensor_and_multistreamable_in_an_output() -> None:
    from trec_pipelines.core.streams import record_stream_tree

    class Recorded:
        def __init__(self) -> None:
            self.streams: List[Any] = []

        def record_stream(self, stream: Any) -> None:
            self.streams.append(stream)

    leaves = [Recorded() for _ in range(4)]
    stream = object()
    record_stream_tree([leaves[0], (leaves[1], {"k": leaves[2]}), 3, "text", None], stream)
    record_stream_tree(leaves[3], None)  # no stream (CPU): nothing to record
    assert [leaf.streams for leaf in leaves] == [[stream], [stream], [stream], []]


def test_on_unpipelined_raise_refuses_a_model_whose_postproc_cannot_run_ahead() -> None:
    model = PostprocModel(LearnedScale())
    pipeline = _pipeline(model, pipeline_postproc=True, on_unpipelined="raise")
    with pytest.raises(
        RuntimeError,
        match=r"(?s)on_unpipelined='raise'.*postproc NOT pipelined: hasher: it has parameters",
    ):
        pipeline.progress(iter(make_batches(3)))
    assert all("forward" not in m.__dict__ for m in (model.hasher, model.as_list, model.sparse))
