"""The public surface: ``trec_pipelines.__all__``, its groups, and the API page.

``trec_pipelines._PUBLIC_GROUPS`` (role -> names) is the one list: ``__all__``
is built from it, ``dir(trec_pipelines)`` shows it, and docs/api.md has one
section per group, in order, documenting exactly its names in order (the last
section documents ``trec_pipelines.testing.__all__``).  The Sphinx build checks
that every public name is documented somewhere; this checks where.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import subprocess
import sys
import types
from typing import List, Tuple

from torchrec.distributed.train_pipeline import TrainPipeline

import trec_pipelines
import trec_pipelines.experimental_pipelines
import trec_pipelines.testing

ROOT = pathlib.Path(__file__).resolve().parents[2]
API_PAGE = ROOT / "docs" / "api.md"
TESTING_SECTION = "Testing the stream protocol"
# The last section: the helpers a contributor's tests use, each from its own module.
HELPERS_SECTION = "Testing helpers"
HELPER_MODULES = ("dlrm", "references", "plans", "devices")
DIRECTIVE = re.compile(
    r"^\.\. (?:auto)?(?:class|function|exception|data|attribute)::\s+(\S+)", re.M
)


def page_sections(text: str) -> List[Tuple[str, List[str]]]:
    """An API page as ``(heading, names its directives document)``, in order;
    the text before the first ``##`` heading is the section ``""``."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    # parts: [before the first heading, heading 1, its text, heading 2, its text, ...]
    sections = [("", DIRECTIVE.findall(parts[0]))]
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        sections.append((heading.strip(), DIRECTIVE.findall(body)))
    return sections


def test_all_is_version_then_every_group_once() -> None:
    grouped = [name for names in trec_pipelines._PUBLIC_GROUPS.values() for name in names]
    assert trec_pipelines.__all__ == ["__version__", *grouped]
    repeated = sorted({name for name in grouped if grouped.count(name) > 1})
    assert repeated == [], f"in more than one group: {repeated}"


def test_every_public_name_resolves() -> None:
    for module in (trec_pipelines, trec_pipelines.testing, trec_pipelines.experimental_pipelines):
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert missing == [], f"{module.__name__}.__all__ names what it lacks: {missing}"


def test_experimental_group_is_the_experimental_module() -> None:
    group = trec_pipelines._PUBLIC_GROUPS["Experimental pipelines"]
    assert list(group) == trec_pipelines.experimental_pipelines.__all__
    for name in group:
        assert getattr(trec_pipelines, name) is getattr(trec_pipelines.experimental_pipelines, name)


def test_every_pipeline_class_is_in_a_pipelines_group() -> None:
    pipelines = set(trec_pipelines._PUBLIC_GROUPS["Pipelines"])
    pipelines |= set(trec_pipelines._PUBLIC_GROUPS["Experimental pipelines"])
    elsewhere = [
        name
        for name in trec_pipelines.__all__
        if inspect.isclass(obj := getattr(trec_pipelines, name))
        and issubclass(obj, TrainPipeline)
        and name not in pipelines
    ]
    assert elsewhere == [], f"pipeline classes outside the pipeline groups: {elsewhere}"


def test_dir_shows_the_public_names_and_no_module() -> None:
    assert dir(trec_pipelines) == sorted(trec_pipelines.__all__)
    assert dir(trec_pipelines.testing) == sorted(trec_pipelines.testing.__all__)
    # The subpackages are imported (and bound as attributes) by now, yet unlisted.
    assert isinstance(trec_pipelines.core, types.ModuleType)
    modules = [n for n in dir(trec_pipelines) if inspect.ismodule(getattr(trec_pipelines, n))]
    assert modules == []
    # ``advise`` is the function; the subpackage of that name runs as ``python -m``.
    assert inspect.isfunction(trec_pipelines.advise)


def test_star_import_gives_all() -> None:
    namespace: dict = {}
    exec("from trec_pipelines import *", namespace)
    assert sorted(n for n in namespace if n != "__builtins__") == sorted(trec_pipelines.__all__)


def test_import_paths_users_and_docs_use_still_work() -> None:
    """The torchrec-mirroring module, the testing module, the restart helper's
    module, the advisor's command-line module and the implementation modules the
    guides name."""
    for module, name in [
        ("trec_pipelines.experimental_pipelines", "TrainPipelineSparseDistT"),
        ("trec_pipelines.testing", "StreamRecorder"),
        ("trec_pipelines.elastic", "attempt_store"),
        ("trec_pipelines.advise.cli", "main"),
        ("trec_pipelines.observe.ledger", "LedgerSummary"),
        ("trec_pipelines.observe.memory", "footprint"),
        ("trec_pipelines.core.input_dist_group", "release_input_dist_groups"),
        ("trec_pipelines.model.backward_hooks", "InjectionSite"),
        ("trec_pipelines.pipelines.sparse_dist", "TrainPipelineSparseDist"),
    ]:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"
    # Importing the package alone binds no testing module (it is imported on demand).
    code = "import sys, trec_pipelines; print('trec_pipelines.testing' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_api_page_has_one_section_per_group_in_order() -> None:
    sections = page_sections(API_PAGE.read_text())
    expected = [("", ["__version__"])]
    expected += [(role, list(names)) for role, names in trec_pipelines._PUBLIC_GROUPS.items()]
    expected += [(TESTING_SECTION, list(trec_pipelines.testing.__all__))]
    helpers = sections.pop()
    assert helpers[0] == HELPERS_SECTION
    assert [heading for heading, _ in sections] == [heading for heading, _ in expected]
    for (heading, documented), (_, names) in zip(sections, expected, strict=True):
        assert documented == names, (
            f"docs/api.md section {heading or '(intro)'!r} documents {documented}; "
            f"its group in trec_pipelines/__init__.py is {names}"
        )


def test_the_page_reader_sees_what_a_page_documents() -> None:
    """Guards the reader: directives of every kind used, in order."""
    text = (
        "intro\n.. data:: __version__\n## A\n.. autoclass:: X\n   :members:\n"
        ".. autofunction:: f\n## B\n.. autoexception:: E\n.. data:: T\n"
    )
    assert page_sections(text) == [("", ["__version__"]), ("A", ["X", "f"]), ("B", ["E", "T"])]


def test_the_helpers_section_documents_names_of_the_helper_modules() -> None:
    """Each name the last section documents is a function or class of one of the testing
    helper modules, and each of those modules has its part."""
    text = API_PAGE.read_text().split(f"## {HELPERS_SECTION}\n", 1)[1]
    parts = re.split(r"^\.\. py:module:: trec_pipelines\.testing\.(\w+)$", text, flags=re.M)
    modules = parts[1::2]
    assert modules == list(HELPER_MODULES)
    for module, body in zip(modules, parts[2::2], strict=True):
        loaded = importlib.import_module(f"trec_pipelines.testing.{module}")
        names = DIRECTIVE.findall(body)
        assert names, module
        for name in names:
            obj = getattr(loaded, name, None)
            assert inspect.isfunction(obj) or inspect.isclass(obj), f"{module}.{name}"
