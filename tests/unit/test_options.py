"""Our keyword-only options: declared once, shown on every class that takes them,
refused (as Python refuses an unknown keyword) by every class that does not."""

from __future__ import annotations

import inspect
import typing
from typing import Any, Dict, FrozenSet, Optional

import pytest
import torch

import trec_pipelines as tp
from tests.unit.fakes import TinyModel, drain, make_batches, optimizer_for, plain_loop
from tests.user_subclass import TaggedSparseDist
from trec_pipelines.assembly import options as opts
from trec_pipelines.core.input_dist_group import INPUT_DIST_GROUPS, InputDistGroup
from trec_pipelines.data.padding import UNEVEN_DATA_POLICIES, UnevenData
from trec_pipelines.model.rewrite import (
    STRATEGIES,
    UNPIPELINED_POLICIES,
    Strategy,
    UnpipelinedPolicy,
)

# Every option, its type and its default, in the order signatures list them: a change here
# is a change of the public API.
DECLARED = {
    "rewrite_strategy": (Strategy, "auto"),
    "on_unpipelined": (UnpipelinedPolicy, "warn"),
    "sync_exhaustion": (Optional[bool], None),
    "agree_ahead": (bool, True),
    "uneven_data": (UnevenData, "pad"),
    "validate_batches": (bool, True),
    "input_dist_group": (InputDistGroup, "dedicated"),
    "autocast_dtype": (Optional[torch.dtype], None),
    "grad_scaler": (Optional[torch.amp.GradScaler], None),
}
OPTION_NAMES = list(DECLARED)
CONCERNS = [
    opts.ValidationOptions,
    opts.BatchOptions,
    opts.RewriteOptions,
    opts.GroupOptions,
    opts.LiteOptions,
    opts.SparseDistOptions,
    opts.ModelOptions,
    opts.EvalHostOptions,
    opts.PrecisionOptions,
    opts.TrainBatchOptions,
    opts.SparseDistTrainOptions,
    opts.EvalDataOptions,
    opts.EvalSparseDistOptions,
]

# What each class takes today: a change here is a change of the public API.
PRECISION = frozenset({"autocast_dtype", "grad_scaler"})
BATCHES = frozenset({"sync_exhaustion", "agree_ahead", "validate_batches"})
EXPECTED: Dict[str, FrozenSet[str]] = {
    "TrainPipelineBase": BATCHES | PRECISION,
    "TrainPipelinePT2": BATCHES | PRECISION,
    "TrainPipelineSparseDistLite": BATCHES | {"rewrite_strategy", "on_unpipelined"} | PRECISION,
    "EvalPipelineCPUSparse": BATCHES | {"rewrite_strategy", "on_unpipelined", "uneven_data"},
    "SparseDataDistUtil": frozenset({"rewrite_strategy", "on_unpipelined", "input_dist_group"}),
    "StagedTrainPipeline": BATCHES,
}
EVERY_OPTION = frozenset(OPTION_NAMES)
# What the SparseDist training variants take: every option but the eval ones.
TRAIN_OPTIONS = EVERY_OPTION - {"uneven_data"}
SPARSE_DIST_FAMILY = [
    "TrainPipelineSparseDist",
    "TrainPipelineFusedSparseDist",
    "EvalPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "PrefetchTrainPipelineSparseDist",
    "EvalPipelineSparseDist",
    "TrainPipelineSparseDistCompAutograd",
    "TrainPipelinePEC",
    "TrainPipelineSparseDistT",
    "TrainPipelineSparseDistBwdOpt",
    "TrainEvalHybridPipelineBase",
    "TrainPipelineSparseDistOptStash",
    "TrainPipelineSparseDistEmbStash",
    "TrainPipelinePrefetchEMS",
]
# Training stops at the shortest rank, always: uneven_data is the eval variants' alone.
EXPECTED.update({name: TRAIN_OPTIONS for name in SPARSE_DIST_FAMILY})
# The eval variants take every option but mixed precision (they train nothing).
EXPECTED.update(
    {
        name: EVERY_OPTION - PRECISION
        for name in ("EvalPipelineSparseDist", "EvalPipelineFusedSparseDist")
    }
)


