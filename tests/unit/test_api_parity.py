"""trec_pipelines offers torchrec's pipeline API, read from the installed torchrec.

Runs on both supported stacks (torchrec 1.8.0 and 1.9.2); nothing here is a
fixed list of names or parameters, so a new torchrec release shows up as
failures naming what it added.

Which torchrec names are public (:func:`torchrec_public_names`):

* every non-underscore name of the package ``torchrec.distributed.train_pipeline``
  except its submodules: that is the list torchrec's ``__init__`` exports;
* every non-underscore class, function or ``TypeVar`` found in the modules the
  pipelines are defined in (``train_pipelines``, and ``pec_train_pipeline``
  where it exists) whose ``__module__`` is inside
  ``torchrec.distributed.train_pipeline``.  This keeps what those modules
  define or bring in from the pipeline package (contexts, forwards, helpers)
  and drops what they merely import from elsewhere (``typing`` helpers,
  ``torchrec.distributed.types``, ``Awaitable``, ``KeyedJaggedTensor``, type
  aliases such as ``StageOutputWithEvent``).  ``experimental_pipelines`` is
  checked on its own (the end of this file): each experimental class we offer,
  from the root and from ``trec_pipelines.experimental_pipelines``, matches
  torchrec's.

For each such name ``trec_pipelines.__all__`` (the package root's public
surface) must list one of the same name; every check below reads our objects
through ``__all__`` (:data:`OURS`), so a name left out of it counts as
missing.  ``TrainPipeline``, ``In`` and ``Out`` must be torchrec's own objects
(a pipeline of ours is a ``torchrec`` ``TrainPipeline``).  For every other
class, ours replaces torchrec's, and :func:`signature_problems` compares
``__init__`` and every public method torchrec's class defines (inherited ones
included, as long as a class of the pipeline package defines them):

* torchrec's parameters appear in ours, first, in the same order, of the same
  kind (positional-or-keyword, keyword-only, ``*args``, ``**kwargs``), with the
  same defaults; a default that is a pipeline-package class (``context_type=
  TrainPipelineContext``) matches our class of the same name;
* anything after them is ours, and must be keyword-only, so a positional call
  written for torchrec lands on the same parameters; the one exception is a
  parameter a newer torchrec release added at the end of its positional ones
  (:data:`NEWER_TORCHREC_PARAMETERS`): we offer the newest API on every stack,
  at that release's position, which an older release's positional call cannot
  reach;
* public properties must exist;
* where torchrec's method only forwards ``*args, **kwargs`` to its parent's
  (``EvalPipelineFusedSparseDist.__init__``), the parent's parameters stand in
  for them: positional ones first, then torchrec's own keyword-only ones.

Pipeline contexts (the dataclasses of ``pipeline_context``) are data that
pipelines build by keyword (torchrec's own do ``context_type(index=...,
version=...)``); for them every torchrec field must be a field of ours with the
same default, in any order, and our extra fields must have defaults.  The
fields torchrec keeps only for its deprecated version-0 contexts are left out
(:data:`DEPRECATED_CONTEXT_FIELDS`; we carry no deprecated fields).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.util
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import pytest
import torchrec
import torchrec.distributed.train_pipeline as upstream

import trec_pipelines
import trec_pipelines.experimental_pipelines

PIPELINE_PACKAGE = "torchrec.distributed.train_pipeline"
# Modules of the pipeline package that torchrec's pipelines are defined in.
PIPELINE_MODULES = ("train_pipelines", "pec_train_pipeline")
# torchrec's own interface, re-exported rather than replaced.
REEXPORTED = ("TrainPipeline", "In", "Out")

# torchrec's own docs mark these "only for version 0" / "deprecated: to support
# legacy code"; its current pipelines build version-1 contexts.
DEPRECATED_CONTEXT_FIELDS = frozenset(
    {
        "version",
        "module_contexts_next_batch",
        "module_input_post_prefetch_next_batch",
        "module_contexts_post_prefetch_next_batch",
    }
)

_EMPTY = inspect.Parameter.empty
_KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _in_pipeline_package(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module == PIPELINE_PACKAGE or module.startswith(PIPELINE_PACKAGE + ".")


def torchrec_public_names() -> Dict[str, Any]:
    """The public names of the installed torchrec's pipeline API (see the module docstring)."""
    names: Dict[str, Any] = {}
    for name, obj in vars(upstream).items():
        if not name.startswith("_") and not inspect.ismodule(obj):
            names[name] = obj
    for module_name in PIPELINE_MODULES:
        qualified = f"{PIPELINE_PACKAGE}.{module_name}"
        if importlib.util.find_spec(qualified) is None:
            continue
        module = importlib.import_module(qualified)
        for name, obj in vars(module).items():
            if name.startswith("_") or name in names:
                continue
            kind_ok = inspect.isclass(obj) or inspect.isfunction(obj) or isinstance(obj, TypeVar)
            if kind_ok and _in_pipeline_package(obj):
                names[name] = obj
    return names


