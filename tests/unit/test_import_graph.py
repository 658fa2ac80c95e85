"""No import circle inside the trec_pipelines package, and its folders are floors (see FLOORS below).

The graph is read from the source with :mod:`ast`, without importing
anything: one node per module of the package, one edge per package-internal
import, wherever it is written -- at module level, under ``if TYPE_CHECKING:``
and inside functions alike.  A lazy or type-only import hides a circle from
the interpreter, not from a reader: both modules still need each other, and
the fix is to move what both need into a module of its own.

How an import names its target:

* ``import trec_pipelines.a.b`` and ``from trec_pipelines.a.b import x``
  point at ``trec_pipelines.a.b``; when ``x`` is itself a submodule
  (``from trec_pipelines import streams``) the edge goes to
  ``trec_pipelines.core.streams`` instead, as that is what is used;
* relative imports (``from .a import x``, ``from .. import b``) are resolved
  against the importing module's package first;
* importing ``a.b`` is an edge to ``a.b`` only, not to the packages above it
  (Python runs their ``__init__`` first, but that is loading, not use).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

import pytest

PACKAGE = "trec_pipelines"
# The source next to these tests (not whichever copy an installed package points at).
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def module_name(path: Path, root: Path = ROOT, package: str = PACKAGE) -> str:
    """The dotted name of the module at ``path`` (a package's ``__init__.py`` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def package_modules(root: Path = ROOT, package: str = PACKAGE) -> Dict[str, Path]:
    """Every module of the package: dotted name -> source file."""
    return {module_name(path, root, package): path for path in sorted(root.rglob("*.py"))}


def _resolve_relative(importer: str, is_package: bool, level: int, module: Optional[str]) -> str:
    """The absolute name that ``from <level dots><module> import ...`` in ``importer`` names."""
    parts = importer.split(".")
    # The package the import is relative to: the module itself for an __init__.py.
    base = parts if is_package else parts[:-1]
    if level - 1 > 0:
        base = base[: -(level - 1)]
    return ".".join(base + ([module] if module else []))


def internal_imports(
    importer: str, path: Path, modules: Set[str], package: str = PACKAGE
) -> Set[str]:
    """The package modules ``importer`` (source at ``path``) imports, anywhere in its body."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    targets: Set[str] = set()

    def add(name: str) -> None:
        # The longest package module that ``name`` is or lies inside of.
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            targets.add(name)

    for node in ast.walk(tree):  # every node: module level, TYPE_CHECKING blocks, function bodies
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package or alias.name.startswith(package + "."):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                source = _resolve_relative(importer, is_package, node.level, node.module)
            else:
                source = node.module or ""
            if source != package and not source.startswith(package + "."):
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in modules else source)
    targets.discard(importer)
    return targets


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> Dict[str, Set[str]]:
    """Module -> the package modules it imports."""
    modules = package_modules(root, package)
    names = set(modules)
    return {name: internal_imports(name, path, names, package) for name, path in modules.items()}


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """A cycle of ``graph`` as ``[a, b, ..., a]``, or None when it has none.

    Depth-first search; a node met again while still on the current path
    closes a cycle.  Nodes and edges are visited in sorted order, so the
    cycle reported is the same on every run.
    """
    done: Set[str] = set()
    path: List[str] = []
    on_path: Set[str] = set()

    def visit(node: str) -> Optional[List[str]]:
        path.append(node)
        on_path.add(node)
        for target in sorted(graph.get(node, ())):
            if target in on_path:
                return path[path.index(target) :] + [target]
            if target not in done:
                cycle = visit(target)
                if cycle is not None:
                    return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle is not None:
                return cycle
    return None


def test_package_has_no_import_cycle() -> None:
    graph = import_graph()
    # The walk must see the package (guards against a wrong ROOT finding nothing).
    assert f"{PACKAGE}.observe.recorder" in graph and f"{PACKAGE}.testing.stream_checker" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in the package: " + " -> ".join(cycle or [])


def test_find_cycle_reports_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"x"}}) == ["x", "x"]


def test_find_cycle_accepts_a_dag() -> None:
    # A diamond: two paths to one node are not a cycle.
    assert find_cycle({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) is None
    assert find_cycle({}) is None


def test_imports_are_found_everywhere_and_resolved(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("from pkg.a import A\n")
    (root / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.b import B\n"
        "def f():\n"
        "    from pkg import c\n"
        "    import pkg.sub.d\n"
    )
    (root / "b.py").write_text("from . import a\nfrom .sub import d\n")
    (root / "c.py").write_text("import os\n")
    (root / "sub" / "__init__.py").write_text("from .d import D\nfrom .. import c\n")
    (root / "sub" / "d.py").write_text("from ..c import C\nfrom pkg import A\n")
    graph = import_graph(root, "pkg")
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b", "pkg.c", "pkg.sub.d"},
        "pkg.b": {"pkg.a", "pkg.sub.d"},
        "pkg.c": set(),
        "pkg.sub": {"pkg.sub.d", "pkg.c"},
        "pkg.sub.d": {"pkg.c", "pkg"},
    }
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


# benchmarks/
#
# The benchmark's own rules, read from its source with ast (imports inside
# functions included): it imports nothing from tests/ (what both need lives in
# trec_pipelines.testing), and its modules, as well as its subfolders taken
# whole, never need each other both ways.

BENCH_ROOT = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench_modules() -> Dict[str, Path]:
    """Every module of benchmarks/: dotted name -> source file (results/ holds no code)."""
    found: Dict[str, Path] = {}
    for path in sorted(BENCH_ROOT.rglob("*.py")):
        parts = list(path.relative_to(BENCH_ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _bench_imported_names(importer: str, path: Path) -> Set[str]:
    """Every absolute module name ``importer`` imports, anywhere in its body."""
    names: Set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = importer.split(".") if is_package else importer.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _bench_graph() -> Dict[str, Set[str]]:
    """benchmarks/ module -> the benchmarks/ modules it imports."""
    modules = _bench_modules()
    return {
        name: {target for target in _bench_imported_names(name, path) if target in modules} - {name}
        for name, path in modules.items()
    }


def _bench_part(module: str) -> str:
    """The top-level part of benchmarks/ a module belongs to: its subfolder, or itself."""
    return ".".join(module.split(".")[:2])


def test_bench_modules_are_found() -> None:
    modules = _bench_modules()
    assert "benchmarks.__main__" in modules
    assert len(modules) > 10


def test_no_bench_module_imports_tests() -> None:
    offenders = sorted(
        f"{name} imports {target}"
        for name, path in _bench_modules().items()
        for target in _bench_imported_names(name, path)
        if target == "tests" or target.startswith("tests.")
    )
    assert offenders == [], "move what both need to trec_pipelines.testing: " + "; ".join(offenders)


def test_no_two_bench_parts_import_each_other() -> None:
    parts: Dict[str, Set[str]] = {}
    for name, targets in _bench_graph().items():
        parts.setdefault(_bench_part(name), set()).update(_bench_part(t) for t in targets)
    both_ways = sorted(
        f"{a} <-> {b}"
        for a, seen in parts.items()
        for b in seen
        if a < b and a in parts.get(b, set())
    )
    assert both_ways == [], "; ".join(both_ways)


# The benchmark's floors, bottom up: each part imports only parts on lower floors.
BENCH_FLOORS: List[Tuple[str, Tuple[str, ...]]] = [
    # What a run is set up with: flags and presets, the model's shapes, the shaped link.
    ("settings", ("settings",)),
    # What is raced: our pipelines, torchrec's and the plain loops.
    ("contenders", ("contenders",)),
    # The probes: memory, link bytes, the schedule bound, the agreement's cost.
    ("measuring", ("measuring",)),
    # The text reports, pure functions of the raw measurements.
    ("tables", ("tables",)),
    # Every picture and the replot command, drawn from stored JSON.
    ("figures", ("figures",)),
    # A run from end to end and the sweep over many runs.
    ("running", ("running",)),
    # The entry points: python -m benchmarks, and the advisor's --build target.
    ("entry points", ("__main__", "advise_build")),
]


def _bench_floor_of(module: str) -> int:
    """The floor of a benchmarks/ module (the package ``benchmarks`` itself: -1, below all)."""
    part = module.split(".")[1] if "." in module else ""
    for level, (_, members) in enumerate(BENCH_FLOORS):
        if part in members:
            return level
    return -1


def test_every_bench_part_has_a_floor() -> None:
    unplaced = sorted(
        name for name in _bench_modules() if name != "benchmarks" and _bench_floor_of(name) < 0
    )
    assert unplaced == [], "add these to BENCH_FLOORS: " + ", ".join(unplaced)


def test_bench_parts_import_only_lower_floors() -> None:
    offenders = sorted(
        f"{name} imports {target}"
        for name, targets in _bench_graph().items()
        for target in targets
        if target != "benchmarks"
        and _bench_part(target) != _bench_part(name)
        and _bench_floor_of(target) >= _bench_floor_of(name)
    )
    assert offenders == [], (
        "a part of benchmarks/ imports one on its own floor or above (see BENCH_FLOORS); "
        "move what both need down: " + "; ".join(offenders)
    )


def test_bench_floor_rule_sees_an_upward_import() -> None:
    # figures importing the runner is the kind of edge the rule refuses.
    assert _bench_floor_of("benchmarks.figures.replot") < _bench_floor_of(
        "benchmarks.running.runner"
    )
    assert _bench_floor_of("benchmarks.settings.config") == 0


def _bench_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import cycle of ``graph`` as a list of modules (first repeated last), or []."""
    state: Dict[str, int] = {}  # 1 on the current path, 2 done
    path: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, set())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return []


