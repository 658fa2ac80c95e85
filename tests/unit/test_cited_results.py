"""Every bench results folder the README, the docs or the CHANGELOG quote is in
the repository, with its numbers.

Result folders are ignored by git unless added on purpose, so a folder can be
quoted from a local run and never committed; in a clean clone this test finds
that out.
"""

from __future__ import annotations

import pathlib
import re
from typing import List

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# A results folder's name: <date>_<host>_<name>, as `make bench` writes it.
# A brace list (`...-staged-{before,after}/`) quotes one folder per item.
FOLDER = re.compile(
    r"benchmarks/results/(20\d\d-\d\d-\d\d_[A-Za-z0-9.-]+?_[A-Za-z0-9.-]*)(\{[^}]*\})?"
)


def _pages() -> List[pathlib.Path]:
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")]
    return [p for p in pages if p.exists() and "_build" not in p.parts]


def _cited() -> List[str]:
    names = set()
    for page in _pages():
        for stem, braces in FOLDER.findall(page.read_text()):
            items = braces.strip("{}").split(",") if braces else [""]
            names.update((stem + item).rstrip(".-") for item in items)
    return sorted(names)


CITED = _cited()


def test_the_docs_quote_results_folders() -> None:
    assert len(CITED) >= 3, CITED


@pytest.mark.parametrize("name", CITED)
def test_a_quoted_results_folder_is_committed_with_its_numbers(name: str) -> None:
    folder = RESULTS / name
    assert folder.is_dir(), f"{folder} is quoted but missing: `git add -f` it"
    numbers = [p for pattern in ("table.txt", "*.json") for p in folder.rglob(pattern)]
    assert numbers, f"{folder} has no table.txt nor JSON results"
