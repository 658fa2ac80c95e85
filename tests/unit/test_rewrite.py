"""rewrite_model / restore_model: both paths, what is pipelined and why not."""

from __future__ import annotations

import pytest
import torch

from tests.unit.fakes import (
    ModifyingModel,
    NestedModel,
    TinyModel,
    TwiceModel,
    assert_same_training,
    drain,
    make_batches,
    plain_loop,
    sparse_dist_pipeline,
)
from trec_pipelines import restore_model, rewrite_model
from trec_pipelines.model.args import ArgInfo, CallArgs, GetAttr, GetItem


def _noop_forward(name, call_args, module):  # type: ignore[no-untyped-def]
    return lambda *a, **k: (name, call_args)


@pytest.mark.parametrize("strategy", ["fx", "direct", "auto"])
def test_round_trip_restores_class_forward(strategy: str) -> None:
    model = TinyModel()
    batch = make_batches(1)[0]
    assert "forward" not in model.sparse.__dict__
    result = rewrite_model(model, batch, _noop_forward, strategy)  # type: ignore[arg-type]
    assert result.names == ["sparse"]
    assert result.pipelined[0].call_args == CallArgs([ArgInfo([GetAttr("sparse")])], {})
    assert model.sparse.is_pipelined
    restore_model(result)
    assert "forward" not in model.sparse.__dict__
    assert not model.sparse.is_pipelined


def test_fx_reads_kjt_inside_a_dict() -> None:
    batch = make_batches(1, nested=True)[0]
    result = rewrite_model(NestedModel(), batch, _noop_forward, "fx")
    call_args = result.pipelined[0].call_args
    assert str(call_args) == "(batch.features['ids'])"
    assert call_args.build_args_kwargs(batch)[0][0] is batch.features["ids"]
    assert result.pipelined[0].call_args.args[0].steps == [GetAttr("features"), GetItem("ids")]


def test_direct_finds_kjt_inside_a_dict() -> None:
    batch = make_batches(1, nested=True)[0]
    result = rewrite_model(NestedModel(), batch, _noop_forward, "direct")
    assert str(result.pipelined[0].call_args) == "(batch.features['ids'])"


def test_modified_input_is_not_pipelined_and_names_the_node(
    caplog: pytest.LogCaptureFixture,
) -> None:
    result = rewrite_model(ModifyingModel(), make_batches(1)[0], _noop_forward, "fx")
    assert result.pipelined == ()
    ((name, reason),) = result.not_pipelined
    assert name == "sparse"
    assert "FX node 'permute'" in reason
    assert "NOT pipelined" in caplog.text


def test_unpipelined_module_still_trains_correctly() -> None:
    batches = make_batches(4)
    model, ref = ModifyingModel(), ModifyingModel()
    outputs = drain(sparse_dist_pipeline(model), iter(batches))
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)


def test_module_called_twice_is_left_alone_by_fx() -> None:
    result = rewrite_model(TwiceModel(), make_batches(1)[0], _noop_forward, "fx")
    assert result.pipelined == ()
    assert "called 2 times" in result.not_pipelined[0][1]


def test_module_called_twice_raises_with_the_fix_when_bound_directly() -> None:
    pipeline = sparse_dist_pipeline(TwiceModel(), rewrite_strategy="direct")
    with pytest.raises(RuntimeError, match="called twice in one forward"):
        pipeline.progress(iter(make_batches(3)))


@pytest.mark.parametrize("strategy", ["fx", "direct"])
@pytest.mark.parametrize("nested", [False, True])
def test_both_paths_train_like_plain_loop(strategy: str, nested: bool) -> None:
    batches = make_batches(4, nested=nested)
    cls = NestedModel if nested else TinyModel
    model, ref = cls(), cls()
    pipeline = sparse_dist_pipeline(model, rewrite_strategy=strategy)
    outputs = drain(pipeline, iter(batches))
    assert pipeline.rewrite_result.strategy == strategy
    assert pipeline.rewrite_result.names == ["sparse"]
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)


class Untraceable(TinyModel):
    def forward(self, batch):  # type: ignore[no-untyped-def]
        if batch.dense.sum() > -1:  # data-dependent control flow: FX can't trace it
            return super().forward(batch)
        raise AssertionError


def test_auto_falls_back_to_direct_when_tracing_fails() -> None:
    result = rewrite_model(Untraceable(), make_batches(1)[0], _noop_forward, "auto")
    assert result.strategy == "direct"
    assert result.fallback_reason
    assert result.names == ["sparse"]


def test_fx_only_reports_tracing_failure_with_the_fix() -> None:
    with pytest.raises(RuntimeError, match="rewrite_strategy='direct'"):
        rewrite_model(Untraceable(), make_batches(1)[0], _noop_forward, "fx")


def test_model_without_sharded_modules() -> None:
    result = rewrite_model(torch.nn.Linear(2, 2), torch.zeros(2), _noop_forward)
    assert result.pipelined == () and result.not_pipelined == ()


def test_detach_attach_round_trip_keeps_training_identical() -> None:
    batches = make_batches(6)
    model, ref = TinyModel(), TinyModel()
    pipeline = sparse_dist_pipeline(model)
    it = iter(batches)
    outputs = [pipeline.progress(it), pipeline.progress(it)]
    detached = pipeline.detach()
    assert "forward" not in detached.sparse.__dict__
    pipeline.attach()
    outputs += drain(pipeline, it)
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)