# The keys of each TypedDict a constructor can unpack, in order (each ``total=False``).
VALIDATION = ["validate_batches"]
BATCH = [*VALIDATION, "sync_exhaustion", "agree_ahead"]
REWRITE = ["rewrite_strategy", "on_unpipelined"]
PRECISION_KEYS = ["autocast_dtype", "grad_scaler"]
KEYS = {
    "ValidationOptions": VALIDATION,
    "BatchOptions": BATCH,
    "EvalDataOptions": ["uneven_data"],
    "PrecisionOptions": PRECISION_KEYS,
    "TrainBatchOptions": [*BATCH, *PRECISION_KEYS],
    "RewriteOptions": REWRITE,
    "GroupOptions": ["input_dist_group"],
    "LiteOptions": [*BATCH, *REWRITE, *PRECISION_KEYS],
    "SparseDistOptions": [*BATCH, *REWRITE, "input_dist_group"],
    "SparseDistTrainOptions": [*BATCH, *REWRITE, "input_dist_group", *PRECISION_KEYS],
    "EvalSparseDistOptions": [*BATCH, *REWRITE, "input_dist_group", "uneven_data"],
    "ModelOptions": [*REWRITE, "input_dist_group"],
    "EvalHostOptions": [*BATCH, *REWRITE, "uneven_data"],
}


@pytest.mark.parametrize("name", sorted(KEYS))
def test_each_typed_dict_holds_its_options_with_their_types(name: str) -> None:
    typed_dict = getattr(opts, name)
    assert list(typed_dict.__annotations__) == KEYS[name]
    assert typing.get_type_hints(typed_dict) == {k: DECLARED[k][0] for k in KEYS[name]}
    assert typed_dict.__required_keys__ == frozenset(), name
    assert (typed_dict.__doc__ or "").strip(), name


def test_every_option_is_declared_with_its_default_and_doc() -> None:
    assert dict(opts.DEFAULTS) == {name: default for name, (_, default) in DECLARED.items()}
    assert list(opts.DEFAULTS) == OPTION_NAMES
    assert set(opts.DOCS) == set(OPTION_NAMES)
    assert typing.get_type_hints(opts.PipelineOptions) == {n: t for n, (t, _) in DECLARED.items()}
    seen = {key for concern in CONCERNS for key in concern.__annotations__}
    assert seen == set(OPTION_NAMES), "a declared option no constructor can take"


def test_every_option_is_documented() -> None:
    for name in OPTION_NAMES:
        assert len(opts.DOCS[name]) > 40, name
        assert "  " not in opts.DOCS[name] and "\n" not in opts.DOCS[name], name
    # One paragraph each, as the concern's docstring says it (first and last words).
    assert opts.DOCS["validate_batches"].startswith("Check each host batch's KeyedJaggedTensors")
    assert opts.DOCS["grad_scaler"].endswith("see the options guide.")


def test_the_choices_the_types_give_are_the_modules_constants() -> None:
    choices = {n: typing.get_args(t) for n, (t, _) in DECLARED.items() if typing.get_args(t)}
    assert choices["rewrite_strategy"] == STRATEGIES
    assert choices["on_unpipelined"] == UNPIPELINED_POLICIES
    assert choices["uneven_data"] == UNEVEN_DATA_POLICIES
    assert choices["input_dist_group"] == INPUT_DIST_GROUPS
    assert opts.CHOICES == {"autocast_dtype": (torch.bfloat16, torch.float16)}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_signature_shows_exactly_the_options_the_class_takes(name: str) -> None:
    cls = getattr(tp, name)
    params = inspect.signature(cls).parameters
    shown = [
        p.name
        for p in params.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name in EVERY_OPTION
    ]
    assert set(shown) == EXPECTED[name] == opts.accepted_options(cls)
    assert shown == [n for n in OPTION_NAMES if n in shown], "in the declared order"
    for option in shown:
        assert params[option].default == DECLARED[option][1], (name, option)
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    # Described once, in PipelineOptions, which the class's docstring links to.
    assert ":class:`~trec_pipelines.PipelineOptions`" in (cls.__doc__ or ""), name
    assert all(f"``{option}=" in (tp.PipelineOptions.__doc__ or "") for option in shown), name


