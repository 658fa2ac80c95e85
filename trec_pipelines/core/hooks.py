"""What a subclass may override: each of torchrec's hooks honoured, or refused out loud.

[Note: subclass hooks]
Code written for torchrec often subclasses its pipelines and overrides a
method: ``_backward`` to add a ``GradScaler``, ``_next_batch`` to filter
batches, a ``progress()`` rebuilt from ``enqueue_batch``, ``fill_pipeline``,
``_set_module_context`` and ``dequeue_batch``.  Every method of torchrec's
same-named class is, in ours, either

* honoured: defined with torchrec's signature and called at the equivalent
  point of the timeline, with the same meaning, so an override takes effect;
  or
* refused: where our schedule has no equivalent point (torchrec's own
  ``progress()`` never calls it, or the state it works on has another shape
  here), a subclass that defines it gets a ``TypeError`` as the class is
  created, naming the hook, why, and what to override instead.

Never silently ignored.  Each class names its refusals in ``_refused_hooks``
(merged along its bases); :class:`Hooks` checks a subclass defined outside
this package as it is created.  The migration guide's "Subclassing" section
lists every decision.

A subclass's own ``progress()`` runs inside the step guard
(:mod:`trec_pipelines.core.step_guard`): a progress rebuilt from the verbs
rolls back when it raises and retires each trained batch's host copy, as
ours does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Iterator, Mapping


@dataclass(frozen=True)
class Refused:
    """Why a hook is refused, and what to override instead."""

    why: str
    instead: str


# Refusals several classes share.
NEVER_CALLED = "torchrec's {cls}.progress() never calls it either, so an override changes nothing"
VERSION_0 = Refused(
    "it belongs to torchrec's deprecated first pipeline API, which no progress() calls any more",
    "fill_pipeline(dataloader_iter), copy_batch_to_gpu(dataloader_iter) and "
    "start_sparse_data_dist(batch, context) / wait_sparse_data_dist(context)",
)
FORWARD_TYPE = Refused(
    "the forward wrappers are ours (they read our contexts and streams), chosen per module",
    "_make_forward(name, call_args, module), which returns the wrapper for one module",
)
ASYNC_COPY = Refused(
    "the asynchronous in-place copy runs on a worker of ours that owns the Future and the "
    "stream protocol",
    "inplace_copy_batch_to_gpu(dataloader_iter)",
)


def never_called(cls: str, instead: str) -> Refused:
    """The refusal of a hook ``cls``'s progress() (torchrec's and ours) never calls."""
    return Refused(NEVER_CALLED.format(cls=cls), instead)


def refused_hooks(cls: type) -> Dict[str, Refused]:
    """Every hook ``cls`` refuses, merged along its bases (the nearest wins)."""
    merged: Dict[str, Refused] = {}
    for base in reversed(cls.__mro__):
        merged.update(base.__dict__.get("_refused_hooks", {}))
    return merged


class Hooks:
    """Checks, as a user's subclass is created, that it overrides no refused hook,
    and runs its own ``progress()`` inside the step guard (see the module note)."""

    _refused_hooks: ClassVar[Mapping[str, Refused]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__module__.split(".")[0] == "trec_pipelines":
            return  # ours: the decisions are made here
        refused = refused_hooks(cls)
        for name in cls.__dict__:
            if name in refused:
                raise TypeError(refusal_message(cls, name, refused[name]))
        if "progress" in cls.__dict__:
            guard = getattr(cls, "_guard_user_progress", None)
            if guard is not None:
                cls.progress = guard(cls.__dict__["progress"])  # type: ignore[attr-defined]


def refusal_message(cls: type, name: str, refusal: Refused) -> str:
    """The ``TypeError`` text for ``cls`` overriding refused hook ``name``."""
    ours = next(
        (b.__name__ for b in cls.__mro__ if b.__module__.split(".")[0] == "trec_pipelines"),
        "the pipeline",
    )
    return (
        f"{cls.__name__} overrides {name}, which trec_pipelines' {ours} does not call: "
        f"{refusal.why}. Override {refusal.instead} instead (see 'Subclassing' in the "
        "migration guide)."
    )


def beginning_the_step(
    progress: Callable[[Any, Iterator[Any]], Any],
) -> Callable[[Any, Iterator[Any]], Any]:
    """``progress`` that marks the step begun first: a user's progress issues work
    from its first line, so a failure anywhere in it is rolled back."""

    @functools.wraps(progress)
    def begun(self: Any, dataloader_iter: Iterator[Any]) -> Any:
        self._step_guard.begin()
        return progress(self, dataloader_iter)

    return begun
