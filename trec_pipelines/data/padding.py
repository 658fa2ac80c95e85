"""Padding batches: how an eval pipeline scores every rank's batches when ranks hold uneven counts.

[Note: padding uneven eval data]
Two policies for the end of data on several ranks (the ranks agree on each
pull, see ``[Note: agreeing on each batch]`` in
:mod:`trec_pipelines.data.agreement`):

* ``"stop"`` (every training pipeline, always): the epoch ends on every rank
  at the step where the first rank's data ends; the batches other ranks
  still hold are not used (``unused_batches``).  Training in step needs it:
  a rank cannot train on a batch the others do not have.
* ``"pad"`` (the eval pipelines' default, option ``uneven_data``): a rank
  whose data ended keeps taking part in the steps' collectives with padding
  batches until every rank's data has ended, so every rank scores all of
  its own batches.  A padding batch is the rank's own last real batch, run
  again: its output is thrown away.  The pipeline's ``progress()`` that would
  return the first padding batch's output runs the padded steps itself and
  then raises ``StopIteration``: the caller sees exactly its own batches'
  outputs, one per call, as on a single rank.

The source (:class:`~trec_pipelines.data.source.BatchSource`) makes the
choice as each pull is agreed: some rank ended and not all
(:attr:`~trec_pipelines.data.agreement.Agreed.ended` without
``all_ended``), a rank with a batch keeps it and a rank without one gets a
:class:`Padding`; once every rank ended, the epoch ends everywhere.  A rank
with no batch at all in the epoch has nothing to pad with: every rank knows
it at the same pull (no rank had accepted a batch of the epoch when the
first rank ended, and the ranks accept batches in step until then), and
every rank raises the error of :func:`nothing_to_pad_with`, rather than one
rank hanging.

``StagedTrainPipeline`` (and ``SparseDataDistUtil``) keep ``"stop"``: there
the user's own loop runs the model on each batch the pipeline returns, so a
padding batch would reach the user's loop as a batch, changing what the loop
sees; the pipeline cannot run the model's forward for it in the user's place.
``TrainEvalHybridPipelineBase`` keeps ``"stop"`` too: its one source
alternates train and eval iterators, and a train iterator's pull, agreed one
step ahead, can be settled after the switch to eval, where a per-call
policy would pad a training batch; a padded eval pass mid-training runs an
eval pipeline on the same model instead.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Tuple, get_args

import torch.distributed as dist

# What a rank does when its data ends before the other ranks' (see the note above).
UnevenData = Literal["pad", "stop"]
UNEVEN_DATA_POLICIES: Tuple[str, ...] = get_args(UnevenData)


@dataclass(frozen=True)
class Padding:
    """A padding batch handed out by the source: run it like a batch, throw its output away.

    Attributes:
        batch: the host batch to run, this rank's own last real batch of the epoch.
    """

    batch: Any


def unwrap(host: Any) -> Tuple[Any, bool]:
    """The host batch to run for ``host`` (a batch or a :class:`Padding`), and
    whether it is a padding batch."""
    if isinstance(host, Padding):
        return host.batch, True
    return host, False


def first_real_output(step: Callable[[], Tuple[Any, bool]]) -> Any:
    """Run ``step`` (one eval step: its output, and whether its batch pads) until a
    real batch's step returns, and return that output.  A padding batch's step runs
    for the other ranks' collectives; its output is no one's.  Once every rank's
    data ended, a step raises ``StopIteration``, which ends the loop."""
    while True:
        output, padding = step()
        if not padding:
            return output


def nothing_to_pad_with(rank: int, here_empty: bool) -> RuntimeError:
    """The error every rank raises when a rank has no batch of the epoch to pad with."""
    where = "this rank" if here_empty else "another rank"
    return RuntimeError(
        f"rank {rank}: {where} has no batch at all in this epoch, so it has nothing to pad "
        "the other ranks' remaining eval steps with (uneven_data='pad'). Give every rank at "
        "least one batch (e.g. shard the eval set so no rank's share is empty), or pass "
        "uneven_data='stop' to end every rank's epoch at the shortest rank's end."
    )


def _left_in(iterator: Any) -> Optional[int]:
    """How many batches ``iterator`` still holds, when it can say (a list's
    iterator, a torch ``DataLoader``'s); None otherwise (a generator)."""
    yielded = getattr(iterator, "_num_yielded", None)
    if yielded is not None and hasattr(iterator, "__len__"):
        return max(len(iterator) - int(yielded), 0)
    left = operator.length_hint(iterator, -1)
    return None if left < 0 else left


def uneven_stop(pulled: int, dropped: int, iterator: Any) -> str:
    """What a rank logs when another rank's data ended first (training stops at the
    shortest rank): of the ``pulled`` batches it pulled this epoch, ``dropped`` are
    not trained, nor is what ``iterator`` still holds."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    left = _left_in(iterator)
    unread = (
        "the rest of its iterator is not read (it cannot say how many batches are left)"
        if left is None
        else f"the {left} batch(es) still in its iterator are not read"
    )
    untrained = "" if left is None else f" {dropped + left} of this rank's batches are not trained:"
    return (
        f"rank {rank}: another rank's data ended, so this epoch stops here on every rank, "
        f"in step (training stops at the shortest rank).{untrained} this rank pulled "
        f"{pulled} batch(es) this epoch and trains {pulled - dropped}; {dropped} pulled "
        f"batch(es) are dropped untrained (counted in pipeline.unused_batches), and {unread}. "
        "To train every batch, give every rank the same number of batches per epoch "
        "(e.g. a DistributedSampler with drop_last=True, or repeat the short ranks' data)."
    )
