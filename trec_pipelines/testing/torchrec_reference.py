"""What the installed torchrec's reference classes take, for tests that compare with them.

The oldest supported torchrec (1.7.0) lacks some keywords later releases added
(``EvalPipelineFusedSparseDist``'s ``enable_embedding_lookup_prefetch`` came in
1.8.0).  A test passes such a keyword to torchrec's class only when that class
takes it, and otherwise compares ours with its other reference (a plain loop,
an eval loop or a written-out schedule).  Deciding from the signature rather
than from a version number keeps the check true for whatever torchrec is installed.
"""

from __future__ import annotations

import inspect
from typing import Any


def takes(cls: Any, name: str) -> bool:
    """True when ``cls(...)`` names ``name`` among its parameters (``**kwargs`` alone does not count)."""
    return name in inspect.signature(cls).parameters
