"""A note added to an exception on its way to the user, on every Python we support.

Python 3.11's ``BaseException.add_note`` keeps the note in ``__notes__``, and
the traceback prints it under the message.  Python 3.10 has neither, so there
:func:`add_note` keeps the note in ``__notes__`` too (for code and tools that
read it) and puts it where 3.10's traceback will print it: at the end of the
message.  An exception whose message is not simply its one string argument (a
``KeyError``, an ``OSError``, a class with its own ``__str__``) keeps its
message as it is, and the note is logged instead.
"""

from __future__ import annotations

import logging
import sys

logger: logging.Logger = logging.getLogger(__name__)


def add_note(error: BaseException, note: str) -> None:
    """Add ``note`` to ``error``, as ``error.add_note(note)`` does on Python 3.11+."""
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:
        fold_note(error, note)


def fold_note(error: BaseException, note: str) -> None:
    """Python 3.10's :func:`add_note`: ``__notes__``, and the message or the log."""
    notes = getattr(error, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        setattr(error, "__notes__", notes)  # noqa: B010  (not an attribute of 3.10's BaseException)
    notes.append(note)
    args = error.args
    plain = type(error).__str__ is BaseException.__str__
    if plain and (not args or (len(args) == 1 and isinstance(args[0], str))):
        message = args[0] if args else ""
        error.args = (f"{message}\n{note}" if message else note,)
    else:
        logger.error("%s (%s: %s)", note, type(error).__name__, error)
