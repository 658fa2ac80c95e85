"""Finding the sharded modules of a model and swapping their forwards.

:func:`rewrite_model` replaces each pipelinable ``ShardedModule.forward`` with a
wrapper from :mod:`trec_pipelines.sparse.forwards` and returns a
:class:`RewriteResult`; :func:`restore_model` undoes it exactly.

Two ways to learn how a module's arguments come out of the batch:

* ``"fx"``: trace the model with sharded modules (and subtrees without one)
  as leaves, then walk each sharded call's arguments back to the batch through
  attribute and item look-ups.  A module whose input is computed in the
  forward is left alone, with the FX node that changed it as the reason.
* ``"direct"``: no tracing.  Find the ``KeyedJaggedTensor`` fields of the batch
  and bind each sharded module to the one holding its features.

``"auto"`` (the default) is FX, falling back to direct when the model cannot be
traced.

With a ``make_postproc`` factory (the pipelines pass one for
``pipeline_postproc=True``) the FX path also pipelines the *postproc* modules
between the batch and a sharded module: see :mod:`trec_pipelines.model.postproc`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Literal, Optional, Set, Tuple, Union, cast, get_args

import torch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardedModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from trec_pipelines._types import AnyShardedModule
from trec_pipelines.model import tracing
from trec_pipelines.model.args import ArgInfo, CallArgs, GetAttr, GetItem
from trec_pipelines.model.postproc import (
    PipelinedPostproc,
    PostprocFactory,
    PostprocPlanner,
    postprocs_read_by,
)

logger: logging.Logger = logging.getLogger(__name__)

Strategy = Literal["auto", "fx", "direct"]
STRATEGIES: Tuple[str, ...] = get_args(Strategy)

# What a pipeline does with a sharded module the rewrite leaves unpipelined:
# log it and train it unpipelined, or refuse the model.
UnpipelinedPolicy = Literal["warn", "raise"]
UNPIPELINED_POLICIES: Tuple[str, ...] = get_args(UnpipelinedPolicy)

# Builds the wrapper for one module: (fqn, call args, module) -> forward.
ForwardFactory = Callable[[str, CallArgs, AnyShardedModule], Any]


@dataclass(frozen=True)
class PipelinedModule:
    """A sharded module whose forward was swapped."""

    name: str
    module: AnyShardedModule
    call_args: CallArgs


@dataclass(frozen=True)
class RewriteResult:
    """What :func:`rewrite_model` did.

    Attributes:
        strategy: the path that produced the argument recipes ("fx" or "direct").
        pipelined: the swapped modules, in forward order.
        not_pipelined: FQN -> why that sharded module keeps its own forward.
        fallback_reason: why "auto" fell back to "direct", if it did.
        postprocs: the postproc modules run ahead in the input_dist stage,
            each after those it reads.
        refused_postprocs: FQN -> why that module, met between the batch and a
            sharded module, can't run ahead (its sharded modules are then in
            ``not_pipelined``).
    """

    strategy: str
    pipelined: Tuple[PipelinedModule, ...]
    not_pipelined: Tuple[Tuple[str, str], ...]
    fallback_reason: Optional[str] = None
    postprocs: Tuple[PipelinedPostproc, ...] = ()
    refused_postprocs: Tuple[Tuple[str, str], ...] = ()
    _saved: Tuple["_Saved", ...] = field(default=(), repr=False)

    @property
    def modules(self) -> List[AnyShardedModule]:
        return [p.module for p in self.pipelined]

    @property
    def names(self) -> List[str]:
        return [p.name for p in self.pipelined]

    @property
    def postproc_names(self) -> List[str]:
        return [p.fqn for p in self.postprocs]

    def report(self) -> str:
        """A human-readable account of the rewrite."""
        lines = [f"pipelined ({self.strategy}): {', '.join(self.names) or 'none'}"]
        for name, reason in self.not_pipelined:
            lines.append(f"NOT pipelined: {name}: {reason}")
        for postproc in self.postprocs:
            lines.append(f"postproc pipelined: {postproc.fqn}{postproc.args}")
        for name, reason in self.refused_postprocs:
            lines.append(f"postproc NOT pipelined: {name}: {reason}")
        if self.fallback_reason:
            lines.append(f"FX tracing failed, used direct KJT binding: {self.fallback_reason}")
        return "\n".join(lines)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside ``DistributedModelParallel`` (and its DDP/FSDP)."""
    if isinstance(model, DistributedModelParallel):
        return model.module
    return model