def test_bench_cycle_finder_sees_a_cycle() -> None:
    assert _bench_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _bench_cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_benchmarks() -> None:
    # Package __init__ edges are loading, not use: the cycle is between modules.
    graph = {
        name: {t for t in targets if t != "benchmarks"} for name, targets in _bench_graph().items()
    }
    cycle = _bench_cycle(graph)
    assert cycle == [], "import cycle: " + " -> ".join(cycle)


# Folders are floors ---------------------------------------------------------
#
# Each folder of the package (and each module lying directly in it) stands on a
# floor and imports only folders on lower floors: never one on its own floor or
# above, so no two folders import each other.  The graph is the one above, so
# every import counts, TYPE_CHECKING-only and function-level ones included.

# The floors, bottom up: (name, what stands on it).
FLOORS: List[Tuple[str, Tuple[str, ...]]] = [
    # The ground: streams and batch copies, errors, state, checks, the model's calls,
    # the step guard, the input-dist groups, the subclass hooks; shared types.
    ("ground", ("core", "_types.py", "_version.py")),
    # The parts that stand on the ground alone: the model rewrite and the recorder.
    ("model rewrite and observation", ("model", "observe")),
    # The data path: batch source, validation and the batch walker, the ranks'
    # agreement, the loader thread.
    ("data", ("data",)),
    # The pipelined forwards, the take-over and the sparse ops they run (input dist, lookups).
    ("sparse", ("sparse",)),
    # What every pipeline stands on: options, the pipelined model, the pipeline core, resume.
    ("assembly", ("assembly",)),
    # The pipelines, one module each.
    ("pipelines", ("pipelines",)),
    # The public module listing torchrec's experimental pipelines.
    ("experimental list", ("experimental_pipelines.py",)),
    # The tools that use the pipelines: the advisor and the testing helpers; and the
    # restart helper (a process group per torchrun attempt), which needs none of them.
    ("tools", ("advise", "testing", "elastic.py")),
    # The public surface: the package's __init__.
    ("public surface", ("__init__.py",)),
]


