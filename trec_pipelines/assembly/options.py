"""Our keyword-only options, declared once for every pipeline.

[Note: one declaration per option]
torchrec's parameters are spelled out in each constructor, with torchrec's
names, order and defaults: they are the drop-in contract, and differ per
class.  The options trec_pipelines adds are the same on every class that
takes them, so each is declared here, once, as a field of
:class:`PipelineOptions`: its type, default, documentation (``doc``) and
concern (``concern``: "batch", "rewrite", ...) in the field, its check in
:meth:`PipelineOptions.check`.  Everything else is read from the fields:

* :data:`OPTION_DICTS` names, once, the ``TypedDict`` of each group of
  classes and the concerns it gathers (``TrainBatchOptions``: validation,
  batch and precision); a constructor takes ``**options: Unpack[...]`` of the
  one that applies to it, so an IDE and mypy see every option and its type;
* those ``TypedDict`` classes are code, for static checkers to read: the
  module :mod:`trec_pipelines.assembly.option_types`, written from the fields and
  the table by ``python -m trec_pipelines.assembly.option_types_gen`` (never
  by hand) and re-exported here;
* each pipeline class names its ``TypedDict`` once more, for the running
  program, with :func:`takes_options` (``@takes_options(SparseDistOptions)``
  above the class): it writes the options the table gives that ``TypedDict``
  into the signature of the class's own ``__init__`` as keyword-only
  parameters with their defaults, so ``help()``, ``inspect.signature`` and
  the API reference show them as if spelled out, and lists them in the
  class's docstring;
* :func:`resolve_options` refuses any other keyword with the ``TypeError``
  Python gives for an unknown argument.

Nothing reads the annotation of ``**options`` at run time, and nothing
touches a class that is not decorated: a user's subclass, however it
annotates its own ``__init__`` (with imports under ``TYPE_CHECKING`` only,
say), accepts what the nearest of its bases that is ours accepts.

Adding an option is one field, with its concern, then the command above;
a new concern also goes into the table's entries that gather it, and the
constructors of the classes it applies to unpack their new ``TypedDict``.
Unit tests check the rest: that the checked-in ``option_types.py`` is what
the command writes (``tests/unit/test_option_types.py``), and each class's
``@takes_options`` against its ``**options`` (``tests/unit/test_options.py``).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Mapping, Optional, Tuple, TypeVar

import torch

# The generated TypedDicts, re-exported: their names are option_types.__all__.
from trec_pipelines.assembly.option_types import *  # noqa: F403
from trec_pipelines.core.input_dist_group import (
    DEFAULT_INPUT_DIST_GROUP,
    InputDistGroup,
    check_input_dist_group,
)
from trec_pipelines.data.padding import UNEVEN_DATA_POLICIES, UnevenData
from trec_pipelines.model.rewrite import (
    STRATEGIES,
    UNPIPELINED_POLICIES,
    Strategy,
    UnpipelinedPolicy,
)


def _option(concern: str, doc: str) -> Dict[str, str]:
    """A field's metadata: the concern it belongs to, and its documentation."""
    return {"concern": concern, "doc": " ".join(doc.split())}


