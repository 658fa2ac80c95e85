"""What ``help()`` (pydoc) and the API reference say of the pipeline classes.

Each class's docstring says what its schedule does, the parameters no other class
takes and what differs from torchrec's class, in at most 60 lines; what the classes
share (torchrec's parameters that several take, our keyword-only options, what every
``progress()`` does) is described once, in ``trec_pipelines.PipelineOptions``, which
every class links to (see [Note: documented once] in ``trec_pipelines/core/api_docs.py``).
"""

from __future__ import annotations

import dataclasses
import inspect
import pydoc
import re
from typing import Dict, List, Tuple

import pytest

import trec_pipelines as tp
from trec_pipelines.assembly.options import DEFAULTS, DOCS, accepted_options
from trec_pipelines.core import peer_failure
from trec_pipelines.core.api_docs import (
    EVAL_PROGRESS,
    PROGRESS,
    PROGRESS_LINK,
    TORCHREC_PARAMETERS,
    own_parameters,
    parameters_of,
    shared_doc,
)

LINK = ":class:`~trec_pipelines.PipelineOptions`"
MAX_LINES = 60


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


def _words(text: str) -> str:
    return " ".join(text.split())


def _args(cls: type) -> Dict[str, str]:
    """The entries of the ``Args:`` section of ``cls``'s docstring (a dataclass's
    ``Attributes:``): name -> its text."""
    doc = inspect.getdoc(cls) or ""
    head = "\nAttributes:\n" if dataclasses.is_dataclass(cls) else "\nArgs:\n"
    if head not in doc:
        return {}
    section = doc.split(head, 1)[1].split("\n\n", 1)[0]
    entries = re.split(r"^    (\w+): ", section, flags=re.M)[1:]
    return {n: _words(t) for n, t in zip(entries[::2], entries[1::2], strict=True)}


def _own_keywords(cls: type) -> List[str]:
    """Keyword-only parameters of ``cls`` that are not our shared options (its own)."""
    return [
        p.name
        for p in inspect.signature(cls).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.name not in DEFAULTS
    ]


@pytest.mark.parametrize("name,cls", CLASSES, ids=[n for n, _ in CLASSES])
def test_every_parameter_is_described_in_one_place(name: str, cls: type) -> None:
    # A parameter other classes take too: in the shared table, not again in the class;
    # its own (torchrec's, or keyword-only and not one of our shared options): in its Args.
    args = _args(cls)
    own = own_parameters(cls) + _own_keywords(cls)
    assert sorted(args) == sorted(own), name
    for param in parameters_of(cls):
        assert (param in TORCHREC_PARAMETERS) != (param in args), (name, param)


def test_the_shared_table_holds_what_several_classes_take() -> None:
    takers: Dict[str, List[str]] = {}
    for name, cls in CLASSES:
        for param in parameters_of(cls):
            takers.setdefault(param, []).append(name)
    for param in TORCHREC_PARAMETERS:
        assert len(takers.get(param, [])) >= 2, (param, takers.get(param))
    shared = {p for p, names in takers.items() if len(names) >= 2}
    assert shared <= set(TORCHREC_PARAMETERS), shared - set(TORCHREC_PARAMETERS)


def test_pipeline_options_describes_every_shared_thing_once() -> None:
    doc = tp.PipelineOptions.__doc__ or ""
    assert doc == shared_doc(DOCS, DEFAULTS)
    words = _words(doc)
    for param, text in TORCHREC_PARAMETERS.items():
        assert words.count(f"``{param}`` {_words(text)}") == 1, param
    for option, default in DEFAULTS.items():
        assert words.count(f"``{option}={default!r}`` {DOCS[option]}") == 1, option
        assert len(re.findall(rf"^``{option}=", doc, flags=re.M)) == 1, option
    assert _words(PROGRESS) in words and _words(EVAL_PROGRESS) in words
    # help() shows it, as the API reference does.
    shown = _words(pydoc.render_doc(tp.PipelineOptions, renderer=pydoc.plaintext).replace("|", ""))
    assert _words(PROGRESS) in shown and "``validate_batches=True``" in shown


@pytest.mark.parametrize("name,cls", CLASSES, ids=[n for n, _ in CLASSES])
def test_each_class_links_to_what_they_share_and_says_it_no_more(name: str, cls: type) -> None:
    doc = inspect.getdoc(cls) or ""
    shares = accepted_options(cls) or set(parameters_of(cls)) & set(TORCHREC_PARAMETERS)
    assert (LINK in doc) == bool(shares), name  # PipelineStage, a dataclass, shares nothing
    words = _words(doc)
    for text in [*TORCHREC_PARAMETERS.values(), *DOCS.values(), PROGRESS, EVAL_PROGRESS]:
        # No sentence of the shared descriptions is copied into a class.
        for sentence in re.split(r"(?<=[.;])\s", _words(text)):
            if len(sentence.split()) >= 8:
                assert sentence not in words, (name, sentence)


@pytest.mark.parametrize("name,cls", CLASSES, ids=[n for n, _ in CLASSES])
def test_each_progress_says_what_it_does_and_links_to_the_contract(name: str, cls: type) -> None:
    own = cls.__dict__.get("progress")
    if own is None or cls is tp.StagedTrainPipeline:  # Staged's progress() is its own
        return
    doc = inspect.getdoc(own) or ""
    assert doc.startswith(PROGRESS.splitlines()[0]), name
    assert PROGRESS_LINK in doc, name


@pytest.mark.parametrize("name,cls", CLASSES, ids=[n for n, _ in CLASSES])
def test_help_shows_every_parameter_and_option_in_the_signature(name: str, cls: type) -> None:
    signature = inspect.signature(cls)
    params = signature.parameters
    assert set(accepted_options(cls)) <= set(params), name
    for option in accepted_options(cls):
        assert params[option].kind is params[option].KEYWORD_ONLY, (name, option)
        assert params[option].default == DEFAULTS[option], (name, option)
    rendered = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    shown = next(line for line in rendered.splitlines() if f"{name}(" in line and "|" in line)
    for param in params.values():
        assert re.search(rf"[(, ]\*?\*?{param.name}\b", shown), (name, param.name)


@pytest.mark.parametrize("name,cls", CLASSES, ids=[n for n, _ in CLASSES])
def test_no_class_docstring_runs_over_60_lines(name: str, cls: type) -> None:
    lines = (inspect.getdoc(cls) or "").splitlines()
    assert len(lines) <= MAX_LINES, f"{name}: {len(lines)} lines"


def test_the_checks_read_args_and_find_a_copy() -> None:
    """Guards the readers above on a docstring made for it."""

    class Fake:
        """Summary.

        Args:
            alpha: One,
                two.
            beta: Three.

        Tail.
        """

    assert _args(Fake) == {"alpha": "One, two.", "beta": "Three."}
    copied = _words(DOCS["validate_batches"])
    assert copied in _words(f"A class saying {copied} again")


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