@pytest.mark.parametrize(
    "make",
    [
        lambda m, **kw: tp.TrainPipelineBase(m, optimizer_for(m), torch.device("cpu"), **kw),
        lambda m, **kw: tp.TrainPipelineSparseDistLite(
            m, optimizer_for(m), torch.device("cpu"), **kw
        ),
    ],
    ids=["Base", "Lite"],
)
def test_an_option_the_class_does_not_take_is_a_type_error(make: Any) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'input_dist_group'"):
        make(TinyModel(), input_dist_group="shared")
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        make(TinyModel(), no_such_option=1)


@pytest.mark.parametrize(
    "option, value, error, says",
    [
        ("rewrite_strategy", "trace", ValueError, "one of ('auto', 'fx', 'direct'), got 'trace'"),
        ("on_unpipelined", "ignore", ValueError, "one of ('warn', 'raise'), got 'ignore'"),
        ("input_dist_group", "mine", ValueError, "one of ('shared', 'dedicated'), got 'mine'"),
        ("sync_exhaustion", "yes", TypeError, "None, True or False, got 'yes'"),
        ("validate_batches", None, TypeError, "True or False, got None"),
        ("agree_ahead", "no", TypeError, "True or False, got 'no'"),
        (
            "autocast_dtype",
            torch.int8,
            ValueError,
            "torch.bfloat16, torch.float16 or None, got torch.int8",
        ),
        ("grad_scaler", 1.5, TypeError, "a torch.amp.grad_scaler.GradScaler or None, got 1.5"),
    ],
)
def test_a_bad_value_is_refused_with_the_choices_and_what_the_option_does(
    option: str, value: Any, error: type, says: str
) -> None:
    model = TinyModel()
    with pytest.raises(error) as failure:
        tp.TrainPipelineSparseDist(
            model, optimizer_for(model), torch.device("cpu"), **{option: value}
        )
    doc = opts.DOCS[option]
    assert str(failure.value) == f"TrainPipelineSparseDist: {option} must be {says}. {doc}"


def test_uneven_data_is_an_eval_option_with_two_policies() -> None:
    model = TinyModel()
    with pytest.raises(
        ValueError,
        match=r"EvalPipelineSparseDist: uneven_data must be one of \('pad', 'stop'\), got 'longest'",
    ):
        tp.EvalPipelineSparseDist(model, None, torch.device("cpu"), uneven_data="longest")
    # Training always stops at the shortest rank: no train pipeline takes the option.
    with pytest.raises(TypeError, match="unexpected keyword argument 'uneven_data'"):
        tp.TrainPipelineSparseDist(
            model, optimizer_for(model), torch.device("cpu"), uneven_data="pad"
        )
    pads = {
        policy: tp.EvalPipelineSparseDist(
            model, None, torch.device("cpu"), uneven_data=policy
        )._source.pad_uneven
        for policy in ("pad", "stop")
    }
    train = tp.TrainPipelineSparseDist(model, optimizer_for(model), torch.device("cpu"))
    assert pads == {"pad": True, "stop": False} and train._source.pad_uneven is False


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=["str", "torch.device"])
@pytest.mark.parametrize("name", ["TrainPipelineBase", "TrainPipelineSparseDist"])
def test_device_may_be_what_torch_accepts(name: str, device: Any) -> None:
    model, ref = TinyModel(), TinyModel()
    batches = make_batches(4)
    pipeline = getattr(tp, name)(model, optimizer_for(model), device)
    assert pipeline._device == torch.device("cpu")
    outputs = drain(pipeline, iter(batches))
    expected = plain_loop(ref, batches)
    for got, want in zip(outputs, expected, strict=True):
        assert torch.equal(got, want)


def test_a_device_torch_does_not_know_is_refused_with_examples() -> None:
    model = TinyModel()
    with pytest.raises(ValueError, match="not a device torch knows"):
        tp.TrainPipelineBase(model, optimizer_for(model), "gpu0")
    with pytest.raises(TypeError, match="torch.device"):
        tp.TrainPipelineBase(model, optimizer_for(model), 1.5)


