"""The docs' own checks that need no Sphinx build: every Python block parses,
the ones that are only imports run, and every relative link points at a file.

The guides' larger examples are docs/examples/*.py, included by the guides and
run by tests/distributed/test_doc_examples.py.  The two that are whole scripts
(the README's quickstart, the Staged guide's) are also launched here as a user
would, under torchrun on 2 gloo ranks, each with a time limit, and must print
what their page shows; the README's code block must be the quickstart file."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys
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


README = ROOT / "README.md"
QUICKSTART = ROOT / "docs" / "examples" / "quickstart.py"

# (page, what follows torchrun's options on the page): each page shows the command
# in a ```sh block and, after it, what it prints in a ```text block.
SCRIPTS = [
    (README, "docs/examples/quickstart.py"),
    (ROOT / "docs" / "guides" / "staged.md", "-m docs.examples.staged"),
]


def test_readme_example_is_the_quickstart_file() -> None:
    assert f"```python\n{QUICKSTART.read_text()}```" in README.read_text(), (
        "README's example must be docs/examples/quickstart.py verbatim: copy the file in"
    )


def _shown_output(page: pathlib.Path, command: str) -> List[str]:
    """The lines of the ```text block that follows ``command``'s ```sh block on ``page``."""
    launch = f"torchrun --standalone --nproc_per_node=2 {command}"
    found = re.search(re.escape(launch) + r"\n```\n.*?```text\n(.*?)```", page.read_text(), re.S)
    assert found is not None, f"{page.name}: no `{launch}` block followed by its output"
    return found.group(1).splitlines()


@pytest.mark.parametrize("page,command", SCRIPTS, ids=[c for _, c in SCRIPTS])
def test_example_script_runs_on_two_ranks_and_prints_what_its_page_shows(
    page: pathlib.Path, command: str
) -> None:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        launch + command.split(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.splitlines() == _shown_output(page, command), done.stdout
