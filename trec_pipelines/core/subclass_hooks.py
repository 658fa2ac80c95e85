"""What a subclass may override: each of torchrec's hooks honoured, allowed with a warning, or refused.

[Note: subclass hooks]
Code written for torchrec often subclasses its pipelines and overrides a
method: ``_backward`` to add a ``GradScaler``, ``_next_batch`` to filter
batches, a ``progress()`` rebuilt from ``enqueue_batch``, ``fill_pipeline``,
``_set_module_context`` and ``dequeue_batch``.  Every method of torchrec's
same-named class is, in ours, one of

* honoured: defined with torchrec's signature and called at the equivalent
  point of the timeline, with the same meaning, so an override takes effect;
* uncalled: torchrec's class never calls it (its progress(), fill,
  constructor, attach, reset and finaliser never reach it) and neither does
  ours.  An override changes nothing on either, so code that stubs it (a test
  that overrides it with ``pass``) must still run: the class is created, with
  one warning naming the hook;
* refused: torchrec's class calls it (the call may depend on an option, as
  the asynchronous in-place copy does on ``async_inplace_copy=True``) and ours
  has no equivalent point to call it at (the state it works on has another
  shape here).  A subclass that defines it gets a ``TypeError`` as the class
  is created, naming the hook, why, and what to override instead.

Never silently ignored.  Each class declares its decisions in its traits'
``hooks`` (:class:`~trec_pipelines.assembly.traits.Traits`), on top of its
base's (the nearest class's decision wins); ``PipelineCore.__init_subclass__`` calls
:func:`check_subclass`, which checks a subclass defined outside this package
as it is created.  Where torchrec's releases differ,
a hook either release never calls is uncalled (a ``TypeError`` would stop
code that runs on that release); a method one release does not have is
decided by the release that has it.  The migration guide's "Subclassing"
section lists every decision.

A subclass's own ``progress()`` runs inside the step guard
(:func:`~trec_pipelines.core.step_guard.guarded_user_step`): a progress rebuilt from the verbs
rolls back when it raises and retires each trained batch's host copy, as
ours does.  This wrapping is the one rewrite of a user's class, and it is
needed: the guard has to mark the step begun before the user's first line
issues work (else a failure there is not rolled back), and has to retire the
host copies and hand back the failed batch after the user's last line.  Only
the user's ``progress()`` can be wrapped for that, as ours calls no hook
around it.  A pipeline without a step guard (StagedTrainPipeline) passes no
wrapper.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Set, Tuple, Union


@dataclass(frozen=True)
class Refused:
    """A hook torchrec's class calls and ours cannot honour: why, and what to
    override instead."""

    why: str
    instead: str


@dataclass(frozen=True)
class Uncalled:
    """A hook neither torchrec's class nor ours calls: why torchrec's does not,
    and what to override to change the step."""

    why: str
    instead: str


Decision = Union[Refused, Uncalled]


class UncalledHookWarning(UserWarning):
    """A subclass overrides a hook that neither torchrec's class nor ours calls."""


# Decisions several classes share.
VERSION_0 = Uncalled(
    "it belongs to torchrec's deprecated first pipeline API, which no progress() calls any more",
    "fill_pipeline(dataloader_iter), copy_batch_to_gpu(dataloader_iter) or "
    "start_sparse_data_dist(batch, context) / wait_sparse_data_dist(context)",
)
FORWARD_TYPE = Refused(
    "torchrec reads it to wrap the sharded modules' forwards (as it fills the pipeline and on "
    "attach()); here the forward wrappers are ours (they read our contexts and streams), chosen "
    "per module",
    "_make_forward(name, call_args, module), which returns the wrapper for one module",
)
ASYNC_COPY = Refused(
    "torchrec calls it to run the asynchronous in-place copy (async_inplace_copy=True: set up in "
    "the constructor, each batch submitted from inplace_copy_batch_to_gpu, shut down when the "
    "pipeline is collected); here that copy runs on a worker of ours that owns the Future and "
    "the stream protocol",
    "inplace_copy_batch_to_gpu(dataloader_iter)",
)
# _submit_inplace_copy where the constructor takes no async_inplace_copy, so that
# torchrec's flag stays False and inplace_copy_batch_to_gpu never submits.
ASYNC_SUBMIT_OFF = Uncalled(
    "this class's constructor takes no async_inplace_copy, so torchrec's never submits an "
    "asynchronous copy",
    "inplace_copy_batch_to_gpu(dataloader_iter)",
)


