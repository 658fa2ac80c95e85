"""Each public pipeline class is what torchrec's same-named class is to code written
against it: an instance of every class torchrec's derives from (by name), with
torchrec's public methods plus the documented ones of ours, no more and no fewer.

The classes are compared by name with the installed torchrec's class of the
same name; where the installed torchrec lacks it, with the torchrec class its
nearest base of ours stands for.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Dict, FrozenSet, List, Set, Tuple

import pytest
import torchrec.distributed.train_pipeline as tp

import trec_pipelines
import trec_pipelines.experimental_pipelines as experimental

# The public methods every pipeline of ours has besides torchrec's, each
# documented in docs/api.md: checkpoint and resume, recording, and retrying.
OURS: FrozenSet[str] = frozenset(
    {
        "state_dict",
        "load_state_dict",
        "enable_schedule_recording",
        "disable_schedule_recording",
        "schedule",
        "print_schedule",
        "export_trace",
        "save_timeline",
        "memory_ledger",
        "print_memory",
        "exposed_time",
        "skip_failed_batch",
    }
)
# A variant's own documented methods besides: the stash variants' plan.
VARIANT_OWN: Dict[str, FrozenSet[str]] = {
    "TrainPipelineSparseDistEmbStash": frozenset({"stash_plan"}),
    "TrainPipelineSparseDistOptStash": frozenset({"stash_plan"}),
    "TrainPipelinePrefetchEMS": frozenset({"stash_plan"}),
}
# torchrec classes of the newer release that ours mirrors on the older one (the
# asynchronous in-place copy's mixin, new in torchrec 1.9): a pipeline is
# registered as the mixin's virtual subclass, so isinstance holds.
STAND_INS: FrozenSet[str] = frozenset({"AsyncInplaceCopyMixin"})
# torchrec bases a class of ours does not derive from (pre-existing; the
# migration guide's "Subclassing" lists what of them it keeps): torchrec's PT2
# derives from its TrainPipelineBase, ours from the core alone.
NOT_DERIVED: Dict[str, FrozenSet[str]] = {"TrainPipelinePT2": frozenset({"TrainPipelineBase"})}


def _torchrec_modules() -> List[object]:
    modules: List[object] = [tp]
    for name in (
        "torchrec.distributed.train_pipeline.train_pipelines",
        "torchrec.distributed.train_pipeline.experimental_pipelines",
    ):
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            pass
    return modules


def _public_classes() -> List[Tuple[str, type]]:
    found: Dict[str, type] = {}
    for module in (trec_pipelines, experimental):
        for name in dir(module):
            value = getattr(module, name)
            if inspect.isclass(value) and issubclass(value, tp.TrainPipeline):
                if value.__module__.split(".")[0] == "trec_pipelines":
                    found[f"{module.__name__}.{name}"] = value
    return sorted(found.items())


def _torchrec_class(name: str) -> type | None:
    return next((getattr(m, name) for m in _torchrec_modules() if hasattr(m, name)), None)


def _reference(ours: type) -> type:
    """torchrec's class ``ours`` is compared with."""
    theirs = _torchrec_class(ours.__name__)
    if theirs is not None:
        return theirs
    base = next(b for b in ours.__mro__[1:] if _torchrec_class(b.__name__) is not None)
    return _torchrec_class(base.__name__)  # type: ignore[return-value]


def _public_methods(cls: type) -> Set[str]:
    return {n for n, v in inspect.getmembers(cls) if callable(v) and not n.startswith("_")}


CLASSES = _public_classes()


def test_every_public_pipeline_is_checked() -> None:
    names = {cls.__name__ for _, cls in CLASSES}
    assert {"TrainPipelineSparseDist", "TrainPipelineBase", "StagedTrainPipeline"} <= names
    assert len(CLASSES) >= 19


@pytest.mark.parametrize("name,ours", CLASSES, ids=[n for n, _ in CLASSES])
def test_derives_from_every_class_torchrecs_derives_from(name: str, ours: type) -> None:
    theirs = _reference(ours)
    our_names = {c.__name__ for c in ours.__mro__}
    skipped = NOT_DERIVED.get(ours.__name__, frozenset())
    stood_in = {n for n in STAND_INS if issubclass(ours, getattr(trec_pipelines, n))}
    missing = [
        c.__name__ for c in theirs.__mro__ if c.__name__ not in our_names | skipped | stood_in
    ]
    assert not missing, (name, missing, [c.__name__ for c in ours.__mro__])


@pytest.mark.parametrize("name,ours", CLASSES, ids=[n for n, _ in CLASSES])
def test_public_methods_are_torchrecs_plus_ours(name: str, ours: type) -> None:
    theirs = _reference(ours)
    expected = _public_methods(theirs) | OURS | VARIANT_OWN.get(ours.__name__, frozenset())
    assert _public_methods(ours) == expected, (
        sorted(_public_methods(ours) - expected),
        sorted(expected - _public_methods(ours)),
    )