TORCHREC_NAMES = torchrec_public_names()
TORCHREC_CLASSES = {
    name: obj
    for name, obj in TORCHREC_NAMES.items()
    if inspect.isclass(obj) and name not in REEXPORTED
}
TORCHREC_FUNCTIONS = {name: obj for name, obj in TORCHREC_NAMES.items() if inspect.isfunction(obj)}
# Ours: the public surface only.
OURS: Dict[str, Any] = {name: getattr(trec_pipelines, name) for name in trec_pipelines.__all__}
OURS_EXPERIMENTAL: Dict[str, Any] = {
    name: getattr(trec_pipelines.experimental_pipelines, name)
    for name in trec_pipelines.experimental_pipelines.__all__
}


# ------------------------------------------------------------------ the checker


def _same_default(theirs: Any, ours: Any) -> bool:
    if theirs is _EMPTY or ours is _EMPTY:
        return theirs is ours
    if inspect.isclass(theirs) and _in_pipeline_package(theirs):
        # context_type=TrainPipelineContext: ours defaults to our class of that name.
        return inspect.isclass(ours) and ours.__name__ == theirs.__name__
    if isinstance(theirs, enum.Enum):
        return type(ours).__name__ == type(theirs).__name__ and ours.name == theirs.name
    try:
        return bool(theirs == ours) and type(theirs) is type(ours)
    except Exception:  # a default without a usable ==, compare by identity
        return theirs is ours


def _describe(param: inspect.Parameter) -> str:
    default = "" if param.default is _EMPTY else f"={param.default!r}"
    return f"{param.name}{default} ({param.kind.description})"


def effective_parameters(
    func: Callable[..., Any], owner: Optional[type] = None
) -> List[inspect.Parameter]:
    """``func``'s parameters, with a bare ``*args, **kwargs`` forwarded to the
    parent class's method of the same name replaced by that method's parameters."""
    params = list(inspect.signature(func).parameters.values())
    kinds = {p.kind for p in params}
    if owner is None or not all(kind in kinds for kind in _VARIADIC):
        return params
    name = func.__name__
    parent = next(
        (k for k in owner.__mro__[1:] if name in vars(k) and _in_pipeline_package(k)), None
    )
    if parent is None:
        return params
    inherited = effective_parameters(vars(parent)[name], parent)
    own_keywords = [p for p in params if p.kind is _KEYWORD_ONLY]
    own_names = {p.name for p in own_keywords}
    return (
        [p for p in inherited if p.kind in _POSITIONAL]
        + own_keywords
        + [p for p in inherited if p.kind is _KEYWORD_ONLY and p.name not in own_names]
        + [p for p in inherited if p.kind in _VARIADIC]
    )


# Positional parameters a newer torchrec appended to a class (name -> release).
# Ours takes them on every stack at that release's position, after all of an
# older release's parameters, so an older positional call never fills them.
NEWER_TORCHREC_PARAMETERS: Dict[str, str] = {"async_inplace_copy": "1.9.2"}


