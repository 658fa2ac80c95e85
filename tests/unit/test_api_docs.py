"""Every public method and constructor parameter of every exported pipeline class is
described where ``help()`` (pydoc) and ``inspect.getdoc`` look."""

from __future__ import annotations

import inspect
import pydoc
from pathlib import Path
from typing import List, Tuple

import pytest

import trec_pipelines as tp
from tests import docstrings
from trec_pipelines.core import peer_failure
from trec_pipelines.core.api_docs import (
    PROGRESS,
    TORCHREC_PARAMETERS,
    parameters_of,
    undocumented_parameters,
)


def _pipeline_classes() -> List[Tuple[str, type]]:
    names = tp._PUBLIC_GROUPS["Pipelines"] + tp._PUBLIC_GROUPS["Experimental pipelines"]
    found = []
    for name in names:
        obj = getattr(tp, name)
        # TrainPipeline is torchrec's own interface, re-exported; In/Out are TypeVars.
        if inspect.isclass(obj) and obj is not tp.TrainPipeline:
            found.append((name, obj))
    return found


CLASSES = _pipeline_classes()
SHARED = ("progress", "attach", "detach", "reset", "state_dict", "load_state_dict")


def _public_methods(cls: type) -> List[str]:
    names = []
    for name in dir(cls):
        if name.startswith("_"):
            continue
        static = inspect.getattr_static(cls, name)
        if inspect.isfunction(static) or isinstance(static, (property, classmethod, staticmethod)):
            names.append(name)
    return names


def test_the_table_is_the_exported_classes() -> None:
    # Sanity of the table below: the classes checked are the exported ones.
    assert len(CLASSES) == 21
    assert {"TrainPipelineBase", "StagedTrainPipeline", "EvalPipelineCPUSparse"} <= {
        n for n, _ in CLASSES
    }


@pytest.mark.parametrize("name,cls", CLASSES, ids=[n for n, _ in CLASSES])
def test_every_public_method_has_a_description_in_help(name: str, cls: type) -> None:
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    missing = []
    for method in _public_methods(cls):
        static = inspect.getattr_static(cls, method)
        doc = static.__doc__ if isinstance(static, property) else pydoc.getdoc(getattr(cls, method))
        if not (doc or "").strip():
            missing.append(method)
            continue
        # help() shows it: the first line of the description is in the rendered page.
        first = inspect.cleandoc(doc).splitlines()[0].strip()
        if first not in text:
            missing.append(f"{method} (not in help())")
    assert missing == [], f"{name}: {missing}"


@pytest.mark.parametrize("name,cls", CLASSES, ids=[n for n, _ in CLASSES])
def test_the_shared_methods_are_ours_where_a_class_has_them(name: str, cls: type) -> None:
    # torchrec's TrainPipeline documents none of these (reset: a note for subclasses);
    # ours say what they do, in the class that does it.
    for method in SHARED:
        if not hasattr(cls, method):
            continue
        owner = next(k for k in cls.__mro__ if method in k.__dict__)
        if (name, method) == ("StagedTrainPipeline", "reset"):
            continue  # torchrec's no-op reset(), which Staged inherits as torchrec's does
        assert owner.__module__.startswith("trec_pipelines"), (name, method, owner)
        assert inspect.getdoc(getattr(cls, method)), (name, method)


@pytest.mark.parametrize("name,cls", CLASSES, ids=[n for n, _ in CLASSES])
def test_every_constructor_parameter_is_described(name: str, cls: type) -> None:
    assert undocumented_parameters(cls) == {}
    doc = inspect.getdoc(cls) or ""
    rendered = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    words = " ".join(doc.split())
    shown = " ".join(word for word in rendered.split() if word != "|")
    for param in parameters_of(cls):
        if param in TORCHREC_PARAMETERS:
            # Written from the one table (wrapped in the source), in help() too.
            described = f"{param}: {' '.join(TORCHREC_PARAMETERS[param].split())}"
            assert described in words, param
            assert described in shown, param


