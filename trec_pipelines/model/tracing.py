"""FX tracing of a model down to its sharded modules.

The trace is shallow: every ``ShardedModule`` is a leaf, and so is every
subtree that holds no sharded module (unless it is marked
``_is_pytorch_fx_traceable = True``).  Only the glue between the batch and the
sharded modules is traced, which is all :func:`call_args_of` needs to read
back how each sharded module's arguments come out of the batch.

A ``call_module`` node met on the way back is another module's output.  With
no ``resolve`` callback that ends the walk (the input is computed in the
forward); with one (``pipeline_postproc=True``, see
:class:`trec_pipelines.model.postproc.PostprocPlanner`) the callback says whether the
module can run ahead as a postproc, and the path then starts at its output.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union, cast

import torch
import torch.fx
from torchrec.distributed.types import ShardedModule

from trec_pipelines.model.args import (
    ArgInfo,
    ArgStep,
    CallArgs,
    DictOf,
    GetAttr,
    GetItem,
    ListOf,
    Postproc,
    RunsAhead,
)

# A call_module node -> the postproc standing for it, or why it can't be one.
Resolve = Callable[[torch.fx.Node], Union[RunsAhead, str]]


def _contains_sharded(module: torch.nn.Module) -> bool:
    return any(isinstance(m, ShardedModule) for m in module.modules())


def leaf_module_names(model: torch.nn.Module) -> Set[str]:
    """FQNs of the children the tracer need not enter.

    Inside any module with a sharded descendant, a child without one is a leaf.
    """
    leaves: Set[str] = set()

    def visit(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            fqn = prefix + name
            if isinstance(child, ShardedModule):
                continue
            if _contains_sharded(child):
                visit(child, fqn + ".")
            elif not getattr(child, "_is_pytorch_fx_traceable", False):
                leaves.add(fqn)

    visit(model, "")
    return leaves


class Tracer(torch.fx.Tracer):
    """Traces only the glue around sharded modules (see the module docstring).

    Sharded modules, FSDP wrappers and the modules named in ``leaf_modules``
    are leaves.  With ``extend_leaf_fqn`` the modules inside a named leaf are
    leaves too (matched by FQN prefix), for tracers that get called on them.
    """

    # Models that write to buffers in forward break when buffers are proxied.
    proxy_buffer_attributes = False

    def __init__(
        self, leaf_modules: Optional[List[str]] = None, extend_leaf_fqn: bool = False
    ) -> None:
        super().__init__()
        self._leaf_modules: Set[str] = set(leaf_modules or ())
        self._extend_leaf_fqn = extend_leaf_fqn

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, ShardedModule) or module_qualified_name in self._leaf_modules:
            return True
        if _is_fsdp(m):
            return True
        if self._extend_leaf_fqn and self.is_extended_leaf_modules(m, module_qualified_name):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def is_extended_leaf_modules(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        """Whether ``module_qualified_name`` lies inside one of the named leaves."""
        return any(module_qualified_name.startswith(leaf + ".") for leaf in self._leaf_modules)


def _is_fsdp(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel) or type(module).__name__.startswith("FSDP")


def trace(model: torch.nn.Module) -> torch.fx.Graph:
    """The shallow FX graph of ``model.forward``."""
    return Tracer(sorted(leaf_module_names(model))).trace(model)


def _is_getattr(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is getattr


def _is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _is_dict_get(node: torch.fx.Node) -> bool:
    return node.op == "call_method" and node.target == "get" and len(node.args) == 2


def _describe(node: torch.fx.Node) -> str:
    target = getattr(node.target, "__name__", node.target)
    return f"FX node '{node.name}' ({node.op} {target})"


def arg_path_of(
    arg: Any, batch_node: torch.fx.Node, resolve: Optional[Resolve] = None
) -> Union[ArgInfo, str]:
    """How ``arg`` (an FX argument) is read from the batch, or why it can't be.

    With ``resolve``, the path may start at a postproc's output, and a list,
    tuple or dict built in the forward is read element by element.
    """
    if not isinstance(arg, torch.fx.Node):
        if isinstance(arg, (list, tuple, dict)) and _has_node(arg):
            if resolve is None:
                return f"a {type(arg).__name__} built in the forward from traced values"
            return _collection_of(arg, batch_node, resolve)
        return ArgInfo.constant(arg)
    steps: List[ArgStep] = []
    node = arg
    while True:
        if node is batch_node:
            return ArgInfo.from_batch(tuple(reversed(steps)))
        if node.op == "placeholder":
            return f"{_describe(node)} is a model input other than the batch"
        if node.op == "call_module":
            if resolve is None:
                return (
                    f"{_describe(node)}: the input is the output of module '{node.target}'; "
                    "with pipeline_postproc=True it runs ahead in the input_dist stage "
                    "if it can (no parameters, input read from the batch)"
                )
            source = resolve(node)
            if isinstance(source, str):
                return source
            return ArgInfo([Postproc(source), *reversed(steps)])
        if _is_getattr(node) and isinstance(node.args[1], str):
            steps.append(GetAttr(node.args[1]))
        elif (_is_getitem(node) or _is_dict_get(node)) and isinstance(node.args[1], (str, int)):
            steps.append(GetItem(node.args[1]))
        else:
            return f"{_describe(node)} modifies the input before the sharded module"
        parent = node.args[0]
        if not isinstance(parent, torch.fx.Node):
            return f"{_describe(node)} does not read from the batch"
        node = parent


def _collection_of(
    value: Union[List[Any], Tuple[Any, ...], Dict[Any, Any]],
    batch_node: torch.fx.Node,
    resolve: Resolve,
) -> Union[ArgInfo, str]:
    """A list, tuple or dict built in the forward: each element's recipe, or
    why one of them can't be read (constants stay constants)."""
    items = list(value.values()) if isinstance(value, dict) else list(value)
    recipes: List[Any] = []
    for item in items:
        if not _has_node(item):
            recipes.append(item)
            continue
        recipe = arg_path_of(item, batch_node, resolve)
        if isinstance(recipe, str):
            return recipe
        recipes.append(recipe)
    if isinstance(value, dict):
        return ArgInfo([DictOf(dict(zip(value.keys(), recipes, strict=True)))])
    return ArgInfo([ListOf(recipes, as_tuple=isinstance(value, tuple))])


def _has_node(value: Any) -> bool:
    if isinstance(value, torch.fx.Node):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_node(v) for v in value)
    if isinstance(value, dict):
        return any(_has_node(v) for v in value.values())
    return False


def call_args_of(
    node: torch.fx.Node, batch_node: Optional[torch.fx.Node], resolve: Optional[Resolve] = None
) -> Union[CallArgs, str]:
    """The :class:`CallArgs` of a ``call_module`` node, or the reason there are none.

    ``resolve`` lets arguments come from postprocs (see :func:`arg_path_of`).
    """
    if batch_node is None:
        return "the model's forward takes no input"
    if not node.args and not node.kwargs:
        return f"module '{node.target}' is called with no arguments"
    args: List[ArgInfo] = []
    for arg in node.args:
        path = arg_path_of(arg, batch_node, resolve)
        if isinstance(path, str):
            return path
        args.append(path)
    kwargs: Dict[str, ArgInfo] = {}
    for name, arg in node.kwargs.items():
        path = arg_path_of(arg, batch_node, resolve)
        if isinstance(path, str):
            return path
        kwargs[name] = path
    return CallArgs(args, kwargs)


def first_placeholder(graph: torch.fx.Graph) -> Optional[torch.fx.Node]:
    for node in graph.nodes:
        if node.op == "placeholder":
            return cast(torch.fx.Node, node)
    return None
