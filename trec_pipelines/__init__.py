"""Drop-in replacements for TorchRec's training pipelines, on CPU and GPU.

Swap ``from torchrec.distributed.train_pipeline import TrainPipelineSparseDist``
for ``from trec_pipelines import TrainPipelineSparseDist``.

The public names are ``__all__``, and the API reference lists them by role.
``trec_pipelines.experimental_pipelines`` (named as torchrec's module),
``trec_pipelines.testing``, ``trec_pipelines.elastic`` (a process group for a
job torchrun restarts) and the ``python -m trec_pipelines.advise`` command
line are public too; the other subpackages hold the implementation.
"""

# Each name is imported as ``X as X``: the typing spec's explicit re-export, so
# type checkers see the public names of this py.typed package although
# ``__all__`` is built from _PUBLIC_GROUPS below.

from typing import Dict, List, Tuple

# torchrec's own interface: a pipeline of ours is a torchrec ``TrainPipeline``.
from torchrec.distributed.train_pipeline import In as In, Out as Out, TrainPipeline as TrainPipeline

from trec_pipelines import experimental_pipelines
from trec_pipelines._version import __version__ as __version__
from trec_pipelines.advise import (
    Advice as Advice,
    Answer as Answer,
    VariantReport as VariantReport,
    Verdict as Verdict,
    advise as advise,
)
from trec_pipelines.assembly.options import PipelineOptions as PipelineOptions
from trec_pipelines.assembly.resume import Resumable as Resumable
from trec_pipelines.core.errors import (
    MalformedBatchError as MalformedBatchError,
    ModelDetachedException as ModelDetachedException,
    OutOfStepError as OutOfStepError,
    PeerFailedError as PeerFailedError,
)
from trec_pipelines.core.state import PipelineState as PipelineState
from trec_pipelines.data.data_loading import DataLoadingThread as DataLoadingThread
from trec_pipelines.data.inplace_copy import AsyncInplaceCopyMixin as AsyncInplaceCopyMixin
from trec_pipelines.experimental_pipelines import (
    EvalPipelineCPUSparse as EvalPipelineCPUSparse,
    TrainEvalHybridPipelineBase as TrainEvalHybridPipelineBase,
    TrainPipelinePrefetchEMS as TrainPipelinePrefetchEMS,
    TrainPipelineSparseDistBwdOpt as TrainPipelineSparseDistBwdOpt,
    TrainPipelineSparseDistEmbStash as TrainPipelineSparseDistEmbStash,
    TrainPipelineSparseDistOptStash as TrainPipelineSparseDistOptStash,
    TrainPipelineSparseDistT as TrainPipelineSparseDistT,
)
from trec_pipelines.model.args import (
    ArgInfo as ArgInfo,
    ArgInfoStepFactory as ArgInfoStepFactory,
    CallArgs as CallArgs,
)
from trec_pipelines.model.backward_hooks import (
    FirstGradTensorFinder as FirstGradTensorFinder,
    GradTensorFinder as GradTensorFinder,
    InjectionSite as InjectionSite,
    InjectionTargetType as InjectionTargetType,
    OutputDistTensorFinder as OutputDistTensorFinder,
    register_backward_hook as register_backward_hook,
)
from trec_pipelines.model.context import (
    CPUEmbeddingTrainPipelineContext as CPUEmbeddingTrainPipelineContext,
    EmbeddingTrainPipelineContext as EmbeddingTrainPipelineContext,
    PECTrainPipelineContext as PECTrainPipelineContext,
    PrefetchTrainPipelineContext as PrefetchTrainPipelineContext,
    TrainPipelineContext as TrainPipelineContext,
)
from trec_pipelines.model.postproc import (
    PipelinedPostproc as PipelinedPostproc,
    use_context_for_postprocs as use_context_for_postprocs,
)
from trec_pipelines.model.rewrite import (
    RewriteResult as RewriteResult,
    restore_model as restore_model,
    rewrite_model as rewrite_model,
)
from trec_pipelines.model.tracing import Tracer as Tracer
from trec_pipelines.observe.action_records import Action as Action, Transfer as Transfer
from trec_pipelines.observe.ledger import (
    LedgerSummary as LedgerSummary,
    MemorySample as MemorySample,
)
from trec_pipelines.observe.recorder import (
    Recordable as Recordable,
    ScheduleRecorder as ScheduleRecorder,
)
from trec_pipelines.pipelines.base import TrainPipelineBase as TrainPipelineBase
from trec_pipelines.pipelines.comp_autograd import (
    TrainPipelineSparseDistCompAutograd as TrainPipelineSparseDistCompAutograd,
)
from trec_pipelines.pipelines.eval_fused_sparse_dist import (
    EvalPipelineFusedSparseDist as EvalPipelineFusedSparseDist,
)
from trec_pipelines.pipelines.eval_sparse_dist import (
    EvalPipelineSparseDist as EvalPipelineSparseDist,
)
from trec_pipelines.pipelines.fused_sparse_dist import (
    TrainPipelineFusedSparseDist as TrainPipelineFusedSparseDist,
)
from trec_pipelines.pipelines.pec import TrainPipelinePEC as TrainPipelinePEC
from trec_pipelines.pipelines.prefetch import (
    PrefetchTrainPipelineSparseDist as PrefetchTrainPipelineSparseDist,
)
from trec_pipelines.pipelines.pt2 import (
    TorchCompileConfig as TorchCompileConfig,
    TrainPipelinePT2 as TrainPipelinePT2,
)
from trec_pipelines.pipelines.semi_sync import TrainPipelineSemiSync as TrainPipelineSemiSync
from trec_pipelines.pipelines.sparse_data_dist_util import SparseDataDistUtil as SparseDataDistUtil
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist as TrainPipelineSparseDist
from trec_pipelines.pipelines.sparse_dist_lite import (
    TrainPipelineSparseDistLite as TrainPipelineSparseDistLite,
)
from trec_pipelines.pipelines.staged import (
    PipelineStage as PipelineStage,
    StagedTrainPipeline as StagedTrainPipeline,
    StageOut as StageOut,
)
from trec_pipelines.sparse.cache_prefetch import prefetch_embeddings as prefetch_embeddings
from trec_pipelines.sparse.forwards import (
    CPUEmbeddingPipelinedForward as CPUEmbeddingPipelinedForward,
    EmbeddingPipelinedForward as EmbeddingPipelinedForward,
    InSyncEmbeddingPipelinedForward as InSyncEmbeddingPipelinedForward,
    PECPipelinedForward as PECPipelinedForward,
    PipelinedForward as PipelinedForward,
    PrefetchPipelinedForward as PrefetchPipelinedForward,
)
from trec_pipelines.sparse.gradient_accumulation import (
    GradientAccumulationConfig as GradientAccumulationConfig,
    GradientAccumulationWrapper as GradientAccumulationWrapper,
)
from trec_pipelines.sparse.stashing import StashPlan as StashPlan

