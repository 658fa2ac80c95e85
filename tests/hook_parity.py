"""torchrec's overridable methods, per class, and the hooks each class leaves on the
user's model, for the hook-parity tests.

Shared by the unit tier (every hook honoured with torchrec's signature,
allowed with one warning where neither torchrec's class nor ours calls it, or
refused at class creation) and the distributed tier (the honoured ones called
as torchrec calls them, the uncalled ones called by neither; the model's
module and parameter hooks after training and after ``detach()`` those of
torchrec's class, :func:`model_hooks`).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from collections import Counter
from typing import Any, Dict, FrozenSet, List, Optional, Set, Tuple

import torch

import trec_pipelines

# Where torchrec keeps its pipeline classes, newest first.
_MODULES = (
    "torchrec.distributed.train_pipeline",
    "torchrec.distributed.train_pipeline.train_pipelines",
    "torchrec.distributed.train_pipeline.experimental_pipelines",
    "torchrec.distributed.train_pipeline.pec_train_pipeline",
)

# The classes ours replace one for one.
CLASSES = [
    "TrainPipelineBase",
    "TrainPipelinePT2",
    "TrainPipelineSparseDist",
    "TrainPipelineSparseDistLite",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "PrefetchTrainPipelineSparseDist",
    "EvalPipelineSparseDist",
    "EvalPipelineFusedSparseDist",
    "StagedTrainPipeline",
    "TrainPipelineSparseDistCompAutograd",
    "TrainPipelinePEC",
    "TrainPipelineSparseDistT",
    "TrainPipelineSparseDistBwdOpt",
    "TrainEvalHybridPipelineBase",
    "TrainPipelineSparseDistOptStash",
    "TrainPipelineSparseDistEmbStash",
    "TrainPipelinePrefetchEMS",
    "EvalPipelineCPUSparse",
]


def torchrec_class(name: str) -> Optional[type]:
    """torchrec's class ``name``, or None where this torchrec has none."""
    for module_name in _MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found = getattr(module, name, None)
        if inspect.isclass(found):
            return found
    return None


def overridable(cls: type) -> Dict[str, Any]:
    """Every method (and ``_pipelined_forward_type``) a subclass of ``cls`` can
    override: name -> what ``cls`` has under it."""
    found: Dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        for name, value in vars(klass).items():
            if name == "_pipelined_forward_type":  # a class, read as a hook is called
                found[name] = value
                continue
            if name.startswith("__") or isinstance(value, (property, type)):
                continue
            if callable(value) or isinstance(value, (staticmethod, classmethod)):
                found[name] = value
    return found


def parameters(cls: type, name: str) -> List[str]:
    """The parameter names of ``cls.name`` (without ``self``), in order."""
    return [p for p in inspect.signature(getattr(cls, name)).parameters if p != "self"]


def pairs() -> List[tuple]:
    """``(class name, hook)`` for every hook of every torchrec class this torchrec has."""
    out = []
    for name in CLASSES:
        theirs = torchrec_class(name)
        if theirs is None:
            continue
        for hook in sorted(overridable(theirs)):
            out.append((name, hook))
    return out


def ours(name: str) -> type:
    return getattr(trec_pipelines, name)


# What drives a pipeline without the user calling a hook: building it, stepping it,
# attaching, detaching and resetting it, and collecting it.
DRIVERS = ("__init__", "progress", "attach", "detach", "reset", "__del__")


def _references(function: Any) -> Tuple[Set[str], Set[str]]:
    """The ``self.<name>`` and ``super().<name>`` names ``function``'s source mentions."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
    except (OSError, TypeError):  # a builtin, or no source
        return set(), set()
    on_self: Set[str] = set()
    on_super: Set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id == "self":
            on_self.add(node.attr)
        elif (
            isinstance(owner, ast.Call)
            and isinstance(owner.func, ast.Name)
            and owner.func.id == "super"
        ):
            on_super.add(node.attr)
    return on_self, on_super


def _defined(cls: type, name: str, after: Optional[type] = None) -> Optional[Tuple[type, Any]]:
    """Where ``cls`` finds ``name`` (after ``after`` in its MRO, for ``super()``)."""
    mro = cls.__mro__
    for klass in mro[mro.index(after) + 1 :] if after is not None else mro:
        if name in vars(klass):
            return klass, vars(klass)[name]
    return None


@functools.lru_cache(maxsize=None)
def reached(cls: type) -> FrozenSet[str]:
    """Every ``self.<name>`` torchrec's class ``cls`` reaches from its drivers, read
    from its source: a hook in this set is one an override of which torchrec's
    class may call (perhaps only under an option); one outside it, never."""
    names: Set[str] = set()
    seen: Set[Tuple[type, str]] = set()
    todo: List[Tuple[str, Optional[Tuple[type, Any]]]] = [(n, _defined(cls, n)) for n in DRIVERS]
    while todo:
        name, found = todo.pop()
        if found is None or (found[0], name) in seen:
            continue
        klass, value = found
        seen.add((klass, name))
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if not callable(value) or isinstance(value, type):  # data, or a class it reads
            continue
        on_self, on_super = _references(value)
        names |= on_self
        todo += [(ref, _defined(cls, ref)) for ref in on_self]
        todo += [(ref, _defined(cls, ref, after=klass)) for ref in on_super]
    return frozenset(names)


# ---------------------------------------------------------------- the model's hooks

# (where, kind): where is a module's or a parameter's name in the model ("" for the
# model itself); kind one of "forward", "forward_pre", "backward", "backward_pre"
# (a module's), with "+kwargs" / "+always_call" where the hook was registered so,
# or "grad", "post_accumulate_grad" (a parameter's).
Hooks = Dict[Tuple[str, str], int]


def model_hooks(model: torch.nn.Module) -> Hooks:
    """Every hook on ``model``, its submodules and their parameters, counted by
    where and kind (only what is there: no zero counts)."""
    found: Counter = Counter()
    for name, module in model.named_modules():
        for hook_id in module._forward_hooks:
            kind = "forward"
            if hook_id in module._forward_hooks_with_kwargs:
                kind += "+kwargs"
            if hook_id in module._forward_hooks_always_called:
                kind += "+always_call"
            found[(name, kind)] += 1
        for hook_id in module._forward_pre_hooks:
            with_kwargs = hook_id in module._forward_pre_hooks_with_kwargs
            found[(name, "forward_pre+kwargs" if with_kwargs else "forward_pre")] += 1
        for _ in module._backward_hooks:
            found[(name, "backward" if module._is_full_backward_hook else "backward+module")] += 1
        for _ in module._backward_pre_hooks:
            found[(name, "backward_pre")] += 1
    for name, param in model.named_parameters():
        for attr, kind in (
            ("_backward_hooks", "grad"),
            ("_post_accumulate_grad_hooks", "post_accumulate_grad"),
        ):
            found[(name, kind)] += len(getattr(param, attr, None) or {})
    return {key: count for key, count in found.items() if count}


def hooks_plus(base: Hooks, added: Hooks) -> Hooks:
    """``base`` with ``added``'s hooks on top."""
    total: Counter = Counter(base)
    total.update(added)
    return dict(total)
