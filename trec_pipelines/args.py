"""How a sharded module's inputs are taken out of a batch, without the model.

The pipelines start a module's ``input_dist`` one or two batches before the
model's forward runs, so they need the module's call arguments on their own.
An :class:`ArgPath` is the recipe for one argument: a chain of attribute and
item look-ups starting at the batch (or at the output of a pipelined postproc
module, see :mod:`trec_pipelines.postproc`), or a constant.  :class:`ArgList`
and :class:`ArgDict` are a list or dict built in the forward from such recipes
(postproc arguments).  :class:`CallArgs` holds the recipes for a whole call.

Building the arguments of a call that reads a postproc's output runs that
postproc for the batch, once: its result is cached in the batch's context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Protocol, Tuple, Union


@dataclass(frozen=True)
class GetAttr:
    """``value.name``"""

    name: str

    def apply(self, value: Any) -> Any:
        return getattr(value, self.name)

    def __str__(self) -> str:
        return f".{self.name}"


@dataclass(frozen=True)
class GetItem:
    """``value[key]`` (dict keys, list and tuple indices)."""

    key: Union[str, int]

    def apply(self, value: Any) -> Any:
        return value[self.key]

    def __str__(self) -> str:
        return f"[{self.key!r}]"


ArgStep = Union[GetAttr, GetItem]


class ArgSource(Protocol):
    """Where a path starts instead of the batch: a pipelined postproc module."""

    @property
    def fqn(self) -> str: ...

    def output_for(self, batch: Any, context: Any) -> Any:
        """The module's output for ``batch``, computed once per ``context``."""
        ...


@dataclass(frozen=True)
class ArgPath:
    """One argument: ``steps`` applied to the batch in order, or a constant.

    ``ArgPath((GetAttr("features"), GetItem("sparse")))`` reads
    ``batch.features["sparse"]``; ``ArgPath.constant(None)`` always gives None.
    With a ``source`` the steps start at that postproc's output for the batch:
    ``ArgPath((GetItem(0),), source=p)`` reads ``p(...)[0]``.
    """

    steps: Tuple[ArgStep, ...] = ()
    is_constant: bool = False
    value: Any = None
    source: Optional[ArgSource] = None

    @staticmethod
    def constant(value: Any) -> "ArgPath":
        return ArgPath(is_constant=True, value=value)

    def extract(self, batch: Any, context: Any = None) -> Any:
        if self.is_constant:
            return self.value
        if self.source is not None:
            if context is None:
                raise RuntimeError(
                    f"{self} reads the output of postproc '{self.source.fqn}', which is "
                    "cached per batch: pass the batch's pipeline context"
                )
            value = self.source.output_for(batch, context)
        else:
            value = batch
        for step in self.steps:
            value = step.apply(value)
        return value

    def __str__(self) -> str:
        if self.is_constant:
            return repr(self.value)
        start = "batch" if self.source is None else f"{self.source.fqn}(...)"
        return start + "".join(str(step) for step in self.steps)


@dataclass(frozen=True)
class ArgList:
    """A list (or tuple) built in the forward, one recipe per element."""

    items: Tuple["ArgRecipe", ...]
    is_tuple: bool = False

    def extract(self, batch: Any, context: Any = None) -> Any:
        values = [item.extract(batch, context) for item in self.items]
        return tuple(values) if self.is_tuple else values

    def __str__(self) -> str:
        inner = ", ".join(str(item) for item in self.items)
        return f"({inner})" if self.is_tuple else f"[{inner}]"


@dataclass(frozen=True)
class ArgDict:
    """A dict built in the forward, one recipe per value."""

    items: Tuple[Tuple[Any, "ArgRecipe"], ...]

    def extract(self, batch: Any, context: Any = None) -> Dict[Any, Any]:
        return {key: item.extract(batch, context) for key, item in self.items}

    def __str__(self) -> str:
        return "{" + ", ".join(f"{key!r}: {item}" for key, item in self.items) + "}"


ArgRecipe = Union[ArgPath, ArgList, ArgDict]


def sources_of(recipe: ArgRecipe) -> List[ArgSource]:
    """The postprocs ``recipe`` reads directly (not those they read in turn)."""
    if isinstance(recipe, ArgPath):
        return [] if recipe.source is None else [recipe.source]
    if isinstance(recipe, ArgList):
        return [s for item in recipe.items for s in sources_of(item)]
    return [s for _, item in recipe.items for s in sources_of(item)]


@dataclass(frozen=True)
class CallArgs:
    """The positional and keyword argument recipes of one module call."""

    args: Tuple[ArgRecipe, ...] = ()
    kwargs: Tuple[Tuple[str, ArgRecipe], ...] = ()

    def build(self, batch: Any, context: Any = None) -> Tuple[List[Any], Dict[str, Any]]:
        """The call's ``(args, kwargs)`` for ``batch``.

        ``context`` is the batch's pipeline context; it is needed only when a
        recipe reads a postproc's output (the result is cached there).
        """
        return (
            [path.extract(batch, context) for path in self.args],
            {name: path.extract(batch, context) for name, path in self.kwargs},
        )

    def sources(self) -> List[ArgSource]:
        """The postprocs this call reads directly, in argument order."""
        recipes = list(self.args) + [recipe for _, recipe in self.kwargs]
        return [s for recipe in recipes for s in sources_of(recipe)]

    def __str__(self) -> str:
        parts = [str(path) for path in self.args]
        parts += [f"{name}={path}" for name, path in self.kwargs]
        return f"({', '.join(parts)})"
