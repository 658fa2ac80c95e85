"""One module per pipeline variant.

[Note: a progress() timeline]

Each pipeline's ``progress()`` (and each step helper written the same way) is
a literal timeline of one step: one call per line, in the order the work is
issued, with a comment on the right naming the batch it touches and the
stream it runs on (``cur, data_dist -> default``).  Those comments are aligned
in columns so the stages can be read down the page, which is why the body sits
between ``# fmt: off`` and ``# fmt: on``: the formatter would otherwise fold
the columns away.  Keep a new ``progress()`` in the same shape rather than
hiding its steps in helpers.
"""
