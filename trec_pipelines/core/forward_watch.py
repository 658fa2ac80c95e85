"""A model's forward run by the caller's own loop, watched for a failure on one rank.

``StagedTrainPipeline`` prepares batches and the caller's loop runs the
forward, the backward and the optimizer, so no ``progress()`` sees them
raise.  A rank whose forward raises and which then does something else (its
loop caught the error) leaves the other ranks in that step's collectives.
The watch makes it tell them, as a failed ``progress()`` does (see
``[Note: a failed step on one rank]`` in :mod:`trec_pipelines.core.peer_failure`):
each forward starts a step (it lasts until the next forward, so a rank
blocked in the backward's collectives is still in it), and a forward that
raises publishes the failure in the job's store.  A rank left waiting then
ends after the grace, naming the failed rank, as with the other pipelines.
The backward and the optimizer step are the caller's own code: their
failures are not seen.

The watch wraps the model's ``forward`` on the instance while the pipeline is
attached (as the rewrite wraps the sharded modules'), rather than hooking the
model: the model then carries exactly the hooks torchrec's class leaves on it,
which torchrec's code and users' code count and remove.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional

import torch

from trec_pipelines.core import peer_failure
from trec_pipelines.core.notes import add_note


def _before(module: torch.nn.Module, args: Any) -> None:
    ranks = peer_failure.news()
    if ranks is not None:
        ranks.begin_step()  # each forward is a step of its own


def _after(
    index: Callable[[], Optional[int]], module: torch.nn.Module, args: Any, output: Any
) -> None:
    ranks = peer_failure.news()
    error = sys.exc_info()[1]  # set while the forward's exception propagates
    if ranks is None:
        return
    if error is None:
        ranks.retract()  # this rank's forward went through: a past failure is over
        return
    first = (str(error).splitlines() or [""])[0]
    ranks.failed(f"the model's forward raised {type(error).__name__}: {first}", index())
    grace = peer_failure.grace_seconds()
    add_note(
        error,
        "trec_pipelines: this rank's forward raised; the other ranks are waiting in its "
        "collectives. Each reads this failure in the job's store and, after "
        f"{grace:.0f} s (TREC_PIPELINES_PEER_FAILURE_GRACE), ends its process with status "
        "1 naming this rank, whatever this rank does next: a wait in the model's "
        "collectives cannot be interrupted short of the process group's timeout, so "
        "ending is the last resort. Retrying the forward goes on only where every rank "
        "raised in it.",
    )


class WatchedForward:
    """Replaces ``model.forward`` on the instance until :meth:`remove`: each call
    runs ``before(model, args)`` (the pipeline's own count of forwards), then the
    model's forward, watched as the module note says (``index()``: the batch a
    forward trains, for the message)."""

    def __init__(
        self,
        model: torch.nn.Module,
        index: Callable[[], Optional[int]],
        before: Callable[[torch.nn.Module, Any], None],
    ) -> None:
        self._model = model
        self._index = index
        self._before = before
        self._forward: Callable[..., Any] = model.forward
        # What removing puts back: the instance's own forward if it had one.
        self._had_own = "forward" in model.__dict__
        self._own = model.__dict__.get("forward")
        self._removed = False
        # inspect.signature(model.forward), help() and the forward's name read as the
        # model's own forward (through __wrapped__) while the watch is on.
        functools.update_wrapper(self, self._forward)
        # Not nn.Module.__setattr__, which would register a Module as a child.
        object.__setattr__(model, "forward", self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._removed:  # wrapped over by someone else before removal: pass through
            return self._forward(*args, **kwargs)
        self._before(self._model, args)
        _before(self._model, args)
        try:
            output = self._forward(*args, **kwargs)
        except Exception:  # what a module's always-called forward hook sees
            _after(self._index, self._model, args, None)
            raise
        _after(self._index, self._model, args, output)
        return output

    def raised(self) -> None:
        """Called while an exception raised in the model's forward hooks propagates:
        tell the other ranks, as for the forward itself."""
        _after(self._index, self._model, (), None)

    def remove(self) -> None:
        """Give the model back the forward it had (only if nothing wrapped it since)."""
        self._removed = True
        if self._model.__dict__.get("forward") is not self:
            return
        if self._had_own:
            object.__setattr__(self._model, "forward", self._own)
        else:
            del self._model.__dict__["forward"]
