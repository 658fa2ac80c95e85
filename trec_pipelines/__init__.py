"""Drop-in replacements for TorchRec's training pipelines, on CPU and GPU.

Swap ``from torchrec.distributed.train_pipeline import TrainPipelineSparseDist``
for ``from trec_pipelines import TrainPipelineSparseDist``.
"""

# torchrec's own interface: a pipeline of ours is a torchrec ``TrainPipeline``.
from torchrec.distributed.train_pipeline import In, Out, TrainPipeline

from trec_pipelines._version import __version__
from trec_pipelines.advise import Advice, advise
from trec_pipelines.core.errors import MalformedBatchError, ModelDetachedException, OutOfStepError
from trec_pipelines.core.state import PipelineState
from trec_pipelines.data.data_loading import DataLoadingThread
from trec_pipelines.data.inplace_copy import AsyncInplaceCopyMixin
from trec_pipelines.experimental_pipelines import (
    EvalPipelineCPUSparse,
    TrainEvalHybridPipelineBase,
    TrainPipelinePrefetchEMS,
    TrainPipelineSparseDistBwdOpt,
    TrainPipelineSparseDistEmbStash,
    TrainPipelineSparseDistOptStash,
    TrainPipelineSparseDistT,
)
from trec_pipelines.model.args import ArgInfo, ArgInfoStepFactory, CallArgs
from trec_pipelines.model.backward_hooks import (
    FirstGradTensorFinder,
    GradTensorFinder,
    InjectionSite,
    InjectionTargetType,
    OutputDistTensorFinder,
    register_backward_hook,
)
from trec_pipelines.model.context import (
    CPUEmbeddingTrainPipelineContext,
    EmbeddingTrainPipelineContext,
    PECTrainPipelineContext,
    PrefetchTrainPipelineContext,
    TrainPipelineContext,
)
from trec_pipelines.model.forwards import (
    CPUEmbeddingPipelinedForward,
    EmbeddingPipelinedForward,
    InSyncEmbeddingPipelinedForward,
    PECPipelinedForward,
    PipelinedForward,
    PrefetchPipelinedForward,
)
from trec_pipelines.model.postproc import PipelinedPostproc, use_context_for_postprocs
from trec_pipelines.model.rewrite import RewriteResult, restore_model, rewrite_model
from trec_pipelines.model.tracing import Tracer
from trec_pipelines.observe.actions import Action
from trec_pipelines.observe.recorder import ScheduleRecorder
from trec_pipelines.pipelines.base import TrainPipelineBase
from trec_pipelines.pipelines.comp_autograd import TrainPipelineSparseDistCompAutograd
from trec_pipelines.pipelines.eval_sparse_dist import EvalPipelineSparseDist
from trec_pipelines.pipelines.fused_sparse_dist import (
    EvalPipelineFusedSparseDist,
    TrainPipelineFusedSparseDist,
)
from trec_pipelines.pipelines.pec import TrainPipelinePEC
from trec_pipelines.pipelines.prefetch import PrefetchTrainPipelineSparseDist
from trec_pipelines.pipelines.pt2 import TorchCompileConfig, TrainPipelinePT2
from trec_pipelines.pipelines.semi_sync import TrainPipelineSemiSync
from trec_pipelines.pipelines.sparse_data_dist_util import SparseDataDistUtil
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist
from trec_pipelines.pipelines.sparse_dist_lite import TrainPipelineSparseDistLite
from trec_pipelines.pipelines.staged import PipelineStage, StagedTrainPipeline, StageOut
from trec_pipelines.sparse.cache_prefetch import prefetch_embeddings
from trec_pipelines.sparse.gradient_accumulation import (
    GradientAccumulationConfig,
    GradientAccumulationWrapper,
)
from trec_pipelines.sparse.stashing import StashPlan

__all__ = [
    "__version__",
    "Action",
    "Advice",
    "AsyncInplaceCopyMixin",
    "ArgInfo",
    "ArgInfoStepFactory",
    "CallArgs",
    "DataLoadingThread",
    "EmbeddingPipelinedForward",
    "EmbeddingTrainPipelineContext",
    "EvalPipelineFusedSparseDist",
    "EvalPipelineSparseDist",
    "FirstGradTensorFinder",
    "GradTensorFinder",
    "GradientAccumulationConfig",
    "GradientAccumulationWrapper",
    "In",
    "InSyncEmbeddingPipelinedForward",
    "InjectionSite",
    "InjectionTargetType",
    "MalformedBatchError",
    "OutOfStepError",
    "ModelDetachedException",
    "Out",
    "OutputDistTensorFinder",
    "PECPipelinedForward",
    "PECTrainPipelineContext",
    "PipelineStage",
    "PipelinedPostproc",
    "PipelineState",
    "PipelinedForward",
    "PrefetchPipelinedForward",
    "PrefetchTrainPipelineContext",
    "PrefetchTrainPipelineSparseDist",
    "RewriteResult",
    "ScheduleRecorder",
    "SparseDataDistUtil",
    "StageOut",
    "StagedTrainPipeline",
    "TorchCompileConfig",
    "Tracer",
    "TrainPipeline",
    "TrainPipelineBase",
    "TrainPipelineContext",
    "TrainPipelineFusedSparseDist",
    "TrainPipelinePEC",
    "TrainPipelinePT2",
    "TrainPipelineSemiSync",
    "TrainPipelineSparseDist",
    "TrainPipelineSparseDistCompAutograd",
    "TrainPipelineSparseDistLite",
    "advise",
    "TrainPipelineSparseDistT",
    "TrainPipelineSparseDistBwdOpt",
    "TrainEvalHybridPipelineBase",
    "EvalPipelineCPUSparse",
    "CPUEmbeddingTrainPipelineContext",
    "CPUEmbeddingPipelinedForward",
    "TrainPipelineSparseDistOptStash",
    "TrainPipelineSparseDistEmbStash",
    "TrainPipelinePrefetchEMS",
    "StashPlan",
    "prefetch_embeddings",
    "register_backward_hook",
    "restore_model",
    "rewrite_model",
    "use_context_for_postprocs",
]