def signature_problems(
    theirs: Callable[..., Any], ours: Callable[..., Any], where: str, owner: Optional[type] = None
) -> List[str]:
    """What a call written for ``theirs`` would get wrong on ``ours`` (empty: none).

    ``owner`` is torchrec's class defining ``theirs``, to see through a method
    that forwards ``*args, **kwargs`` to its parent's.
    """
    their_params = effective_parameters(theirs, owner)
    our_params = list(inspect.signature(ours).parameters.values())
    problems: List[str] = []
    for i, their in enumerate(their_params):
        if i >= len(our_params):
            problems.append(f"{where}: missing parameter {_describe(their)} at position {i}")
            continue
        our = our_params[i]
        if our.name != their.name:
            problems.append(
                f"{where}: position {i} is '{our.name}', torchrec has {_describe(their)}"
            )
            continue
        if our.kind != their.kind:
            problems.append(
                f"{where}: '{our.name}' is {our.kind.description}, torchrec's is "
                f"{their.kind.description}"
            )
        if not _same_default(their.default, our.default):
            theirs_text = "no default" if their.default is _EMPTY else f"default {their.default!r}"
            ours_text = "no default" if our.default is _EMPTY else f"default {our.default!r}"
            problems.append(f"{where}: '{our.name}' has {ours_text}, torchrec's has {theirs_text}")
    newer = True  # still among a newer torchrec's trailing positional parameters
    for extra in our_params[len(their_params) :]:
        newer = newer and extra.name in NEWER_TORCHREC_PARAMETERS and extra.default is not _EMPTY
        if extra.kind is not _KEYWORD_ONLY and not newer:
            problems.append(
                f"{where}: our extra parameter {_describe(extra)} must be keyword-only "
                "(after a bare '*'), or a positional call written for torchrec would fill it"
            )
    return problems


def _field_default(f: "dataclasses.Field[Any]") -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _EMPTY if f.default is dataclasses.MISSING else f.default


def context_problems(theirs: type, ours: type) -> List[str]:
    """How ``ours`` fails to be built with the keywords ``theirs`` takes (empty: none)."""
    where = theirs.__name__
    if not dataclasses.is_dataclass(ours):
        return [f"{where}: ours is not a dataclass"]
    our_fields = {f.name: f for f in dataclasses.fields(ours)}
    problems: List[str] = []
    for their in dataclasses.fields(theirs):
        if their.name in DEPRECATED_CONTEXT_FIELDS:
            continue
        our = our_fields.get(their.name)
        if our is None:
            problems.append(f"{where}: missing field '{their.name}'")
        elif not _same_default(_field_default(their), _field_default(our)):
            problems.append(
                f"{where}.{their.name}: default {_field_default(our)!r}, torchrec's "
                f"{_field_default(their)!r}"
            )
    their_names = {f.name for f in dataclasses.fields(theirs)}
    for name, our in our_fields.items():
        if name not in their_names and _field_default(our) is _EMPTY:
            problems.append(f"{where}: our extra field '{name}' needs a default")
    return problems


def is_context(cls: type) -> bool:
    return (
        dataclasses.is_dataclass(cls) and cls.__module__ == f"{PIPELINE_PACKAGE}.pipeline_context"
    )


def _public_members(cls: type) -> Dict[str, Tuple[Any, type]]:
    """Public methods and properties of ``cls`` defined by a pipeline-package
    class, each with the class that defines it."""
    members: Dict[str, Tuple[Any, type]] = {}
    for klass in reversed(cls.__mro__):
        if not _in_pipeline_package(klass):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_"):
                continue
            if isinstance(value, (staticmethod, classmethod)):
                members[name] = (value.__func__, klass)
            elif isinstance(value, property) or inspect.isfunction(value):
                members[name] = (value, klass)
    return members


def class_problems(theirs: type, ours: type) -> List[str]:
    """How ``ours`` fails to take every call written for ``theirs`` (empty: none)."""
    where = theirs.__name__
    problems: List[str] = []
    if is_context(theirs):
        return context_problems(theirs, ours)
    init_owner = next(
        (k for k in theirs.__mro__ if "__init__" in vars(k) and _in_pipeline_package(k)), None
    )
    if init_owner is not None:
        problems += signature_problems(
            init_owner.__init__, ours.__init__, f"{where}.__init__", init_owner
        )
    for name, (member, owner) in sorted(_public_members(theirs).items()):
        our_member = inspect.getattr_static(ours, name, None)
        if our_member is None:
            kind = "property" if isinstance(member, property) else "method"
            problems.append(f"{where}: missing public {kind} '{name}'")
            continue
        if isinstance(member, property):
            continue
        if isinstance(our_member, (staticmethod, classmethod)):
            our_member = our_member.__func__
        if not callable(our_member):
            problems.append(
                f"{where}.{name}: torchrec's is a method, ours is {type(our_member).__name__}"
            )
            continue
        problems += signature_problems(member, our_member, f"{where}.{name}", owner)
    return problems


