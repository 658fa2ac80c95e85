"""ArgInfo / CallArgs / ArgInfoStepFactory against torchrec's, on the same batch."""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
from torchrec.distributed.train_pipeline import (
    ArgInfo as UpstreamArgInfo,
    ArgInfoStepFactory as UpstreamFactory,
    CallArgs as UpstreamCallArgs,
)

from trec_pipelines import ArgInfo, ArgInfoStepFactory, CallArgs


class Batch:
    def __init__(self) -> None:
        self.features: Dict[str, Any] = {"ids": torch.arange(4), "lengths": [1, 2]}
        self.dense = torch.ones(2)


def build(info_cls: Any, factory: Any, call_cls: Any) -> Any:
    """The same recipe, written once with torchrec's names."""
    ids = info_cls([]).append_step(factory.get_item("ids")).add_step(factory.get_attr("features"))
    whole = info_cls([factory.noop()])
    scalar = info_cls([factory.from_scalar(3)])
    listed = info_cls([factory.from_list([info_cls([factory.get_attr("dense")]), 7])])
    mapped = info_cls(
        [
            factory.from_dict(
                {"n": info_cls([factory.get_attr("features"), factory.get_item("lengths")])}
            )
        ]
    )
    doubled = info_cls([factory.get_attr("dense"), factory.postproc(torch.nn.Identity())])
    empty = info_cls([])
    return call_cls([ids, whole, scalar, listed, empty], {"m": mapped, "d": doubled})


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a is b or a == b


def test_recipes_read_the_same_arguments_as_torchrec() -> None:
    batch = Batch()
    ours = build(ArgInfo, ArgInfoStepFactory, CallArgs).build_args_kwargs(batch)
    theirs = build(UpstreamArgInfo, UpstreamFactory, UpstreamCallArgs).build_args_kwargs(batch)
    assert same(ours, theirs), (ours, theirs)
    args, kwargs = ours
    assert args[0] is batch.features["ids"] and args[1] is batch and args[4] is None
    assert kwargs["m"] == {"n": [1, 2]}


def test_add_step_puts_the_step_first_and_returns_the_recipe() -> None:
    info = ArgInfo([ArgInfoStepFactory.get_item("ids")])
    assert info.add_step(ArgInfoStepFactory.get_attr("features")) is info
    assert str(info) == "batch.features['ids']"


@pytest.mark.parametrize("value", [None, 3, "x"])
def test_constant_recipe(value: Any) -> None:
    assert ArgInfo.constant(value).process_steps(Batch()) == value
    assert str(ArgInfo.constant(value)) == repr(value)
