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