# -------------------------------------------------------------------- the tests


def test_the_rule_finds_torchrecs_pipelines() -> None:
    """Guards the name rule itself: it must see the pipelines and skip imports."""
    for name in ("TrainPipelineSparseDist", "TrainPipelineSemiSync", "TrainPipelineContext", "In"):
        assert name in TORCHREC_NAMES, f"{name} not found by torchrec_public_names()"
    for imported in (
        "Awaitable",
        "KeyedJaggedTensor",
        "Optional",
        "ShardedModule",
        "StageOutputWithEvent",
    ):
        assert imported not in TORCHREC_NAMES, f"{imported} is an import, not pipeline API"


@pytest.mark.parametrize("name", sorted(TORCHREC_NAMES))
def test_name_is_offered(name: str) -> None:
    assert name in OURS, (
        f"trec_pipelines.__all__ has no '{name}' (torchrec {torchrec.__version__} offers "
        f"{TORCHREC_NAMES[name]!r}); import it in trec_pipelines/__init__.py and add it to "
        "a group of _PUBLIC_GROUPS there"
    )


@pytest.mark.parametrize("name", REEXPORTED)
def test_torchrec_interface_is_reexported(name: str) -> None:
    assert OURS.get(name) is getattr(upstream, name), (
        f"trec_pipelines.{name} must be torchrec's own object, re-exported"
    )


@pytest.mark.parametrize("name", sorted(TORCHREC_CLASSES))
def test_class_signatures_match(name: str) -> None:
    ours = OURS.get(name)
    if ours is None:
        pytest.fail(f"trec_pipelines has no '{name}' (see test_name_is_offered)", pytrace=False)
    assert inspect.isclass(ours), f"trec_pipelines.{name} is {ours!r}, torchrec's is a class"
    problems = class_problems(TORCHREC_CLASSES[name], ours)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", sorted(TORCHREC_FUNCTIONS))
def test_function_signatures_match(name: str) -> None:
    ours = OURS.get(name)
    if ours is None:
        pytest.fail(f"trec_pipelines has no '{name}' (see test_name_is_offered)", pytrace=False)
    problems = signature_problems(TORCHREC_FUNCTIONS[name], ours, name)
    assert not problems, "\n".join(problems)


# ------------------------------------------------ experimental_pipelines

EXPERIMENTAL_MODULE = f"{PIPELINE_PACKAGE}.experimental_pipelines"


def torchrec_experimental_classes() -> Dict[str, type]:
    """The classes torchrec's ``experimental_pipelines`` defines (not those it imports)."""
    module = importlib.import_module(EXPERIMENTAL_MODULE)
    return {
        name: obj
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and obj.__module__ == EXPERIMENTAL_MODULE and name[0] != "_"
    }


EXPERIMENTAL_CLASSES = torchrec_experimental_classes()


def test_the_rule_finds_torchrecs_experimental_pipelines() -> None:
    assert {"TrainPipelineSparseDistT", "TrainPipelineSparseDistBwdOpt"} <= set(
        EXPERIMENTAL_CLASSES
    )


@pytest.mark.parametrize("name", sorted(EXPERIMENTAL_CLASSES))
def test_experimental_class_is_offered_and_matches(name: str) -> None:
    """From the package root and from our module named like torchrec's."""
    ours = OURS_EXPERIMENTAL.get(name)
    if ours is None:
        pytest.fail(f"trec_pipelines.experimental_pipelines.__all__ has no '{name}'", pytrace=False)
    assert OURS.get(name) is ours
    problems = class_problems(EXPERIMENTAL_CLASSES[name], ours)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "name", ["CPUEmbeddingTrainPipelineContext", "CPUEmbeddingPipelinedForward"]
)
def test_what_the_experimental_pipelines_bring_along_is_offered(name: str) -> None:
    """The context and forward EvalPipelineCPUSparse uses (torchrec defines them in
    its pipeline_context and runtime_forwards modules)."""
    theirs = getattr(importlib.import_module(EXPERIMENTAL_MODULE), name)
    ours = OURS.get(name)
    assert ours is not None, f"trec_pipelines.__all__ has no '{name}'"
    problems = (
        context_problems(theirs, ours) if is_context(theirs) else class_problems(theirs, ours)
    )
    assert not problems, "\n".join(problems)


