"""A model's forward run by the caller's own loop, watched for a failure on one rank.

``StagedTrainPipeline`` prepares batches and the caller's loop runs the
forward, the backward and the optimizer, so no ``progress()`` sees them
raise.  A rank whose forward raises and which then does something else (its
loop caught the error) leaves the other ranks in that step's collectives.
These hooks make it tell them, as a failed ``progress()`` does (see
``[Note: a failed step on one rank]`` in :mod:`trec_pipelines.core.peer_failure`):
each forward starts a step (it lasts until the next forward, so a rank
blocked in the backward's collectives is still in it), and a forward that
raises publishes the failure in the job's store.  A rank left waiting then
ends after the grace, naming the failed rank, as with the other pipelines.
The backward and the optimizer step are the caller's own code: their
failures are not seen.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, List, Optional

import torch
from torch.utils.hooks import RemovableHandle

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


def watch(model: torch.nn.Module, index: Callable[[], Optional[int]]) -> List[RemovableHandle]:
    """Watch ``model``'s forwards (see the module note; ``index()``: the batch a
    forward trains, for the message); the hooks' handles."""
    return [
        model.register_forward_pre_hook(_before),
        model.register_forward_hook(functools.partial(_after, index), always_call=True),
    ]
