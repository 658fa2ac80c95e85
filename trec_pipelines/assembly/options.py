"""Our keyword-only options, declared once for every pipeline.

[Note: one declaration per option]
torchrec's parameters are spelled out in each constructor (the drop-in contract, per class).
Ours are the same on every class that takes them, so each is declared here, once: its type and
documentation (its docstring's Attributes) in its concern's ``TypedDict``, its default in
:data:`DEFAULTS`.  A group of classes' ``TypedDict`` inherits the concerns it gathers; their
constructors take ``**options: Unpack[...]`` of it (for mypy and IDEs) and name it again with
:func:`takes_options` (for ``help()``, ``inspect.signature`` and :func:`resolve_options`'s
checks, which read the types).  The documentation of every option is shown in one place,
:class:`PipelineOptions`'s docstring (``trec_pipelines.PipelineOptions``), which each
class's docstring links to (see [Note: documented once] in :mod:`trec_pipelines.core.api_docs`).
"""

from __future__ import annotations

import inspect
import re
import typing
from typing import Any, Callable, Literal, Mapping, Optional, TypedDict, TypeVar, Union

import torch

from trec_pipelines.core.api_docs import shared_doc
from trec_pipelines.core.input_dist_group import DEFAULT_INPUT_DIST_GROUP, InputDistGroup
from trec_pipelines.data.padding import UnevenData
from trec_pipelines.model.rewrite import Strategy, UnpipelinedPolicy


class ValidationOptions(TypedDict, total=False):
    """Checking each host batch as it is pulled.

    Attributes:
        validate_batches: Check each host batch's KeyedJaggedTensors as it is pulled: a malformed
            one raises ``MalformedBatchError`` before any work is issued for it.
    """

    validate_batches: bool


class BatchOptions(ValidationOptions, total=False):
    """Where the batches come from: validation, and the ranks' agreement on each pull.

    Attributes:
        sync_exhaustion: The ranks agree on every batch they pull, so data that ends on one rank
            first ends every rank's epoch at the same step (an eval pipeline pads until every rank's
            data ended instead: ``uneven_data``), and a batch malformed on one rank is dropped on
            all. None (the default) agrees whenever the model's steps join collectives across ranks;
            True insists (and needs torch.distributed); False turns it off.
        agree_ahead: With the ranks agreeing on each batch (``sync_exhaustion``), pull one host
            batch a step ahead so its agreement rides the current step's exchange, at the cost of
            one more host batch held (pulled from the iterator, not yet copied to the device; see
            the memory guide). False holds none: each pull is agreed as it is made, with a blocking
            round trip of its own on a gloo group. No effect without the agreement.
    """

    sync_exhaustion: Optional[bool]
    agree_ahead: bool


class EvalDataOptions(TypedDict, total=False):
    """An eval pipeline's end of data when the ranks hold uneven numbers of batches.

    Attributes:
        uneven_data: What an eval pipeline does when the ranks hold different numbers of batches
            (with the ranks agreeing on each batch, see ``sync_exhaustion``). "pad" (the default)
            scores every rank's batches: a rank whose data ended runs padding steps, whose outputs
            no one sees, until every rank's data has ended, then raises ``StopIteration``. "stop"
            ends every rank's epoch where the first rank's data ends, as training always does; the
            other ranks' remaining batches are not scored (``unused_batches``).
    """

    uneven_data: UnevenData


class PrecisionOptions(TypedDict, total=False):
    """Mixed precision of a training step: the forward's autocast, the loss scaler.

    Attributes:
        autocast_dtype: Run each training forward under ``torch.autocast`` on the pipeline's device
            with this dtype (``torch.bfloat16``, or ``torch.float16`` on CUDA); None runs it as the
            model is.
        grad_scaler: A ``torch.amp.GradScaler``: the backward scales the summed loss, and the
            optimizer steps through the scaler (unscale, skip the step on inf or nan, update the
            scale). The fused (in-backward) embedding optimizers see the scaled gradients: see the
            options guide.
    """

    autocast_dtype: Optional[torch.dtype]
    grad_scaler: Optional[torch.amp.GradScaler]


class RewriteOptions(TypedDict, total=False):
    """How the model's sharded modules are found and pipelined.

    Attributes:
        rewrite_strategy: How the sharded modules' inputs are found: "fx" (trace the model),
            "direct" (bind the batch's KeyedJaggedTensor fields) or "auto" (trace, falling back to
            direct binding).
        on_unpipelined: A sharded module the rewrite cannot pipeline is logged and trained
            unpipelined ("warn"), or refused with the reason ("raise").
    """

    rewrite_strategy: Strategy
    on_unpipelined: UnpipelinedPolicy


class GroupOptions(TypedDict, total=False):
    """Which process group the pipelined input_dist runs on.

    Attributes:
        input_dist_group: "dedicated" runs the pipelined input_dist on a process group of the same
            ranks that carries nothing else; "shared" keeps it on the model's group, as torchrec
            does. Results are the same either way.
    """

    input_dist_group: InputDistGroup


# Every option's default, in the order signatures and docstrings list them.
DEFAULTS: Mapping[str, Any] = {
    "rewrite_strategy": "auto",
    "on_unpipelined": "warn",
    "sync_exhaustion": None,
    "agree_ahead": True,
    "uneven_data": "pad",
    "validate_batches": True,
    "input_dist_group": DEFAULT_INPUT_DIST_GROUP,
    "autocast_dtype": None,
    "grad_scaler": None,
}
# The values of an option's type it takes, where not all (None aside).
CHOICES: Mapping[str, tuple[Any, ...]] = {"autocast_dtype": (torch.bfloat16, torch.float16)}


