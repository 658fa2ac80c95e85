"""Count the checks of a test tier: ``assert`` statements and ``pytest.raises``
/ ``pytest.warns`` blocks in its test files (by the syntax tree, so comments and
strings do not count).  A change meant to speed a tier up must not lower them:

    python tests/count_checks.py tests/distributed
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Tuple


def count(path: Path) -> Tuple[int, int]:
    """(assert statements, pytest.raises/warns calls) in one file."""
    asserts = raises = 0
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Assert):
            asserts += 1
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("raises", "warns")
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "pytest"
        ):
            raises += 1
    return asserts, raises


def main(folder: str) -> None:
    total_a = total_r = 0
    for path in sorted(Path(folder).glob("*.py")):
        a, r = count(path)
        total_a, total_r = total_a + a, total_r + r
        print(f"{a:5d} {r:4d}  {path}")
    print(f"{total_a:5d} {total_r:4d}  total (assert, pytest.raises/warns)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/distributed")