def floor_of_unit() -> Dict[str, int]:
    """Folder (or top-level file name) -> its floor's index in FLOORS."""
    return {unit: level for level, (_, units) in enumerate(FLOORS) for unit in units}


def unit_of(path: Path, root: Path = ROOT) -> str:
    """The folder a module lies in, or its file name when it lies directly in the package."""
    return path.relative_to(root).parts[0]


def cross_unit_imports() -> List[Tuple[str, str, str, str]]:
    """(importing unit, imported unit, importing file, imported module), sorted."""
    modules = package_modules()
    edges = []
    for importer, targets in import_graph().items():
        source = unit_of(modules[importer])
        for target in targets:
            unit = unit_of(modules[target])
            if unit != source:
                file = str(modules[importer].relative_to(ROOT.parent))
                edges.append((source, unit, file, target))
    return sorted(edges)


def test_every_folder_stands_on_one_floor() -> None:
    floor = floor_of_unit()
    assert len(floor) == sum(len(units) for _, units in FLOORS), "a unit is on two floors"
    units = {unit_of(path) for path in package_modules().values()}
    missing = sorted(units - set(floor))
    assert not missing, f"add these to FLOORS in {__file__}: {missing}"


def test_no_folder_imports_its_own_floor_or_above() -> None:
    floor = floor_of_unit()
    wrong = [
        f"{file} imports {module}: {FLOORS[floor[source]][0]!r} floor may not import"
        f" {target}/ ({FLOORS[floor[target]][0]!r} floor)"
        for source, target, file, module in cross_unit_imports()
        if floor[target] >= floor[source]
    ]
    assert not wrong, "imports that go sideways or up a floor:\n" + "\n".join(wrong)


def test_no_two_folders_import_each_other() -> None:
    first: Dict[Tuple[str, str], str] = {}
    for source, target, file, module in cross_unit_imports():
        first.setdefault((source, target), f"{file} imports {module}")
    both = [
        f"{first[(a, b)]}\n  and {first[(b, a)]}" for a, b in first if a < b and (b, a) in first
    ]
    assert not both, "folders that import each other:\n" + "\n".join(both)


def test_the_floor_checks_name_what_goes_up(monkeypatch: Any) -> None:
    # A ground module importing the assembly is reported, with its file and import.
    graph = import_graph()
    graph[f"{PACKAGE}.core.streams"] = graph[f"{PACKAGE}.core.streams"] | {
        f"{PACKAGE}.assembly.options"
    }
    monkeypatch.setitem(globals(), "import_graph", lambda: graph)
    with pytest.raises(AssertionError, match=r"trec_pipelines/core/streams\.py imports"):
        test_no_folder_imports_its_own_floor_or_above()
    with pytest.raises(AssertionError, match=r"assembly/.*core/streams\.py imports"):
        test_no_two_folders_import_each_other()
