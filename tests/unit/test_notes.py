"""add_note: the note reaches the user on every Python we support (3.10 has no
``BaseException.add_note``; there its stand-in, fold_note, runs)."""

from __future__ import annotations

import logging
import sys
import traceback

import pytest

from trec_pipelines.core.notes import add_note, fold_note


def test_add_note_keeps_the_note_where_this_python_shows_it() -> None:
    error = RuntimeError("the step failed")
    add_note(error, "first")
    add_note(error, "second")
    assert error.__notes__ == ["first", "second"]
    shown = "".join(traceback.format_exception_only(type(error), error))
    assert shown.index("the step failed") < shown.index("first") < shown.index("second")
    if sys.version_info >= (3, 11):
        assert str(error) == "the step failed"  # the traceback prints the notes
    else:
        assert str(error) == "the step failed\nfirst\nsecond"


@pytest.mark.parametrize(
    "error, message",
    [
        (RuntimeError("boom"), "boom\nthe note"),
        (ValueError(), "the note"),
        (AssertionError("x == 1"), "x == 1\nthe note"),
    ],
    ids=["RuntimeError", "no message", "AssertionError"],
)
def test_on_python_3_10_the_note_ends_the_message(error: BaseException, message: str) -> None:
    fold_note(error, "the note")
    assert str(error) == message
    assert error.args == (message,)
    assert error.__notes__ == ["the note"]


@pytest.mark.parametrize(
    "error",
    [KeyError("table_0"), OSError(2, "No such file"), RuntimeError("a", 1)],
    ids=["KeyError", "OSError", "two args"],
)
def test_on_python_3_10_a_message_of_its_own_is_kept_and_the_note_logged(
    error: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    args, text = error.args, str(error)
    with caplog.at_level(logging.ERROR, logger="trec_pipelines.core.notes"):
        fold_note(error, "the note")
    assert error.args == args and str(error) == text
    assert error.__notes__ == ["the note"]
    assert [r.getMessage() for r in caplog.records] == [
        f"the note ({type(error).__name__}: {text})"
    ]