def never_called(cls: str, instead: str, why: str = "") -> Uncalled:
    """The decision for a hook ``cls``'s progress() (torchrec's and ours) never calls."""
    return Uncalled(f"torchrec's {cls} never calls it" + (f": {why}" if why else ""), instead)


def decided_hooks(cls: type) -> Dict[str, Decision]:
    """Every hook ``cls`` does not honour, uncalled or refused: its traits' ``hooks``
    (each class's decisions on top of its base's, the nearest class's winning)."""
    traits = getattr(cls, "_traits", None)
    return dict(traits.hooks) if traits is not None else {}


def refused_hooks(cls: type) -> Dict[str, Refused]:
    """The hooks ``cls`` refuses: defining one is a ``TypeError``."""
    return {n: d for n, d in decided_hooks(cls).items() if isinstance(d, Refused)}


def uncalled_hooks(cls: type) -> Dict[str, Uncalled]:
    """The hooks neither ``cls`` nor torchrec's class of that name calls: defining
    one is allowed, with one :class:`UncalledHookWarning`."""
    return {n: d for n, d in decided_hooks(cls).items() if isinstance(d, Uncalled)}


# (module, qualified name, bases, hook) already warned about: a class statement run
# again (in a function, in a test) warns once.
_warned: Set[Tuple[str, str, Tuple[str, ...], str]] = set()


def check_subclass(
    cls: type,
    guard_progress: Optional[Callable[[Callable[..., Any]], Callable[..., Any]]] = None,
) -> None:
    """Check, as ``cls`` is created, the hooks it overrides (refused: ``TypeError``;
    uncalled: one warning), and wrap its own ``progress()`` with ``guard_progress``.

    Called from ``PipelineCore.__init_subclass__``; a class of this package is
    not checked (the decisions are made here).  ``guard_progress`` is None for a
    pipeline without a step guard.
    """
    if _is_ours(cls):
        return
    decided = decided_hooks(cls)
    for name in cls.__dict__:
        decision = decided.get(name)
        if isinstance(decision, Refused):
            raise TypeError(refusal_message(cls, name, decision))
    for name in cls.__dict__:
        decision = decided.get(name)
        if isinstance(decision, Uncalled):
            _warn_uncalled(cls, name, decision)
    if guard_progress is not None and "progress" in cls.__dict__:
        cls.progress = guard_progress(cls.__dict__["progress"])  # type: ignore[attr-defined]


def overrides_outside(cls: type, hook: str) -> bool:
    """Whether the ``hook`` ``cls`` finds first along its MRO was defined outside this
    package (by a user's subclass)."""
    for klass in cls.__mro__:
        if hook in vars(klass):
            return not _is_ours(klass)
    return False


def _is_ours(klass: type) -> bool:
    """Whether ``klass`` is defined in this package."""
    return klass.__module__.split(".")[0] == "trec_pipelines"


def _ours(cls: type) -> str:
    """The name of the nearest of our classes ``cls`` derives from."""
    return next(
        (b.__name__ for b in cls.__mro__ if _is_ours(b)),
        "the pipeline",
    )


def refusal_message(cls: type, name: str, refusal: Refused) -> str:
    """The ``TypeError`` text for ``cls`` overriding refused hook ``name``."""
    return (
        f"{cls.__name__} overrides {name}, which torchrec's {_ours(cls)} calls and "
        f"trec_pipelines' cannot honour: {refusal.why}. Override {refusal.instead} instead "
        "(see 'Subclassing' in the migration guide)."
    )


def uncalled_message(cls: type, name: str, uncalled: Uncalled) -> str:
    """The warning text for ``cls`` overriding uncalled hook ``name``."""
    return (
        f"{cls.__name__} overrides {name}, which trec_pipelines' {_ours(cls)} does not call, "
        f"nor does torchrec's ({uncalled.why}): the override has no effect, as on torchrec. "
        f"To change the step, override {uncalled.instead} (see 'Subclassing' in the "
        "migration guide)."
    )


def _warn_uncalled(cls: type, name: str, uncalled: Uncalled) -> None:
    key = (cls.__module__, cls.__qualname__, _bases(cls), name)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(
        uncalled_message(cls, name, uncalled), UncalledHookWarning, stacklevel=_user_frame()
    )


def _bases(cls: type) -> Tuple[str, ...]:
    return tuple(f"{b.__module__}.{b.__qualname__}" for b in cls.__bases__)


def _user_frame() -> int:
    """The ``stacklevel`` of the frame that runs the class statement: the first
    outside this package and the class machinery (``abc``, ``typing``)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in ("trec_pipelines", "abc", "typing"):
            return level
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return 1