def _attributes(concern: Any) -> dict[str, str]:
    """The Attributes of ``concern``'s docstring: name -> its paragraph, on one line."""
    section = inspect.cleandoc(concern.__doc__).split("Attributes:\n", 1)[1]
    entries = re.split(r"^    (\w+): ", section, flags=re.M)[1:]
    return {n: " ".join(t.split()) for n, t in zip(entries[::2], entries[1::2], strict=True)}


CONCERNS = (ValidationOptions, BatchOptions, EvalDataOptions, PrecisionOptions, RewriteOptions)
DOCS = {n: d for c in (*CONCERNS, GroupOptions) for n, d in _attributes(c).items()}


# The concerns gathered, one TypedDict per group of classes.
class TrainBatchOptions(BatchOptions, PrecisionOptions, total=False):
    """A training pipeline that runs the model's own forward (Base, PT2)."""


class LiteOptions(BatchOptions, RewriteOptions, PrecisionOptions, total=False):
    """A pipeline that rewrites the model but starts each input_dist in its own step."""


class SparseDistOptions(BatchOptions, RewriteOptions, GroupOptions, total=False):
    """The SparseDist family's options, but mixed precision (the eval variants)."""


class SparseDistTrainOptions(SparseDistOptions, PrecisionOptions, total=False):
    """The SparseDist family's training variants."""


class EvalSparseDistOptions(SparseDistOptions, EvalDataOptions, total=False):
    """The SparseDist family's eval variants."""


class ModelOptions(RewriteOptions, GroupOptions, total=False):
    """A component that pipelines a model it does not train (SparseDataDistUtil)."""


class EvalHostOptions(BatchOptions, RewriteOptions, EvalDataOptions, total=False):
    """An eval pipeline whose input_dist runs with its lookup, on the host."""


class PipelineOptions(SparseDistTrainOptions, EvalDataOptions, total=False):
    # Every option: what resolve_options returns, each key set.  Public, and its
    # docstring is the one description of what the pipelines share (shared_doc).
    pass


_TYPES: dict[str, Any] = typing.get_type_hints(PipelineOptions)
assert set(_TYPES) == set(DEFAULTS) == set(DOCS), "an option without its default or its doc"
PipelineOptions.__doc__ = shared_doc(DOCS, DEFAULTS)
C = TypeVar("C", bound=type)
_CONCERN = "_trec_options_concern"  # the class attribute @takes_options sets


def options_of(concern: Any) -> tuple[str, ...]:
    """The options of the ``TypedDict`` ``concern`` (None: none), in :data:`DEFAULTS`' order."""
    return tuple(name for name in DEFAULTS if name in getattr(concern, "__annotations__", {}))


def _signature(init: Any, concern: Any) -> inspect.Signature:
    """``init``'s signature, its ``**options`` replaced by ``concern``'s options, keyword-only."""
    params = [p for p in inspect.signature(init).parameters.values() if p.kind != p.VAR_KEYWORD]
    kw = inspect.Parameter.KEYWORD_ONLY
    for name in options_of(concern):
        hint = concern.__annotations__[name]  # as written: a string, or a ForwardRef
        text = getattr(hint, "__forward_arg__", hint)
        params.append(inspect.Parameter(name, kw, default=DEFAULTS[name], annotation=text))
    return inspect.Signature(params)


def takes_options(concern: Any) -> Callable[[C], C]:
    """Declare the ``TypedDict`` a class's ``**options`` unpack: see [Note: one declaration per option]."""

    def declare(cls: C) -> C:
        setattr(cls, _CONCERN, concern)
        init = cls.__dict__.get("__init__")  # None: a base's, with its signature
        if init is not None:
            init.__signature__ = _signature(init, concern)
        return cls

    return declare


def accepted_options(cls: type) -> frozenset[str]:
    """The options ``cls`` takes: its ``@takes_options``, or its nearest base's."""
    return frozenset(options_of(getattr(cls, _CONCERN, None)))


def resolve_options(pipeline: str, cls: type, options: Mapping[str, Any]) -> PipelineOptions:
    """Every option's value for a ``cls`` built with keywords ``options``, checked."""
    accepted = accepted_options(cls)
    if unknown := sorted(set(options) - accepted):
        takes = ", ".join(sorted(accepted)) or "none of trec_pipelines' options"
        raise TypeError(
            f"{pipeline}.__init__() got an unexpected keyword argument {unknown[0]!r} "
            f"(its keyword-only options: {takes})"
        )
    for name, value in options.items():
        _check(f"{pipeline}: {name} must be", value, _TYPES[name], name)
    return typing.cast(PipelineOptions, {n: options.get(n, d) for n, d in DEFAULTS.items()})


def _check(must: str, value: Any, hint: Any, name: str) -> None:
    """Raise ``must`` + what ``hint`` (and :data:`CHOICES`) admit, got ``value``, + its doc."""
    kinds = typing.get_args(hint) if typing.get_origin(hint) is Union else (hint,)
    or_none = " or None" if type(None) in kinds else ""
    (kind,) = [k for k in kinds if k is not type(None)]
    got = f"got {value!r}. {DOCS[name]}"
    if value is None and or_none:
        return
    if typing.get_origin(kind) is Literal:
        if value not in typing.get_args(kind):
            raise ValueError(f"{must} one of {typing.get_args(kind)}, {got}")
    elif kind is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{must} {'None, ' * bool(or_none)}True or False, {got}")
    elif not isinstance(value, kind):
        raise TypeError(f"{must} a {kind.__module__}.{kind.__qualname__}{or_none}, {got}")
    elif value not in CHOICES.get(name, (value,)):
        raise ValueError(f"{must} {', '.join(map(repr, CHOICES[name]))}{or_none}, {got}")