def test_keyword_options_are_described_as_well() -> None:
    # Our options (WithOptions) stay listed after torchrec's parameters.
    doc = inspect.getdoc(tp.TrainPipelineSparseDist) or ""
    args, options = doc.index("Args:"), doc.index(docstrings.OPTIONS_HEAD)
    assert args < options
    for param in inspect.signature(tp.TrainPipelineSparseDist).parameters.values():
        if param.kind is param.KEYWORD_ONLY:
            assert f"``{param.name}``:" in doc[options:], param.name


def test_progress_says_to_pass_an_iterator_on_every_class() -> None:
    for name, cls in CLASSES:
        if hasattr(cls, "progress") and name != "StagedTrainPipeline":
            assert (inspect.getdoc(cls.progress) or "").startswith(PROGRESS.splitlines()[0]), name


def test_the_table_has_no_description_nobody_uses() -> None:
    used = {p for _, cls in CLASSES for p in parameters_of(cls)}
    assert set(TORCHREC_PARAMETERS) - used == set()


def test_the_docstrings_in_the_source_say_what_the_tables_say() -> None:
    # The Args sections, option lists and progress() docstrings are written in the source by
    # `python -m tests.docstrings`; none is out of date.
    out_of_date = docstrings.stale()
    assert out_of_date == {}, f"run `{docstrings.COMMAND}`: {sorted(map(str, out_of_date))}"
    assert len(docstrings.pipeline_classes()) == 20  # every pipeline class but PipelineStage


@pytest.mark.parametrize("cls", docstrings.pipeline_classes(), ids=lambda c: c.__name__)
def test_each_class_docstring_ends_with_its_args_then_its_options(cls: type) -> None:
    doc = inspect.getdoc(cls) or ""
    assert doc.endswith(docstrings.class_tail(cls))
    assert doc.count(docstrings.ARGS_HEAD) == 1 and doc.count(docstrings.OPTIONS_HEAD) == 1
    own = cls.__dict__.get("progress")
    if docstrings.progress_doc(cls) is not None:
        assert inspect.getdoc(own) == docstrings.progress_doc(cls)


def test_an_out_of_date_docstring_is_written_back(tmp_path: Path) -> None:
    source = Path(inspect.getfile(tp.TrainPipelineBase)).read_text()
    progress = "\n".join(docstrings._render(PROGRESS, 8)) + "\n"
    assert progress in source
    stale = tmp_path / "base.py"
    stale.write_text(
        source.replace(progress, "").replace("        model: The model:", "        model: A model:")
    )
    assert docstrings.rewrite(stale, [tp.TrainPipelineBase]) == source


def test_a_stopping_rank_says_where_the_error_is_and_how_to_set_the_grace() -> None:
    message = peer_failure.stop_message(
        1, {0: "batch 2: TrainPipelineSparseDist.progress() raised Fault: boom"}, 10.4
    )
    assert message == (
        "trec_pipelines: rank 1 stops: rank 0 failed at batch 2: "
        "TrainPipelineSparseDist.progress() raised Fault: boom. rank 0's error is above "
        "in this job's output: this rank is not the root cause, even if torchrun names it "
        "(it names the first rank to exit, which may be this one). This rank has waited "
        "10 s in a step whose collectives the failed rank will not join "
        "(TREC_PIPELINES_PEER_FAILURE_GRACE sets how long, in seconds; 0 turns this off). "
        "Ending the process is the last resort: the wait is in a collective of the "
        "model's process group, which torch cannot interrupt short of that group's "
        "timeout, so no exception can reach this rank's code (a failure seen before a "
        "step's collectives, as a data iterator's error, raises PeerFailedError instead). "
        "Fix the failed rank's error, then restart from the last checkpoint (torchrun "
        "--max-restarts does)."
    )