def test_a_users_subclass_forwarding_options_keeps_the_parents_and_trains() -> None:
    class Mine(tp.TrainPipelineSparseDist):  # type: ignore[type-arg]
        """A user's subclass with a parameter of its own."""

        def __init__(self, model: Any, optimizer: Any, device: Any, tag: str = "", **options: Any):
            super().__init__(model, optimizer, device, **options)
            self.tag = tag

    class Plain(tp.TrainPipelineBase):  # type: ignore[type-arg]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)

    assert opts.accepted_options(Mine) == TRAIN_OPTIONS
    assert opts.accepted_options(Plain) == EXPECTED["TrainPipelineBase"]
    model, ref = TinyModel(), TinyModel()
    batches = make_batches(3)
    outputs = drain(
        Mine(model, optimizer_for(model), "cpu", tag="x", validate_batches=False), iter(batches)
    )
    for got, want in zip(outputs, plain_loop(ref, batches), strict=True):
        assert torch.equal(got, want)
    with pytest.raises(TypeError, match="unexpected keyword argument 'rewrite_strategy'"):
        Plain(model, optimizer_for(model), "cpu", rewrite_strategy="fx")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_class_declares_the_concern_its_options_unpack(name: str) -> None:
    """@takes_options names the TypedDict the constructor's ``**options`` unpacks (read
    as the annotation's text: nothing evaluates it)."""
    cls = getattr(tp, name)
    concern = cls.__dict__["_trec_options_concern"]  # declared on the class itself
    assert list(concern.__annotations__) == [n for n in KEYS[concern.__name__]]
    init = next(k.__dict__["__init__"] for k in cls.__mro__ if "__init__" in k.__dict__)
    assert init.__annotations__["options"] == f"Unpack[{concern.__name__}]", name
    assert opts.accepted_options(cls) == EXPECTED[name]


def test_a_users_subclass_with_options_for_type_checkers_only_is_left_as_written() -> None:
    """tests/user_subclass.py: postponed annotations, Unpack and the TypedDict imported
    under TYPE_CHECKING only."""
    import tests.user_subclass as module

    assert not hasattr(module, "SparseDistTrainOptions") and not hasattr(module, "Unpack")
    params = inspect.signature(TaggedSparseDist).parameters
    assert [(p.name, p.kind) for p in params.values()] == [
        ("args", inspect.Parameter.VAR_POSITIONAL),
        ("tag", inspect.Parameter.KEYWORD_ONLY),
        ("options", inspect.Parameter.VAR_KEYWORD),
    ]
    assert TaggedSparseDist.__doc__ == (
        "SparseDist with a parameter of the user's own, forwarding every option."
    )
    assert "_trec_options_concern" not in TaggedSparseDist.__dict__
    assert opts.accepted_options(TaggedSparseDist) == TRAIN_OPTIONS


@pytest.mark.parametrize(
    "options",
    [{}, {"validate_batches": False, "sync_exhaustion": False, "rewrite_strategy": "direct"}],
    ids=["no options", "options"],
)
def test_a_users_subclass_with_options_for_type_checkers_only_trains(
    options: Dict[str, Any],
) -> None:
    model, ref = TinyModel(), TinyModel()
    batches = make_batches(4)
    pipeline = TaggedSparseDist(model, optimizer_for(model), "cpu", tag="mine", **options)
    assert pipeline.tag == "mine"
    for name, value in options.items():
        assert pipeline._options[name] == value
    outputs = drain(pipeline, iter(batches))
    expected = plain_loop(ref, batches)
    assert len(outputs) == len(expected) == 4
    for got, want in zip(outputs, expected, strict=True):
        assert torch.equal(got, want)


def test_a_users_subclass_refuses_an_unknown_option_naming_the_accepted_ones() -> None:
    model = TinyModel()
    takes = ", ".join(sorted(TRAIN_OPTIONS))
    with pytest.raises(TypeError) as failure:
        TaggedSparseDist(model, optimizer_for(model), "cpu", no_such_option=1)  # type: ignore[call-arg]
    assert str(failure.value) == (
        "TaggedSparseDist.__init__() got an unexpected keyword argument 'no_such_option' "
        f"(its keyword-only options: {takes})"
    )
