"""FX tracing of a model down to its sharded modules.

The trace is shallow: every ``ShardedModule`` is a leaf, and so is every
subtree that holds no sharded module (unless it is marked
``_is_pytorch_fx_traceable = True``).  Only the glue between the batch and the
sharded modules is traced, which is all :func:`call_args_of` needs to read
back how each sharded module's arguments come out of the batch.

A ``call_module`` node met on the way back is another module's output.  With
no ``resolve`` callback that ends the walk (the input is computed in the
forward); with one (``pipeline_postproc=True``, see
:class:`trec_pipelines.postproc.PostprocPlanner`) the callback says whether the
module can run ahead as a postproc, and the path then starts at its output.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, List, Optional, Set, Tuple, Union

import torch
import torch.fx
from torchrec.distributed.types import ShardedModule

from trec_pipelines.args import (
    ArgDict,
    ArgList,
    ArgPath,
    ArgRecipe,
    ArgSource,
    ArgStep,
    CallArgs,
    GetAttr,
    GetItem,
)

# A call_module node -> the postproc standing for it, or why it can't be one.
Resolve = Callable[[torch.fx.Node], Union[ArgSource, str]]


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


class ShallowTracer(torch.fx.Tracer):
    """Traces only the glue around sharded modules (see the module docstring)."""

    # Models that write to buffers in forward break when buffers are proxied.
    proxy_buffer_attributes = False

    def __init__(self, leaf_modules: Set[str]) -> None:
        super().__init__()
        self._leaf_modules = leaf_modules

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, ShardedModule) or module_qualified_name in self._leaf_modules:
            return True
        if _is_fsdp(m):
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _is_fsdp(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel) or type(module).__name__.startswith(
        "FSDP"
    )


def trace(model: torch.nn.Module) -> torch.fx.Graph:
    """The shallow FX graph of ``model.forward``."""
    return ShallowTracer(leaf_module_names(model)).trace(model)


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
) -> Union[ArgRecipe, str]:
    """How ``arg`` (an FX argument) is read from the batch, or why it can't be.

    With ``resolve``, the path may start at a postproc's output, and a list,
    tuple or dict built in the forward is read element by element.
    """
    if not isinstance(arg, torch.fx.Node):
        if isinstance(arg, (list, tuple, dict)) and _has_node(arg):
            if resolve is None:
                return f"a {type(arg).__name__} built in the forward from traced values"
            return _collection_of(arg, batch_node, resolve)
        return ArgPath.constant(arg)
    steps: List[ArgStep] = []
    node = arg
    while True:
        if node is batch_node:
            return ArgPath(tuple(reversed(steps)))
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
            return ArgPath(tuple(reversed(steps)), source=source)
        if _is_getattr(node) and isinstance(node.args[1], str):
            steps.append(GetAttr(node.args[1]))
        elif (_is_getitem(node) or _is_dict_get(node)) and isinstance(
            node.args[1], (str, int)
        ):
            steps.append(GetItem(node.args[1]))
        else:
            return f"{_describe(node)} modifies the input before the sharded module"
        parent = node.args[0]
        if not isinstance(parent, torch.fx.Node):
            return f"{_describe(node)} does not read from the batch"
        node = parent


def _collection_of(
    value: Union[list, tuple, dict], batch_node: torch.fx.Node, resolve: Resolve
) -> Union[ArgRecipe, str]:
    if isinstance(value, dict):
        entries: List[Tuple[Any, ArgRecipe]] = []
        for key, item in value.items():
            recipe = arg_path_of(item, batch_node, resolve)
            if isinstance(recipe, str):
                return recipe
            entries.append((key, recipe))
        return ArgDict(tuple(entries))
    items: List[ArgRecipe] = []
    for item in value:
        recipe = arg_path_of(item, batch_node, resolve)
        if isinstance(recipe, str):
            return recipe
        items.append(recipe)
    return ArgList(tuple(items), is_tuple=isinstance(value, tuple))


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
    args: List[ArgRecipe] = []
    for arg in node.args:
        path = arg_path_of(arg, batch_node, resolve)
        if isinstance(path, str):
            return path
        args.append(path)
    kwargs: List[Tuple[str, ArgRecipe]] = []
    for name, arg in node.kwargs.items():
        path = arg_path_of(arg, batch_node, resolve)
        if isinstance(path, str):
            return path
        kwargs.append((name, path))
    return CallArgs(tuple(args), tuple(kwargs))


def first_placeholder(graph: torch.fx.Graph) -> Optional[torch.fx.Node]:
    for node in graph.nodes:
        if node.op == "placeholder":
            return node
    return None
