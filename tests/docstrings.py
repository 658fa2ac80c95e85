"""Writes the parts of the pipeline classes' docstrings that the tables declare.

``python -m tests.docstrings`` rewrites, in the source of each pipeline class of ours (one
with ``@takes_options``), the end of its docstring: the ``Args:`` section for the torchrec
parameters its constructor takes (:data:`~trec_pipelines.core.api_docs.TORCHREC_PARAMETERS`)
and the list of our keyword-only options it takes
(:data:`~trec_pipelines.assembly.options.DOCS`); and the docstring of its ``progress()``
(:data:`~trec_pipelines.core.api_docs.PROGRESS`, plus
:data:`~trec_pipelines.core.api_docs.EVAL_PROGRESS` for an eval pipeline).  ``--check`` only
lists what is out of date (exit status 1 if anything is).  ``tests/unit/test_api_docs.py``
runs the check, so the source cannot drift from the tables; see [Note: documented once] in
``trec_pipelines/core/api_docs.py``.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import trec_pipelines as tp
from trec_pipelines.assembly.options import DOCS, accepted_options, options_of
from trec_pipelines.core.api_docs import (
    EVAL_PROGRESS,
    PROGRESS,
    TORCHREC_PARAMETERS,
    parameters_of,
)

COMMAND = "python -m tests.docstrings"
ARGS_HEAD = "torchrec's parameters, in torchrec's order:"
OPTIONS_HEAD = "Our keyword-only options (each described in the options guide):"
_WIDTH = 100  # ruff.toml's line length


def pipeline_classes() -> List[type]:
    """The public classes whose options are ours (each with its own ``@takes_options``)."""
    names = tp._PUBLIC_GROUPS["Pipelines"] + tp._PUBLIC_GROUPS["Experimental pipelines"]
    found = [getattr(tp, name) for name in names]
    return [c for c in found if inspect.isclass(c) and "_trec_options_concern" in c.__dict__]


def _wrap(text: str, first: str, rest: str, indent: int) -> List[str]:
    width = _WIDTH - indent
    return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False)  # fmt: skip


def class_tail(cls: type, indent: int = 4) -> str:
    """The end of ``cls``'s docstring (dedented), for source indented by ``indent``."""
    parts = []
    params = parameters_of(cls)
    if params:
        lines = [ARGS_HEAD, "", "Args:"]
        for name in params:
            lines += _wrap(f"{name}: {TORCHREC_PARAMETERS[name]}", " " * 4, " " * 8, indent)
        parts.append("\n".join(lines))
    names = options_of(cls.__dict__["_trec_options_concern"])
    if names:
        lines = [OPTIONS_HEAD, ""]
        for name in names:
            lines += _wrap(f"* ``{name}``: {DOCS[name]}", "", "  ", indent)
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def progress_doc(cls: type) -> Optional[str]:
    """What ``cls``'s own ``progress()`` docstring says (None: it has none of its own to
    write; StagedTrainPipeline's is its own)."""
    if "progress" not in cls.__dict__ or cls is tp.StagedTrainPipeline:
        return None
    eval_pipeline = "uneven_data" in accepted_options(cls)
    return f"{PROGRESS}\n\n{EVAL_PROGRESS}" if eval_pipeline else PROGRESS


def _docstring_lines(node: ast.AST) -> Optional[Tuple[int, int]]:
    """The first and last line (1-based) of the docstring of ``node``, if it has one."""
    body = getattr(node, "body", [])
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            return first.lineno, first.end_lineno or first.lineno
    return None


def _render(doc: str, indent: int) -> List[str]:
    """Docstring ``doc`` (dedented) as source lines indented by ``indent``."""
    pad = " " * indent
    lines = doc.splitlines()
    body = [f"{pad}{line}".rstrip() for line in lines[1:]]
    return [f'{pad}"""{lines[0]}', *body, f'{pad}"""']


def _class_doc(source_doc: str, cls: type) -> str:
    """``source_doc`` (the docstring as written) with its tail replaced by what the tables say."""
    doc = inspect.cleandoc(source_doc)
    for head in (ARGS_HEAD, OPTIONS_HEAD):
        at = doc.find(f"\n{head}\n")
        if at >= 0:
            doc = doc[:at]
    tail = class_tail(cls)
    return f"{doc.rstrip()}\n\n{tail}" if tail else doc


def _find(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def rewrite(path: Path, classes: Sequence[type]) -> str:
    """The text of ``path`` with the docstrings of ``classes`` (defined in it) written."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines))
    edits: List[Tuple[int, int, List[str]]] = []  # (first line, last line, new lines), 0-based
    for cls in classes:
        node = _find(tree, cls.__name__)
        first, last = _docstring_lines(node) or (0, 0)
        assert first, f"{cls.__name__}: write its docstring first"
        written = ast.get_docstring(node, clean=False) or ""
        indent = node.col_offset + 4
        edits.append((first - 1, last - 1, _render(_class_doc(written, cls), indent)))
        wanted = progress_doc(cls)
        method = next(
            (n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "progress"), None
        )
        if wanted is None or method is None:
            continue
        at = _docstring_lines(method)
        new = _render(wanted, method.col_offset + 4)
        if at is not None:
            edits.append((at[0] - 1, at[1] - 1, new))
        else:  # right after the ``def`` line(s): the line ending the signature
            end = method.lineno - 1
            while not lines[end].rstrip().endswith(":"):
                end += 1
            edits.append((end + 1, end, new))
    for first, last, new in sorted(edits, reverse=True):
        lines[first : last + 1] = new
    return "\n".join(lines) + "\n"


def stale() -> Dict[Path, str]:
    """Each source file whose docstrings are not what the tables say -> its text if they were."""
    by_file: Dict[Path, List[type]] = {}
    for cls in pipeline_classes():
        by_file.setdefault(Path(inspect.getfile(cls)), []).append(cls)
    found = {}
    for path, classes in sorted(by_file.items()):
        text = rewrite(path, classes)
        if text != path.read_text():
            found[path] = text
    return found


def main(argv: Sequence[str]) -> int:
    out_of_date = stale()
    for path, text in out_of_date.items():
        print(f"{path}: docstrings out of date" + ("" if "--check" in argv else ": rewritten"))
        if "--check" not in argv:
            path.write_text(text)
    if out_of_date and "--check" in argv:
        print(f"run `{COMMAND}`")
    return int(bool(out_of_date) and "--check" in argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