def sharded_modules(model: torch.nn.Module) -> Dict[str, AnyShardedModule]:
    """FQN -> sharded module, outermost only (a sharded module's insides are its own)."""
    found: Dict[str, AnyShardedModule] = {}

    def visit(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            fqn = prefix + name
            if isinstance(child, ShardedModule):
                found[fqn] = child
            else:
                visit(child, fqn + ".")

    visit(unwrap(model), "")
    return found


def rewrite_model(
    model: torch.nn.Module,
    batch: Any,
    make_forward: ForwardFactory,
    strategy: Strategy = "auto",
    make_postproc: Optional[PostprocFactory] = None,
) -> RewriteResult:
    """Swap the forward of every pipelinable sharded module of ``model``.

    Args:
        model: the model, usually a ``DistributedModelParallel``.
        batch: a batch as the model will see it (used by the direct path and
            to report what the batch looks like).
        make_forward: builds the wrapper for one module.
        strategy: "auto" (FX, falling back to direct), "fx" or "direct".
        make_postproc: builds the wrapper for one postproc module; ``None``
            (``pipeline_postproc=False``) leaves every sharded module fed by
            another module's output un-pipelined.  FX path only.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"rewrite strategy must be one of {STRATEGIES}, got {strategy!r}")
    inner = unwrap(model)
    candidates = sharded_modules(inner)
    plans, used, planner, fallback_reason = _plan(inner, candidates, batch, strategy, make_postproc)

    pipelined: List[PipelinedModule] = []
    not_pipelined: List[Tuple[str, str]] = []
    saved = []
    seen: Set[str] = set()
    for name, plan in plans:
        seen.add(name)
        if isinstance(plan, str):
            not_pipelined.append((name, plan))
            continue
        module = candidates[name]
        saved.append(_install(module, make_forward(name, plan, module)))
        pipelined.append(PipelinedModule(name, module, plan))
    for name in candidates:
        if name not in seen:
            not_pipelined.append((name, "not called by the model's forward"))

    # The postprocs the pipelined modules read; those only read by modules
    # left alone for another reason stay as they are.
    postprocs: Dict[int, PipelinedPostproc] = {}
    for entry in pipelined:
        for postproc in postprocs_read_by(entry.call_args):
            postprocs.setdefault(id(postproc), postproc)
    for postproc in postprocs.values():
        saved.append(_install(postproc.postproc_module, postproc, mark_pipelined=False))

    result = RewriteResult(
        used,
        tuple(pipelined),
        tuple(not_pipelined),
        fallback_reason,
        postprocs=tuple(postprocs.values()),
        refused_postprocs=tuple(planner.refused) if planner is not None else (),
        _saved=tuple(saved),
    )
    _log(result)
    return result


def _plan(
    inner: torch.nn.Module,
    candidates: Dict[str, AnyShardedModule],
    batch: Any,
    strategy: Strategy,
    make_postproc: Optional[PostprocFactory],
) -> Tuple[List[Tuple[str, Union[CallArgs, str]]], str, Optional[PostprocPlanner], Optional[str]]:
    """How each sharded module is called (its arguments, or why it is left alone), the
    strategy used, the postproc planner (FX only) and why FX fell back to direct, if it did."""
    fallback_reason: Optional[str] = None
    planner: Optional[PostprocPlanner] = None
    if not candidates:
        plans: List[Tuple[str, Union[CallArgs, str]]] = []
        used = "fx" if strategy != "direct" else "direct"
    elif strategy == "direct":
        plans, used = _plan_direct(candidates, batch), "direct"
    else:
        try:
            plans, planner = _plan_fx(inner, candidates, make_postproc)
            used = "fx"
        except Exception as error:  # FX raises many types; all mean "not traceable"
            if strategy == "fx":
                raise RuntimeError(
                    f"FX tracing of {type(inner).__name__} failed: {error}. "
                    "Use rewrite_strategy='direct' to bind sharded modules to the "
                    "batch's KeyedJaggedTensor fields without tracing."
                ) from error
            fallback_reason = f"{type(error).__name__}: {error}"
            logger.warning(
                "FX tracing failed (%s); binding sharded modules directly", fallback_reason
            )
            plans, used, planner = _plan_direct(candidates, batch), "direct", None
    return plans, used, planner, fallback_reason


# (module, had an instance-level forward, that forward, is_pipelined before or
# None when the flag is not ours to set).
_Saved = Tuple[torch.nn.Module, bool, Any, Optional[bool]]


class WrapperChanges:
    """How many times, in this process, forward wrappers were put on or taken off a
    module, or a pipeline holding some was collected: a pipeline that looked at
    its model's modules when :attr:`count` was N needs no second look while it is
    N (see ``PipelinedModel.take_over``, which reads it at every step's start)."""

    count = 0


def note_wrapper_change() -> None:
    """Count one change of the wrappers on some module (see :class:`WrapperChanges`)."""
    WrapperChanges.count += 1


def _install(module: torch.nn.Module, forward: Any, mark_pipelined: bool = True) -> _Saved:
    """Swap ``module.forward`` for ``forward``; return what restoring needs.

    ``mark_pipelined`` sets the ``is_pipelined`` flag torchrec's sharded
    modules read; postproc modules don't get it.
    """
    saved = (
        module,
        "forward" in module.__dict__,
        module.__dict__.get("forward"),
        getattr(module, "is_pipelined", False) if mark_pipelined else None,
    )
    # Not nn.Module.__setattr__: a PipelinedPostproc is a Module and would be
    # registered as a child named "forward" (changing state_dict and named_modules).
    object.__setattr__(module, "forward", forward)
    note_wrapper_change()
    if mark_pipelined:
        cast(Any, module).is_pipelined = True
    return saved


def restore_model(result: RewriteResult) -> None:
    """Give every module (sharded and postproc) back the forward it had before
    :func:`rewrite_model`."""
    note_wrapper_change()
    for module, had_instance_forward, original, was_pipelined in reversed(result._saved):
        if had_instance_forward:
            object.__setattr__(module, "forward", original)
        else:
            module.__dict__.pop("forward", None)
        if was_pipelined is not None:
            cast(Any, module).is_pipelined = was_pipelined


def reapply_rewrite(result: RewriteResult, make_forward: ForwardFactory) -> RewriteResult:
    """Install fresh wrappers on the modules ``result`` pipelined, and its
    postproc wrappers again (after a restore)."""
    saved = []
    for entry in result.pipelined:
        saved.append(
            _install(entry.module, make_forward(entry.name, entry.call_args, entry.module))
        )
    for postproc in result.postprocs:
        saved.append(_install(postproc.postproc_module, postproc, mark_pipelined=False))
    return replace(result, _saved=tuple(saved))


def _log(result: RewriteResult) -> None:
    if result.pipelined:
        logger.info("pipelined sharded modules (%s): %s", result.strategy, ", ".join(result.names))
    if result.postprocs:
        logger.info("postprocs run in the input_dist stage: %s", ", ".join(result.postproc_names))
    for name, reason in result.not_pipelined:
        logger.warning(
            "sharded module '%s' is NOT pipelined and runs its own input_dist in the forward: %s",
            name,
            reason,
        )
    for name, reason in result.refused_postprocs:
        logger.warning("postproc '%s' is NOT pipelined: %s", name, reason)


def _plan_fx(
    model: torch.nn.Module,
    candidates: Dict[str, AnyShardedModule],
    make_postproc: Optional[PostprocFactory] = None,
) -> Tuple[List[Tuple[str, Union[CallArgs, str]]], Optional[PostprocPlanner]]:
    graph = tracing.trace(model)
    batch_node = tracing.first_placeholder(graph)
    planner = (
        PostprocPlanner(model, graph, batch_node, make_postproc)
        if make_postproc is not None
        else None
    )
    resolve = planner.resolve if planner is not None else None
    plans: List[Tuple[str, Union[CallArgs, str]]] = []
    calls: Dict[str, int] = {}
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in candidates:
            continue
        name = str(node.target)
        calls[name] = calls.get(name, 0) + 1
        if calls[name] > 1:
            continue
        plans.append((name, tracing.call_args_of(node, batch_node, resolve)))
    twice = {name for name, count in calls.items() if count > 1}
    return [
        (name, f"called {calls[name]} times in the forward; a pipelined module runs once per batch")
        if name in twice
        else (name, plan)
        for name, plan in plans
    ], planner


def kjt_fields(batch: Any, max_depth: int = 4) -> List[Tuple[ArgInfo, KeyedJaggedTensor]]:
    """Every ``KeyedJaggedTensor`` reachable from ``batch`` by attributes and items."""
    found: List[Tuple[ArgInfo, KeyedJaggedTensor]] = []

    def visit(value: Any, steps: Tuple[Any, ...], depth: int) -> None:
        if isinstance(value, KeyedJaggedTensor):
            found.append((ArgInfo.from_batch(steps), value))
            return
        if depth >= max_depth or isinstance(value, torch.Tensor):
            return
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, (str, int)):
                    visit(item, steps + (GetItem(key),), depth + 1)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                visit(item, steps + (GetItem(index),), depth + 1)
        elif hasattr(value, "__dict__"):
            for attr, item in vars(value).items():
                visit(item, steps + (GetAttr(attr),), depth + 1)

    visit(batch, (), 0)
    return found


def _feature_names(module: AnyShardedModule) -> Set[str]:
    names: Set[str] = set()
    for attr in ("_embedding_bag_configs", "_embedding_configs"):
        for config in getattr(module, attr, None) or []:
            names.update(getattr(config, "feature_names", []) or [])
    return names


def _plan_direct(
    candidates: Dict[str, AnyShardedModule], batch: Any
) -> List[Tuple[str, Union[CallArgs, str]]]:
    fields = kjt_fields(batch)
    plans: List[Tuple[str, Union[CallArgs, str]]] = []
    for name, module in candidates.items():
        if not fields:
            plans.append(
                (name, f"the batch ({type(batch).__name__}) has no KeyedJaggedTensor field")
            )
            continue
        wanted = _feature_names(module)
        matching = [path for path, kjt in fields if wanted and wanted <= set(kjt.keys())]
        if len(fields) == 1:
            matching = [fields[0][0]]
        if len(matching) == 1:
            plans.append((name, CallArgs([matching[0]], {})))
        else:
            options = ", ".join(str(path) for path, _ in fields)
            plans.append(
                (
                    name,
                    f"cannot tell which KeyedJaggedTensor it reads among {options}; use FX tracing",
                )
            )
    return plans
