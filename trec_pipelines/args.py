"""How a sharded module's inputs are taken out of a batch, without the model.

The pipelines start a module's ``input_dist`` one or two batches before the
model's forward runs, so they need the module's call arguments on their own.
An :class:`ArgPath` is the recipe for one argument: a chain of attribute and
item look-ups starting at the batch, or a constant.  :class:`CallArgs` holds the
recipes for a whole call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple, Union


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


@dataclass(frozen=True)
class ArgPath:
    """One argument: ``steps`` applied to the batch in order, or a constant.

    ``ArgPath((GetAttr("features"), GetItem("sparse")))`` reads
    ``batch.features["sparse"]``; ``ArgPath.constant(None)`` always gives None.
    """

    steps: Tuple[ArgStep, ...] = ()
    is_constant: bool = False
    value: Any = None

    @staticmethod
    def constant(value: Any) -> "ArgPath":
        return ArgPath(is_constant=True, value=value)

    def extract(self, batch: Any) -> Any:
        if self.is_constant:
            return self.value
        for step in self.steps:
            batch = step.apply(batch)
        return batch

    def __str__(self) -> str:
        if self.is_constant:
            return repr(self.value)
        return "batch" + "".join(str(step) for step in self.steps)


@dataclass(frozen=True)
class CallArgs:
    """The positional and keyword argument recipes of one module call."""

    args: Tuple[ArgPath, ...] = ()
    kwargs: Tuple[Tuple[str, ArgPath], ...] = ()

    def build(self, batch: Any) -> Tuple[List[Any], Dict[str, Any]]:
        """The call's ``(args, kwargs)`` for ``batch``."""
        return (
            [path.extract(batch) for path in self.args],
            {name: path.extract(batch) for name, path in self.kwargs},
        )

    def __str__(self) -> str:
        parts = [str(path) for path in self.args]
        parts += [f"{name}={path}" for name, path in self.kwargs]
        return f"({', '.join(parts)})"
