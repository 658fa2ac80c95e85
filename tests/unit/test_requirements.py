"""The install recipe per supported stack: a runtime requirements file (no test tools), torchrec
with --no-deps, and the test requirements that include the runtime ones.

Read from the files themselves, and checked against the stack this test runs on: its runtime
file pins the torch and fbgemm installed here and carries torchrec's own runtime deps (all but
fbgemm-gpu, which the CPU stacks replace with fbgemm-gpu-cpu).
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
# stack: (test requirements, runtime requirements, torchrec requirements)
STACKS: Dict[str, Tuple[str, str, str]] = {
    "pinned": ("requirements-cpu.txt", "requirements-runtime.txt", "requirements-torchrec.txt"),
    "latest": (
        "requirements-latest.txt",
        "requirements-runtime-latest.txt",
        "requirements-torchrec-latest.txt",
    ),
    "oldest": (
        "requirements-oldest.txt",
        "requirements-runtime-oldest.txt",
        "requirements-torchrec-oldest.txt",
    ),
    "gpu": (
        "requirements-gpu.txt",
        "requirements-runtime-gpu.txt",
        "requirements-torchrec-latest.txt",
    ),
}
TOOLS = {"pytest", "pytest-xdist", "matplotlib", "ruff", "mypy", "build", "sphinx", "myst-parser"}


def lines(name: str) -> List[str]:
    text = (ROOT / name).read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def pins(name: str) -> Dict[str, str]:
    """Package name -> its specifier (``==2.13.0``, ``<3``), the -r lines left out."""
    found = {}
    for line in lines(name):
        if line.startswith("-r"):
            continue
        m = re.match(r"([A-Za-z0-9_.-]+)\s*([^;]*)", line)
        assert m, line
        found[m.group(1).lower()] = m.group(2).strip()
    return found


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_a_runtime_file_per_stack_with_no_tools_included_by_its_test_file(stack: str) -> None:
    test_file, runtime, torchrec = STACKS[stack]
    run = pins(runtime)
    assert "torch" in run and ({"fbgemm-gpu", "fbgemm-gpu-cpu"} & set(run)), run
    assert not TOOLS & set(run), f"{runtime} carries test or plotting tools: {TOOLS & set(run)}"
    assert f"-r {runtime}" in lines(test_file)
    assert not set(run) & set(pins(test_file)), "a runtime pin repeated in the test file"
    assert set(pins(torchrec)) == {"torchrec"}
    # make builds each venv when any of its files changes.
    makefile = (ROOT / "Makefile").read_text()
    stamp = next(line for line in makefile.splitlines() if f": {test_file} " in line)
    assert runtime in stamp and torchrec in stamp, stamp
    # The README's install table names both files of the stack.
    readme = (ROOT / "README.md").read_text()
    assert f"`{runtime}` | `{torchrec}`" in readme


def test_the_runtime_file_of_this_stack_is_what_runs_here() -> None:
    installed = metadata.version("torchrec")
    stacks = [
        s
        for s, (_, runtime, torchrec) in STACKS.items()
        if pins(torchrec)["torchrec"] == f"=={installed}" and "fbgemm-gpu-cpu" in pins(runtime)
    ]
    assert len(stacks) == 1, f"no CPU stack pins torchrec {installed}"
    run = pins(STACKS[stacks[0]][1])
    assert run["torch"] == "==" + metadata.version("torch").split("+")[0]
    assert run["fbgemm-gpu-cpu"] == "==" + metadata.version("fbgemm-gpu-cpu")
    # torchrec's own runtime deps, but the CUDA fbgemm-gpu (hence --no-deps).
    wanted = set()
    for req in metadata.requires("torchrec") or []:
        name, _, marker = req.partition(";")
        if "extra ==" in marker:  # an optional extra: iopath for torchrec.datasets since 1.8
            continue
        wanted.add(re.split(r"[<>=!~ ]", name.strip())[0].lower())
    assert wanted - set(run) == {"fbgemm-gpu"}, wanted - set(run)