# ------------------------------------------------ the checker catches mistakes


class _Theirs:
    def __init__(
        self, model: Any, optimizer: Any, device: Any, execute_all_batches: bool = True
    ) -> None:
        pass

    def progress(self, dataloader_iter: Any) -> Any:
        pass


def _theirs_in_package() -> type:
    """``_Theirs`` as if torchrec's pipeline package defined it."""
    members = {name: vars(_Theirs)[name] for name in ("__init__", "progress")}
    return type("_Theirs", (), {**members, "__module__": PIPELINE_PACKAGE + ".train_pipelines"})


def _ours(init: Callable[..., None], **members: Any) -> type:
    return type("_Ours", (), {"__init__": init, "__module__": __name__, **members})


def test_checker_accepts_a_faithful_class_with_keyword_only_extras() -> None:
    def init(
        self: Any,
        model: Any,
        optimizer: Any,
        device: Any,
        execute_all_batches: bool = True,
        *,
        validate_batch: Optional[Callable[[Any], None]] = None,
    ) -> None:
        pass

    ours = _ours(init, progress=_Theirs.progress)
    assert class_problems(_theirs_in_package(), ours) == []


def test_checker_catches_a_removed_parameter() -> None:
    # Doctor a real class of ours: drop torchrec's 'execute_all_batches'.
    real = trec_pipelines.TrainPipelineSparseDist
    params = [
        p
        for name, p in inspect.signature(real.__init__).parameters.items()
        if name != "execute_all_batches"
    ]
    doctored = type("Doctored", (real,), {})

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        pass

    init.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    doctored.__init__ = init  # type: ignore[misc]
    theirs = TORCHREC_CLASSES["TrainPipelineSparseDist"]
    problems = [
        p
        for p in class_problems(theirs, doctored)
        if p.startswith("TrainPipelineSparseDist.__init__")
    ]
    assert any("execute_all_batches" in p for p in problems), problems


def test_checker_catches_a_positional_extra_a_changed_default_and_a_missing_method() -> None:
    def init(
        self: Any,
        model: Any,
        optimizer: Any,
        device: Any,
        execute_all_batches: bool = False,
        validate_batch: bool = False,
    ) -> None:
        pass

    problems = class_problems(_theirs_in_package(), _ours(init))
    assert problems == [
        "_Theirs.__init__: 'execute_all_batches' has default False, torchrec's has default True",
        "_Theirs.__init__: our extra parameter validate_batch=False (positional or keyword) must be "
        "keyword-only (after a bare '*'), or a positional call written for torchrec would fill it",
        "_Theirs: missing public method 'progress'",
    ]


def test_checker_catches_reordered_parameters() -> None:
    def init(
        self: Any, model: Any, device: Any, optimizer: Any, execute_all_batches: bool = True
    ) -> None:
        pass

    problems = class_problems(_theirs_in_package(), _ours(init, progress=_Theirs.progress))
    assert problems[:2] == [
        "_Theirs.__init__: position 2 is 'device', torchrec has optimizer (positional or keyword)",
        "_Theirs.__init__: position 3 is 'optimizer', torchrec has device (positional or keyword)",
    ]


def test_checker_catches_a_context_missing_a_field_or_with_a_required_extra() -> None:
    ours = trec_pipelines.TrainPipelineContext
    kept = [
        (f.name, f.type, f)
        for f in dataclasses.fields(ours)
        if f.name != "input_dist_tensors_requests"
    ]
    doctored = dataclasses.make_dataclass("Doctored", [("needs_a_value", int)] + kept)
    problems = context_problems(TORCHREC_CLASSES["TrainPipelineContext"], doctored)
    assert "TrainPipelineContext: missing field 'input_dist_tensors_requests'" in problems
    assert "TrainPipelineContext: our extra field 'needs_a_value' needs a default" in problems
