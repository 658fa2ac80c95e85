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
        agreed on it (see ``[Note: agreeing on each batch]``); every rank dropped it.
        """
        where = ""
        if malformed_on is not None:
            ranks = ", ".join(str(r) for r in malformed_on)
            plural = "s" if len(malformed_on) > 1 else ""
            where = (
                f"malformed on rank{plural} {ranks}, dropped on every rank so they stay in step: "
            )
        return cls(
            f"batch {index}: {where}{problem}. It was dropped before any work, and the next "
            "progress() goes on with the next batch. Fix the data, or pass "
            "validate_batches=False to turn these checks off."
        )
