"""Exceptions a pipeline raises that callers may want to catch by type."""

from __future__ import annotations


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
    def dropped(cls, index: int, problem: str) -> "MalformedBatchError":
        """The error for batch ``index`` with ``problem``, saying what happened and what to do."""
        return cls(
            f"batch {index}: {problem}. It was dropped before any work, and the next "
            "progress() goes on with the next batch. Fix the data, or pass "
            "validate_batches=False to turn these checks off."
        )