# The public surface, by role: the API reference (docs/api.md) has one section
# per group, in this order, documenting exactly these names, in this order
# (tests/unit/test_public_surface.py); ``__all__`` is ``__version__`` and then
# every group.  A new public name goes into one group here.
_PUBLIC_GROUPS: Dict[str, Tuple[str, ...]] = {
    # torchrec's pipelines, ours; the last three are torchrec's interface, re-exported.
    "Pipelines": (
        "TrainPipelineBase",
        "TrainPipelineSparseDist",
        "TrainPipelinePT2",
        "TrainPipelineSparseDistLite",
        "TrainPipelineFusedSparseDist",
        "TrainPipelineSemiSync",
        "PrefetchTrainPipelineSparseDist",
        "EvalPipelineSparseDist",
        "EvalPipelineFusedSparseDist",
        "TrainPipelineSparseDistCompAutograd",
        "TrainPipelinePEC",
        "StagedTrainPipeline",
        "PipelineStage",
        "SparseDataDistUtil",
        "StageOut",
        "TrainPipeline",
        "In",
        "Out",
    ),
    # torchrec's experimental_pipelines, also importable from our module of that name.
    "Experimental pipelines": tuple(experimental_pipelines.__all__),
    # PipelineOptions documents what the pipelines share: torchrec's parameters, our
    # options, progress().
    "Options and errors": (
        "PipelineOptions",
        "TorchCompileConfig",
        "GradientAccumulationConfig",
        "GradientAccumulationWrapper",
        "MalformedBatchError",
        "OutOfStepError",
        "PeerFailedError",
        "ModelDetachedException",
    ),
    "Checkpoint and resume": ("Resumable",),
    "Advisor": ("advise", "Advice", "Verdict", "Answer", "VariantReport"),
    "Observation": (
        "Recordable",
        "Action",
        "Transfer",
        "ScheduleRecorder",
        "LedgerSummary",
        "MemorySample",
        "StashPlan",
    ),
    # What torchrec's pipeline package exports besides its pipelines, ours.
    "Building blocks": (
        "TrainPipelineContext",
        "EmbeddingTrainPipelineContext",
        "PrefetchTrainPipelineContext",
        "PECTrainPipelineContext",
        "CPUEmbeddingTrainPipelineContext",
        "PipelinedForward",
        "EmbeddingPipelinedForward",
        "InSyncEmbeddingPipelinedForward",
        "PrefetchPipelinedForward",
        "PECPipelinedForward",
        "CPUEmbeddingPipelinedForward",
        "rewrite_model",
        "restore_model",
        "RewriteResult",
        "Tracer",
        "ArgInfo",
        "ArgInfoStepFactory",
        "CallArgs",
        "PipelinedPostproc",
        "use_context_for_postprocs",
        "register_backward_hook",
        "InjectionSite",
        "InjectionTargetType",
        "GradTensorFinder",
        "FirstGradTensorFinder",
        "OutputDistTensorFinder",
        "prefetch_embeddings",
        "DataLoadingThread",
        "AsyncInplaceCopyMixin",
        "PipelineState",
    ),
}

__all__: List[str] = ["__version__"] + [name for names in _PUBLIC_GROUPS.values() for name in names]


def __dir__() -> List[str]:
    """``dir(trec_pipelines)``: the public names, not the subpackages (PEP 562)."""
    return list(__all__)
