"""How a sharded module's inputs are taken out of a batch, without the model.

The pipelines start a module's ``input_dist`` one or two batches before the
model's forward runs, so they need the module's call arguments on their own.
An :class:`ArgInfo` is the recipe for one argument: steps applied to the batch
in order (attribute and item look-ups, a constant, a list or dict of other
recipes, the output of a pipelined postproc).  :class:`CallArgs` holds the
recipes for a whole call.  The names and methods are torchrec's (``ArgInfo``,
``CallArgs``, ``ArgInfoStepFactory``), so code that builds recipes for torchrec
builds ours.

A :class:`Postproc` step runs a postproc module (see
:mod:`trec_pipelines.model.postproc`) on the value so far.  A pipelined one runs once
per batch: its output is cached in the context it holds, which the pipeline
sets to the batch's context around the input_dist stage
(:func:`trec_pipelines.model.postproc.use_context_for_postprocs`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Protocol, Tuple, Union, runtime_checkable


class ArgStep(abc.ABC):
    """One transformation of the value the previous step produced."""

    @abc.abstractmethod
    def process(self, arg: Any) -> Any:
        """The step applied to ``arg``."""

    def describe(self, value: str) -> str:
        """How the result reads, given how ``value`` (the value so far) reads."""
        return value + str(self)


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


@runtime_checkable
class RunsAhead(Protocol):
    """A postproc cached per batch (:class:`trec_pipelines.PipelinedPostproc`)."""

    @property
    def fqn(self) -> str: ...

    @property
    def args(self) -> CallArgs: ...

    def output_for(self, batch: Any) -> Any:
        """The output for ``batch``, computed once per batch context."""
        ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The postproc run as a module (outside a pipelined step)."""
        ...


@dataclass(frozen=True)
class Postproc(ArgStep):
    """The output of a postproc module run on the value.

    A pipelined postproc (:class:`RunsAhead`) computes it once per batch and
    caches it in its current context; any other module is simply called, as
    torchrec's postproc step does.
    """

    module: Callable[[Any], Any]

    def process(self, arg: Any) -> Any:
        if isinstance(self.module, RunsAhead):
            return self.module.output_for(arg)
        return self.module(arg)

    def describe(self, value: str) -> str:
        if isinstance(self.module, RunsAhead):
            return f"{self.module.fqn}(...)"  # its own arguments are in its recipe
        return f"{type(self.module).__name__}({value})"


@dataclass(frozen=True, eq=False)
class ListOf(ArgStep):
    """A list (or, with ``as_tuple``, a tuple) whose items are recipes (read
    from the value) or constants."""

    items: List[Any]
    as_tuple: bool = False

    def process(self, arg: Any) -> Any:
        values = [_resolve(item, arg) for item in self.items]
        return tuple(values) if self.as_tuple else values

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ListOf)
            and self.as_tuple == other.as_tuple
            and _same_items(self.items, other.items)
        )

    def describe(self, value: str) -> str:
        inner = ", ".join(_show(item) for item in self.items)
        return f"({inner})" if self.as_tuple else f"[{inner}]"


@dataclass(frozen=True, eq=False)
class DictOf(ArgStep):
    """A dict whose values are recipes (read from the value) or constants."""

    items: Dict[str, Any]

    def process(self, arg: Any) -> Any:
        return {key: _resolve(item, arg) for key, item in self.items.items()}

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, DictOf)
            and list(self.items) == list(other.items)
            and _same_items(list(self.items.values()), list(other.items.values()))
        )

    def describe(self, value: str) -> str:
        inner = ", ".join(f"{key!r}: {_show(item)}" for key, item in self.items.items())
        return f"{{{inner}}}"


def _same_items(ours: List[Any], theirs: List[Any]) -> bool:
    # Constants compare by identity when == is not a plain bool (tensors).
    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs, strict=True):
        if isinstance(a, ArgInfo) or isinstance(b, ArgInfo):
            if a != b:
                return False
        elif a is not b:
            try:
                if not bool(a == b):
                    return False
            except Exception:  # e.g. a multi-element tensor: identity only
                return False
    return True


def _show(item: Any) -> str:
    return str(item) if isinstance(item, ArgInfo) else repr(item)


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

    def postprocs(self) -> List[RunsAhead]:
        """The pipelined postprocs this recipe reads directly (not those they read in turn)."""
        found: List[RunsAhead] = []
        for step in self.steps:
            if isinstance(step, Postproc) and isinstance(step.module, RunsAhead):
                found.append(step.module)
            elif isinstance(step, (ListOf, DictOf)):
                items = step.items if isinstance(step, ListOf) else list(step.items.values())
                found += [
                    p for item in items if isinstance(item, ArgInfo) for p in item.postprocs()
                ]
        return found

    def __str__(self) -> str:
        if len(self.steps) == 1 and isinstance(self.steps[0], Constant):
            return repr(self.steps[0].value)
        text = "batch"
        for step in self.steps:
            text = step.describe(text)
        return text


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

    def postprocs(self) -> List[RunsAhead]:
        """The pipelined postprocs this call reads directly, in argument order."""
        recipes = list(self.args) + list(self.kwargs.values())
        return [p for recipe in recipes for p in recipe.postprocs()]

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
        return Postproc(pipelined_postproc_module)

    @classmethod
    def from_scalar(cls, value: object) -> ArgStep:
        return Constant(value)

    @classmethod
    def from_list(cls, value: List[object]) -> ArgStep:
        return ListOf(list(value))

    @classmethod
    def from_dict(cls, value: Dict[str, object]) -> ArgStep:
        return DictOf(dict(value))