@dataclass(frozen=True)
class PipelineOptions:
    """The options trec_pipelines adds to torchrec's constructors (keyword-only).

    A class takes the ones that apply to it (see its signature); the others
    keep their defaults here.
    """

    rewrite_strategy: Strategy = field(
        default="auto",
        metadata=_option(
            "rewrite",
            """How the sharded modules' inputs are found: "fx" (trace the model), "direct"
            (bind the batch's KeyedJaggedTensor fields) or "auto" (trace, falling back to
            direct binding).""",
        ),
    )
    on_unpipelined: UnpipelinedPolicy = field(
        default="warn",
        metadata=_option(
            "rewrite",
            """A sharded module the rewrite cannot pipeline is logged and trained unpipelined
            ("warn"), or refused with the reason ("raise").""",
        ),
    )
    sync_exhaustion: Optional[bool] = field(
        default=None,
        metadata=_option(
            "batch",
            """The ranks agree on every batch they pull, so data that ends on one rank first
            ends every rank's epoch at the same step (an eval pipeline pads until every
            rank's data ended instead: ``uneven_data``), and a batch malformed on one rank is
            dropped on all. None (the default) agrees whenever the model's steps join
            collectives across ranks; True insists (and needs torch.distributed); False
            turns it off.""",
        ),
    )
    agree_ahead: bool = field(
        default=True,
        metadata=_option(
            "batch",
            """With the ranks agreeing on each batch (``sync_exhaustion``), pull one host batch
            a step ahead so its agreement rides the current step's exchange, at the cost of
            one more host batch held (pulled from the iterator, not yet copied to the device;
            see the memory guide). False holds none: each pull is agreed as it is made, with a
            blocking round trip of its own on a gloo group. No effect without the agreement.""",
        ),
    )
    uneven_data: UnevenData = field(
        default="pad",
        metadata=_option(
            "eval_data",
            """What an eval pipeline does when the ranks hold different numbers of batches
            (with the ranks agreeing on each batch, see ``sync_exhaustion``). "pad" (the
            default) scores every rank's batches: a rank whose data ended runs padding steps,
            whose outputs no one sees, until every rank's data has ended, then raises
            ``StopIteration``. "stop" ends every rank's epoch where the first rank's data
            ends, as training always does; the other ranks' remaining batches are not
            scored (``unused_batches``).""",
        ),
    )
    validate_batches: bool = field(
        default=True,
        metadata=_option(
            "validation",
            """Check each host batch's KeyedJaggedTensors as it is pulled: a malformed one
            raises ``MalformedBatchError`` before any work is issued for it.""",
        ),
    )
    input_dist_group: InputDistGroup = field(
        default=DEFAULT_INPUT_DIST_GROUP,
        metadata=_option(
            "group",
            """"dedicated" runs the pipelined input_dist on a process group of the same ranks
            that carries nothing else; "shared" keeps it on the model's group, as torchrec
            does. Results are the same either way.""",
        ),
    )

    autocast_dtype: Optional[torch.dtype] = field(
        default=None,
        metadata=_option(
            "precision",
            """Run each training forward under ``torch.autocast`` on the pipeline's device with
            this dtype (``torch.bfloat16``, or ``torch.float16`` on CUDA); None runs it as the
            model is.""",
        ),
    )
    grad_scaler: Optional[torch.amp.GradScaler] = field(
        default=None,
        metadata=_option(
            "precision",
            """A ``torch.amp.GradScaler``: the backward scales the summed loss, and the
            optimizer steps through the scaler (unscale, skip the step on inf or nan, update the
            scale). The fused (in-backward) embedding optimizers see the scaled gradients: see
            the options guide.""",
        ),
    )

    def check(self, pipeline: str) -> None:
        """Raise, naming ``pipeline`` and the choices, for a value that is not one."""
        if self.sync_exhaustion is not None and not isinstance(self.sync_exhaustion, bool):
            raise TypeError(
                f"{pipeline}: sync_exhaustion must be None, True or False, got "
                f"{self.sync_exhaustion!r}"
            )
        if not isinstance(self.agree_ahead, bool):
            raise TypeError(
                f"{pipeline}: agree_ahead must be True or False, got {self.agree_ahead!r}"
            )
        if self.uneven_data not in UNEVEN_DATA_POLICIES:
            raise ValueError(
                f"{pipeline}: uneven_data must be one of {UNEVEN_DATA_POLICIES}, got "
                f"{self.uneven_data!r}"
            )
        if not isinstance(self.validate_batches, bool):
            raise TypeError(
                f"{pipeline}: validate_batches must be True or False, got {self.validate_batches!r}"
            )
        if self.rewrite_strategy not in STRATEGIES:
            raise ValueError(
                f"{pipeline}: rewrite_strategy must be one of {STRATEGIES}, got "
                f"{self.rewrite_strategy!r}"
            )
        if self.on_unpipelined not in UNPIPELINED_POLICIES:
            raise ValueError(
                f"{pipeline}: on_unpipelined must be one of {UNPIPELINED_POLICIES}, got "
                f"{self.on_unpipelined!r}"
            )
        check_input_dist_group(self.input_dist_group, pipeline)
        if self.autocast_dtype is not None and self.autocast_dtype not in (
            torch.bfloat16,
            torch.float16,
        ):
            raise ValueError(
                f"{pipeline}: autocast_dtype must be torch.bfloat16, torch.float16 or None, got "
                f"{self.autocast_dtype!r}"
            )
        if self.grad_scaler is not None and not isinstance(self.grad_scaler, torch.amp.GradScaler):
            raise TypeError(
                f"{pipeline}: grad_scaler must be a torch.amp.GradScaler (e.g. "
                f"torch.amp.GradScaler('cuda')) or None, got {type(self.grad_scaler).__name__}"
            )

    @staticmethod
    def doc(name: str) -> str:
        """The documentation of option ``name``."""
        return str(_FIELDS[name].metadata["doc"])


