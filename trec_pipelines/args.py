"""How a sharded module's inputs are taken out of a batch, without the model.

The pipelines start a module's ``input_dist`` one or two batches before the
model's forward runs, so they need the module's call arguments on their own.
An :class:`ArgInfo` is the recipe for one argument: steps applied to the batch
in order (attribute and item look-ups, a constant, a list or dict of other
recipes, a module call).  :class:`CallArgs` holds the recipes for a whole call.
The names and methods are torchrec's (``ArgInfo``, ``CallArgs``,
``ArgInfoStepFactory``), so code that builds recipes for torchrec builds ours.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple, Union


class ArgStep(abc.ABC):
    """One transformation of the value the previous step produced."""

    @abc.abstractmethod
    def process(self, arg: Any) -> Any:
        """The step applied to ``arg``."""


@dataclass(frozen=True)
class Noop(ArgStep):
    """The value itself (a module called with the whole batch)."""

    def process(self, arg: Any) -> Any:
        return arg

    def __str__(self) -> str:
        return ""


@dataclass(frozen=True)
class GetAttr(ArgStep):
    """``value.name``"""

    name: str

    def process(self, arg: Any) -> Any:
        return getattr(arg, self.name)

    def __str__(self) -> str:
        return f".{self.name}"


@dataclass(frozen=True)
class GetItem(ArgStep):
    """``value[key]`` (dict keys, list and tuple indices)."""

    key: Union[str, int]

    def process(self, arg: Any) -> Any:
        return arg[self.key]

    def __str__(self) -> str:
        return f"[{self.key!r}]"


@dataclass(frozen=True)
class Constant(ArgStep):
    """Always ``value``, whatever the batch."""

    value: Any

    def process(self, arg: Any) -> Any:
        return self.value

    def __str__(self) -> str:
        return f" -> {self.value!r}"


@dataclass(frozen=True, eq=False)
class CallModule(ArgStep):
    """``module(value)``: a module run on the batch before the sharded module."""

    module: Callable[[Any], Any]

    def process(self, arg: Any) -> Any:
        return self.module(arg)

    def __str__(self) -> str:
        return f" -> {type(self.module).__name__}(...)"


@dataclass(frozen=True, eq=False)
class ListOf(ArgStep):
    """A list whose items are recipes (read from the value) or constants."""

    items: List[Any]

    def process(self, arg: Any) -> Any:
        return [_resolve(item, arg) for item in self.items]


@dataclass(frozen=True, eq=False)
class DictOf(ArgStep):
    """A dict whose values are recipes (read from the value) or constants."""

    items: Dict[str, Any]

    def process(self, arg: Any) -> Any:
        return {key: _resolve(item, arg) for key, item in self.items.items()}


def _resolve(item: Any, arg: Any) -> Any:
    return item.process_steps(arg) if isinstance(item, ArgInfo) else item


@dataclass
class ArgInfo:
    """One argument: ``steps`` applied to the batch in order.

    ``ArgInfo([GetAttr("features"), GetItem("sparse")])`` reads
    ``batch.features["sparse"]``; ``ArgInfo([Noop()])`` is the batch itself;
    ``ArgInfo.constant(None)`` always gives None.  With no steps at all it gives
    None, as torchrec's does.
    """

    steps: List[ArgStep]

    @staticmethod
    def constant(value: Any) -> ArgInfo:
        return ArgInfo([Constant(value)])

    @staticmethod
    def from_batch(steps: Tuple[ArgStep, ...] = ()) -> ArgInfo:
        """The recipe reading ``steps`` from the batch (the batch itself if none)."""
        return ArgInfo(list(steps) if steps else [Noop()])

    def add_step(self, step: ArgStep) -> ArgInfo:
        """Put ``step`` first (recipes are often found from the module back to the batch)."""
        self.steps.insert(0, step)
        return self

    def append_step(self, step: ArgStep) -> ArgInfo:
        self.steps.append(step)
        return self

    def process_steps(self, arg: Any) -> Any:
        """The argument for batch ``arg``."""
        if not self.steps:
            return None
        for step in self.steps:
            arg = step.process(arg)
        return arg

    def __str__(self) -> str:
        if len(self.steps) == 1 and isinstance(self.steps[0], Constant):
            return repr(self.steps[0].value)
        return "batch" + "".join(str(step) for step in self.steps)


@dataclass
class CallArgs:
    """The positional and keyword argument recipes of one module call."""

    args: List[ArgInfo]
    kwargs: Dict[str, ArgInfo]

    def build_args_kwargs(self, initial_input: Any) -> Tuple[List[Any], Dict[str, Any]]:
        """The call's ``(args, kwargs)`` for batch ``initial_input``."""
        return (
            [arg.process_steps(initial_input) for arg in self.args],
            {name: arg.process_steps(initial_input) for name, arg in self.kwargs.items()},
        )

    def __str__(self) -> str:
        parts = [str(arg) for arg in self.args]
        parts += [f"{name}={arg}" for name, arg in self.kwargs.items()]
        return f"({', '.join(parts)})"


class ArgInfoStepFactory:
    """Builds the steps of an :class:`ArgInfo` by torchrec's names."""

    @classmethod
    def noop(cls) -> ArgStep:
        return Noop()

    @classmethod
    def get_attr(cls, name: str) -> ArgStep:
        return GetAttr(name)

    @classmethod
    def get_item(cls, index: Union[str, int]) -> ArgStep:
        return GetItem(index)

    @classmethod
    def postproc(cls, pipelined_postproc_module: Callable[[Any], Any]) -> ArgStep:
        return CallModule(pipelined_postproc_module)

    @classmethod
    def from_scalar(cls, value: object) -> ArgStep:
        return Constant(value)

    @classmethod
    def from_list(cls, value: List[object]) -> ArgStep:
        return ListOf(list(value))

    @classmethod
    def from_dict(cls, value: Dict[str, object]) -> ArgStep:
        return DictOf(dict(value))
