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


LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# fbgemm-gpu 1.7.0's compatibility-table warning, six lines each time it is logged.
FBGEMM_COMPAT = "_fbgemm_torch_compat_table has no entry for"


@pytest.mark.parametrize("page,command", SCRIPTS, ids=[c for _, c in SCRIPTS])
def test_example_script_runs_on_two_ranks_and_prints_what_its_page_shows(
    page: pathlib.Path, command: str
) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if (
        page == README
    ):  # launched as the README shows it: torchrun sets OMP_NUM_THREADS, and says so
        env.pop("OMP_NUM_THREADS")
    done = subprocess.run(
        LAUNCH + command.split(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.splitlines() == _shown_output(page, command), done.stdout
    if page == README:
        # "about twenty lines of warnings", and on torchrec 1.7.0 168 more: fbgemm's
        # compatibility-table warning, 6 lines for each of 14 libraries on each of 2 ranks.
        import fbgemm_gpu

        lines = done.stderr.splitlines()
        fbgemm = 6 * sum(FBGEMM_COMPAT in line for line in lines)
        assert fbgemm == (168 if fbgemm_gpu.__version__.startswith("1.7.") else 0), done.stderr
        assert len(lines) - fbgemm <= 20, done.stderr


def _silencing_recipe() -> str:
    """The migration guide's code that silences the warnings of a run."""
    guide = (ROOT / "docs" / "guides" / "migrating.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    (recipe,) = [b for b in blocks if "_fbgemm_torch_compat_table" in b]
    return recipe


def test_the_silencing_recipe_drops_fbgemms_compatibility_warning_as_fbgemm_logs_it() -> None:
    # fbgemm_gpu's own check (its _load_library) on a version its table lacks logs the
    # warning on every stack; the recipe, run first, drops it.  Then torchrec is imported,
    # which on torchrec 1.7.0 logs it 14 times without the recipe.
    emit = (
        "import torchrec, fbgemm_gpu\n"
        "fbgemm_gpu._load_library('no_such_library.so', '0.0.1', no_throw=True)\n"
    )
    for recipe, expected in (("", True), (_silencing_recipe(), False)):
        done = subprocess.run(
            [sys.executable, "-c", recipe + emit], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert (FBGEMM_COMPAT + " 0.0.1" in done.stderr) is expected, done.stderr
        if recipe:
            assert FBGEMM_COMPAT not in done.stderr, done.stderr


def test_the_quickstart_under_the_silencing_recipe_prints_no_warning(
    tmp_path: pathlib.Path,
) -> None:
    # The recipe above the quickstart's imports, OMP_NUM_THREADS set: nothing on stderr.
    script = tmp_path / "quiet_quickstart.py"
    script.write_text(
        _silencing_recipe() + f"\nimport runpy\n\nrunpy.run_path({str(QUICKSTART)!r}, "
        "run_name='__main__')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        LAUNCH + [str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.splitlines() == _shown_output(README, "docs/examples/quickstart.py")
    assert done.stderr.splitlines() == [], done.stderr