_FIELDS: Mapping[str, dataclasses.Field[Any]] = {
    f.name: f for f in dataclasses.fields(PipelineOptions)
}


@dataclass(frozen=True)
class OptionDict:
    """One ``TypedDict`` of :mod:`trec_pipelines.assembly.option_types` (generated):
    what it gathers, and its docstring."""

    concerns: Tuple[str, ...]
    """The concerns whose options it holds (each field's ``concern``): its keys are
    theirs, concern by concern, each concern's in the fields' order."""
    doc: str
    """Its docstring: which classes unpack it."""


# The TypedDicts the constructors unpack, by class name: see [Note: one declaration per option].
OPTION_DICTS: Mapping[str, OptionDict] = {
    "ValidationOptions": OptionDict(("validation",), "Checking each host batch as it is pulled."),
    "BatchOptions": OptionDict(
        ("validation", "batch"),
        "Where the batches come from: validation, and the ranks' agreement on each pull.",
    ),
    "EvalDataOptions": OptionDict(
        ("eval_data",),
        "An eval pipeline's end of data when the ranks hold uneven numbers of batches.",
    ),
    "PrecisionOptions": OptionDict(
        ("precision",),
        "Mixed precision of a training step: the forward's autocast, the loss scaler.",
    ),
    "TrainBatchOptions": OptionDict(
        ("validation", "batch", "precision"),
        "A training pipeline that runs the model's own forward (Base, PT2).",
    ),
    "RewriteOptions": OptionDict(
        ("rewrite",), "How the model's sharded modules are found and pipelined."
    ),
    "GroupOptions": OptionDict(("group",), "Which process group the pipelined input_dist runs on."),
    "LiteOptions": OptionDict(
        ("validation", "batch", "rewrite", "precision"),
        "A pipeline that rewrites the model but starts each input_dist in its own step.",
    ),
    "SparseDistOptions": OptionDict(
        ("validation", "batch", "rewrite", "group"),
        "The SparseDist family's options, but mixed precision (the eval variants).",
    ),
    "SparseDistTrainOptions": OptionDict(
        ("validation", "batch", "rewrite", "group", "precision"),
        "The SparseDist family's training variants.",
    ),
    "EvalSparseDistOptions": OptionDict(
        ("validation", "batch", "rewrite", "group", "eval_data"),
        "The SparseDist family's eval variants.",
    ),
    "ModelOptions": OptionDict(
        ("rewrite", "group"),
        "A component that pipelines a model it does not train (SparseDataDistUtil).",
    ),
    "EvalHostOptions": OptionDict(
        ("validation", "batch", "rewrite", "eval_data"),
        "An eval pipeline whose input_dist runs with its lookup, on the host.",
    ),
}


