"""Exceptions a pipeline raises that callers may want to catch by type."""

from __future__ import annotations


class ModelDetachedException(RuntimeError):
    """``progress()`` was called on a pipeline whose model is detached.

    Raised by the sparse-dist pipelines after :meth:`detach`; call
    ``attach()`` (optionally with the model) to resume.  A ``RuntimeError``, so
    code that caught that before keeps working.
    """
