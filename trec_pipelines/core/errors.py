"""Exceptions a pipeline raises that callers may want to catch by type."""

from __future__ import annotations

from typing import Optional, Sequence


class ModelDetachedException(RuntimeError):
    """A pipeline was asked to run on a model it is detached from.

    torchrec exports it, so code that catches it keeps importing; our
    pipelines, like torchrec's, do not raise it from ``progress()`` after
    :meth:`detach`: they attach the model again and go on.  A ``RuntimeError``.
    """


class MalformedBatchError(ValueError):
    """A batch failed ``validate_batches``'s checks; raised before any work on it.

    The batch is dropped and the pipeline goes on with the next one at the
    next ``progress()``.  A ``ValueError``.
    """

    @classmethod
    def dropped(
        cls, index: int, problem: str, malformed_on: Optional[Sequence[int]] = None
    ) -> "MalformedBatchError":
        """The error for batch ``index`` with ``problem``, saying what happened and what to do.

        ``malformed_on``: the ranks the batch was malformed on, when the ranks
        agreed on it (see the note "agreeing on each batch" in the source of
        ``trec_pipelines.data.agreement``); every rank dropped it.
        """
        where = ""
        if malformed_on is not None:
            ranks = ", ".join(str(r) for r in malformed_on)
            plural = "s" if len(malformed_on) > 1 else ""
            where = (
                f"malformed on rank{plural} {ranks}, dropped on every rank so they stay in step: "
            )
        error = cls(
            f"batch {index}: {where}{problem}. It was dropped before any work, and the next "
            "progress() goes on with the next batch. Fix the data, or pass "
            "validate_batches=False to turn these checks off."
        )
        error.index = index
        return error

    index: Optional[int] = None  # the dropped batch's index


class OutOfStepError(RuntimeError):
    """The ranks are no longer at the same batch: their collectives would pair the
    wrong batches.  Raised on every rank, naming where each one is.

    It follows a retry or ``skip_failed_batch()`` made on some ranks only (a step
    that raised on one rank must be retried, or skipped, on every rank).  The
    pipeline cannot go on: restart from the last checkpoint.
    """

    @classmethod
    def at(cls, pulls: Sequence[Optional[int]], ranks: Sequence[int]) -> "OutOfStepError":
        """The error for ranks ``ranks`` whose next batches are ``pulls`` (None: none)."""
        where = ", ".join(
            f"rank {r} at {'no batch' if p is None else f'pull {p}'}"
            for r, p in zip(ranks, pulls, strict=True)
        )
        return cls(
            f"the ranks are out of step ({where}): a step was retried or skipped on some "
            "ranks only, so their collectives would pair different batches. Retry or "
            "skip_failed_batch() on every rank alike; to go on now, restart from the last "
            "checkpoint."
        )


class PeerFailedError(RuntimeError):
    """Another rank failed in this step, so this rank's step could not go on.

    Raised from ``progress()`` on the ranks that did not fail, before the step
    issued any work (nothing was trained or lost here), so the program's own
    handlers run: a ``finally:``, a checkpoint on error.  It names the rank
    that failed (:attr:`rank`), the batch (:attr:`batch`) and the first line
    of that rank's error (:attr:`error`).  To go on, call ``progress()``
    again on every rank within ``TREC_PIPELINES_PEER_FAILURE_GRACE`` seconds
    of each other (10 by default): the failed batch is pulled again there and
    the ranks train on in step.  A ``RuntimeError``.
    """

    rank: Optional[int] = None  # the rank that failed (the first, if several did)
    batch: Optional[int] = None  # the index of the batch it failed at
    error: str = ""  # the first line of its error ("OSError: ...")

    @classmethod
    def naming(cls, rank: int, batch: Optional[int], error: str, what: str) -> "PeerFailedError":
        """The error for a peer ``rank`` that failed at ``batch`` with ``error``;
        ``what`` says what happened and how to go on."""
        where = "its batch" if batch is None else f"batch {batch}"
        raised = cls(f"rank {rank} failed at {where}: {error}. {what}")
        raised.rank, raised.batch, raised.error = rank, batch, error
        return raised


class ForwardOutputError(TypeError):
    """The model's forward returned something other than torchrec's ``(losses, output)``.

    Raised by a training pipeline right after the forward, naming what came back
    and how to return the pair.  It is the model's mistake, not the step's: the
    pipeline rolls the step back as for any error, but retrying cannot help.  A
    ``TypeError``.
    """


def is_users_mistake(error: BaseException) -> bool:
    """Whether ``error`` says the caller's code or data is wrong (retrying cannot help)."""
    return isinstance(error, ForwardOutputError)
