"""The docs' own checks that need no Sphinx build: every Python block parses,
the ones that are only imports run, and every relative link points at a file.

The guides' larger examples are docs/examples/*.py, included by the guides and
run by tests/distributed/test_doc_examples.py."""

from __future__ import annotations

import ast
import pathlib
import re
from typing import List, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
PAGES = [p for p in PAGES if "_build" not in p.parts]


def _python_blocks() -> List[Tuple[str, str]]:
    blocks = []
    for page in PAGES:
        for n, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S)):
            blocks.append((f"{page.relative_to(ROOT)}#{n}", code))
    return blocks


BLOCKS = _python_blocks()


def test_the_pages_have_python_blocks() -> None:
    assert len(BLOCKS) >= 3 and len(PAGES) >= 10


@pytest.mark.parametrize("where,code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_python_block_parses_and_import_only_blocks_run(where: str, code: str) -> None:
    tree = ast.parse(code, filename=where)
    if all(isinstance(node, (ast.Import, ast.ImportFrom)) for node in tree.body):
        exec(compile(tree, where, "exec"), {})


def test_relative_links_and_includes_point_at_files() -> None:
    missing, checked = [], 0
    for page in PAGES:
        text = page.read_text()
        targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
        targets += re.findall(r"```\{literalinclude\} (\S+)", text)
        for target in targets:
            if re.match(r"[a-z]+://", target):
                continue
            checked += 1
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing, missing
    assert checked > 20  # the README's and the guides' links, the images, the includes