def concern_of(option: str) -> str:
    """The concern option ``option`` belongs to (its field's ``concern``)."""
    return str(_FIELDS[option].metadata["concern"])


def options_of(option_dict: str) -> Tuple[str, ...]:
    """The options the ``TypedDict`` named ``option_dict`` holds, in its keys' order."""
    concerns = OPTION_DICTS[option_dict].concerns
    return tuple(name for concern in concerns for name in _FIELDS if concern_of(name) == concern)


def _check_concerns() -> None:
    """Every field's concern is gathered by some ``TypedDict``, and every concern a
    ``TypedDict`` gathers is some field's: a misspelt one fails at import."""
    declared = {concern_of(name) for name in _FIELDS}
    gathered = {c for entry in OPTION_DICTS.values() for c in entry.concerns}
    assert declared == gathered, (
        f"concerns of no TypedDict: {sorted(declared - gathered)}; "
        f"concerns of no option: {sorted(gathered - declared)}"
    )


_check_concerns()

_CONCERN = "_trec_options_concern"  # the class attribute @takes_options sets

C = TypeVar("C", bound=type)


def takes_options(concern: Any) -> Callable[[C], C]:
    """Declare that a class's constructor takes the options of ``concern`` (one
    of the ``TypedDict`` classes of :data:`OPTION_DICTS`, the one its
    ``**options`` unpacks); see [Note: one declaration per option]."""
    assert concern.__name__ in OPTION_DICTS, f"{concern.__name__}: not in OPTION_DICTS"
    accepted = frozenset(options_of(concern.__name__))

    def declare(cls: C) -> C:
        init = cls.__dict__.get("__init__")
        if init is None:  # the constructor, and its signature, are a base's
            assert accepted_options(cls) == accepted, f"{cls.__name__}: declare its own __init__"
        else:
            params = [
                p
                for p in inspect.signature(init).parameters.values()
                if p.kind is not inspect.Parameter.VAR_KEYWORD
            ]
            params += [
                inspect.Parameter(
                    option.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=option.default,
                    annotation=option.type,
                )
                for option in _FIELDS.values()
                if option.name in accepted
            ]
            init.__signature__ = inspect.Signature(params)
        setattr(cls, _CONCERN, concern)
        doc = cls.__dict__.get("__doc__")
        if doc and accepted:
            cls.__doc__ = (
                inspect.cleandoc(doc)
                + "\n\nOur keyword-only options (each described in the options guide):\n\n"
                + options_doc(cls)
            )
        return cls

    return declare


def options_concern(cls: type) -> Any:
    """The concern (a ``TypedDict`` class) whose options ``cls`` takes: its own
    ``@takes_options``, or that of its nearest base with one; None if none has."""
    return getattr(cls, _CONCERN, None)


def accepted_options(cls: type) -> FrozenSet[str]:
    """The option names the constructor of ``cls`` takes."""
    concern = options_concern(cls)
    return frozenset() if concern is None else frozenset(options_of(concern.__name__))


def resolve_options(pipeline: str, cls: type, options: Mapping[str, Any]) -> PipelineOptions:
    """The options of a ``cls`` built with keywords ``options`` (a ``TypeError``
    names any the class does not take, as Python does for an unknown keyword)."""
    accepted = accepted_options(cls)
    unknown = sorted(set(options) - accepted)
    if unknown:
        takes = ", ".join(sorted(accepted)) or "none of trec_pipelines' options"
        raise TypeError(
            f"{pipeline}.__init__() got an unexpected keyword argument {unknown[0]!r} "
            f"(its keyword-only options: {takes})"
        )
    resolved = PipelineOptions(**options)
    resolved.check(pipeline)
    return resolved


def options_doc(cls: type) -> str:
    """A reST list of the options ``cls`` takes, for its docstring."""
    names = [f.name for f in dataclasses.fields(PipelineOptions) if f.name in accepted_options(cls)]
    return "\n".join(f"* ``{name}``: {PipelineOptions.doc(name)}" for name in names)
