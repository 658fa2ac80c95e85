"""torchrec's overridable methods, per class, for the hook-parity tests.

Shared by the unit tier (every hook honoured with torchrec's signature,
allowed with one warning where neither torchrec's class nor ours calls it, or
refused at class creation) and the distributed tier (the honoured ones called
as torchrec calls them, the uncalled ones called by neither).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Dict, List, Optional

import trec_pipelines

# Where torchrec keeps its pipeline classes, newest first.
_MODULES = (
    "torchrec.distributed.train_pipeline",
    "torchrec.distributed.train_pipeline.train_pipelines",
    "torchrec.distributed.train_pipeline.experimental_pipelines",
    "torchrec.distributed.train_pipeline.pec_train_pipeline",
)

# The classes ours replace one for one.
CLASSES = [
    "TrainPipelineBase",
    "TrainPipelinePT2",
    "TrainPipelineSparseDist",
    "TrainPipelineSparseDistLite",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "PrefetchTrainPipelineSparseDist",
    "EvalPipelineSparseDist",
    "EvalPipelineFusedSparseDist",
    "StagedTrainPipeline",
    "TrainPipelineSparseDistCompAutograd",
    "TrainPipelinePEC",
    "TrainPipelineSparseDistT",
    "TrainPipelineSparseDistBwdOpt",
    "TrainEvalHybridPipelineBase",
    "TrainPipelineSparseDistOptStash",
    "TrainPipelineSparseDistEmbStash",
    "TrainPipelinePrefetchEMS",
    "EvalPipelineCPUSparse",
]


def torchrec_class(name: str) -> Optional[type]:
    """torchrec's class ``name``, or None where this torchrec has none."""
    for module_name in _MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found = getattr(module, name, None)
        if inspect.isclass(found):
            return found
    return None


def overridable(cls: type) -> Dict[str, Any]:
    """Every method (and ``_pipelined_forward_type``) a subclass of ``cls`` can
    override: name -> what ``cls`` has under it."""
    found: Dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        for name, value in vars(klass).items():
            if name == "_pipelined_forward_type":  # a class, read as a hook is called
                found[name] = value
                continue
            if name.startswith("__") or isinstance(value, (property, type)):
                continue
            if callable(value) or isinstance(value, (staticmethod, classmethod)):
                found[name] = value
    return found


def parameters(cls: type, name: str) -> List[str]:
    """The parameter names of ``cls.name`` (without ``self``), in order."""
    return [p for p in inspect.signature(getattr(cls, name)).parameters if p != "self"]


def pairs() -> List[tuple]:
    """``(class name, hook)`` for every hook of every torchrec class this torchrec has."""
    out = []
    for name in CLASSES:
        theirs = torchrec_class(name)
        if theirs is None:
            continue
        for hook in sorted(overridable(theirs)):
            out.append((name, hook))
    return out


def ours(name: str) -> type:
    return getattr(trec_pipelines, name)
