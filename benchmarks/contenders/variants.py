"""Which pipelines are raced: every variant of ours with its torchrec twin, found by name.

:func:`discover` lists the variants (display order, compiled ones on request);
:class:`Variant` says what each needs (the CPU shim, the Python reducer, stashed
weights).  The contenders built from them are in :mod:`benchmarks.contenders.build`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from benchmarks.settings.variants import COMPILED_VARIANTS

# Modes: how an epoch is driven and which plain loop it is compared with.
TRAIN, EVAL, STAGED = "train", "eval", "staged"

# Display order; variants exported later that are not listed go at the end.
KNOWN_ORDER = (
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
    "TrainPipelineSparseDistT",
    "TrainPipelineSparseDistBwdOpt",
    "TrainEvalHybridPipelineBase",
    "TrainPipelineSparseDistOptStash",
    "TrainPipelineSparseDistEmbStash",
    "TrainPipelinePrefetchEMS",
    "EvalPipelineCPUSparse",
)


# Variants that compile the model (or its autograd graph) with torch.compile.
COMPILED = COMPILED_VARIANTS


# torchrec classes that call CUDA-only stream APIs on CPU; they run under the shim.
SHIMMED = frozenset(
    {
        "TrainPipelineFusedSparseDist",
        "TrainPipelineSemiSync",
        "PrefetchTrainPipelineSparseDist",
        "EvalPipelineFusedSparseDist",
        "StagedTrainPipeline",
        "TrainPipelineSparseDistCompAutograd",
    }
)


# Variants whose model must be built with DDP's Python reducer (compiled autograd).
NEEDS_PYTHON_REDUCER = frozenset({"TrainPipelineSparseDistCompAutograd"})


# Their models mark every table stash_weights, so there is something to stash (on a
# GPU; on CPU nothing moves).  Only theirs: torchrec's manager, once enabled, stashes
# a marked table after every lookup, whichever pipeline trains it.
STASH_WEIGHTS_VARIANTS = frozenset({"TrainPipelineSparseDistEmbStash", "TrainPipelinePrefetchEMS"})


@dataclass(frozen=True)
class Variant:
    """One pipeline class name with both libraries' implementations (None if absent)."""

    name: str
    ours: Optional[type]
    theirs: Optional[type]

    @property
    def mode(self) -> str:
        if self.name.startswith("Eval"):
            return EVAL
        if self.name.startswith("Staged"):
            return STAGED
        return TRAIN

    @property
    def compiled(self) -> bool:
        return self.name in COMPILED

    @property
    def shimmed(self) -> bool:
        return self.name in SHIMMED

    @property
    def plain_mode(self) -> str:
        """The plain loop this variant is compared with."""
        return EVAL if self.mode == EVAL else TRAIN


def _is_pipeline_class(obj: Any) -> bool:
    from torchrec.distributed.train_pipeline import TrainPipeline

    return inspect.isclass(obj) and issubclass(obj, TrainPipeline) and not inspect.isabstract(obj)


def torchrec_class(name: str) -> Optional[type]:
    """torchrec's class named ``name``: from the package, its train_pipelines
    module, or its experimental_pipelines module."""
    import torchrec.distributed.train_pipeline as package
    import torchrec.distributed.train_pipeline.experimental_pipelines as experimental
    import torchrec.distributed.train_pipeline.train_pipelines as module

    for source in (package, module, experimental):
        cls = getattr(source, name, None)
        if _is_pipeline_class(cls):
            return cls
    return None


def discover(
    names: Sequence[str] = (), include_compiled: bool = False
) -> Tuple[List[Variant], List[str]]:
    """The variants to benchmark and notes on what was left out.

    Every pipeline class in ``trec_pipelines.__all__`` is a variant (classes
    only importable from ``trec_pipelines.pipelines.<module>`` are not, until
    the package exports them).  ``names`` restricts the set; compiled variants
    need ``include_compiled``.
    """
    import trec_pipelines

    exported = {n: getattr(trec_pipelines, n) for n in getattr(trec_pipelines, "__all__", ())}
    pipelines = {n: obj for n, obj in exported.items() if _is_pipeline_class(obj)}
    notes: List[str] = []
    unknown = [n for n in names if n not in pipelines]
    if unknown:
        raise ValueError(
            f"--variants {', '.join(unknown)}: not a pipeline class exported by trec_pipelines "
            f"(exported: {', '.join(sorted(pipelines))})"
        )
    chosen = (
        list(names)
        if names
        else sorted(
            pipelines,
            key=lambda n: (KNOWN_ORDER.index(n) if n in KNOWN_ORDER else len(KNOWN_ORDER), n),
        )
    )
    variants: List[Variant] = []
    for name in chosen:
        if name in COMPILED and not include_compiled and not names:
            notes.append(f"{name}: compiles the model; left out (run with --include-compiled)")
            continue
        variants.append(Variant(name, pipelines[name], torchrec_class(name)))
    return variants, notes
