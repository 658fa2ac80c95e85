"""Drop-in replacements for TorchRec's training pipelines, on CPU and GPU.

Swap ``from torchrec.distributed.train_pipeline import TrainPipelineSparseDist``
for ``from trec_pipelines import TrainPipelineSparseDist``.
"""

from trec_pipelines.context import (
    EmbeddingTrainPipelineContext,
    PECTrainPipelineContext,
    PrefetchTrainPipelineContext,
    TrainPipelineContext,
)
from trec_pipelines.pipelines.base import TrainPipelineBase
from trec_pipelines.pipelines.eval_sparse_dist import EvalPipelineSparseDist
from trec_pipelines.pipelines.fused_sparse_dist import (
    EvalPipelineFusedSparseDist,
    TrainPipelineFusedSparseDist,
)
from trec_pipelines.forwards import PECPipelinedForward
from trec_pipelines.pipelines.pec import TrainPipelinePEC
from trec_pipelines.pipelines.prefetch import PrefetchTrainPipelineSparseDist
from trec_pipelines.pipelines.comp_autograd import TrainPipelineSparseDistCompAutograd
from trec_pipelines.pipelines.semi_sync import TrainPipelineSemiSync
from trec_pipelines.pipelines.sparse_data_dist_util import SparseDataDistUtil
from trec_pipelines.pipelines.staged import PipelineStage, StagedTrainPipeline
from trec_pipelines.pipelines.pt2 import TorchCompileConfig, TrainPipelinePT2
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist
from trec_pipelines.pipelines.sparse_dist_lite import TrainPipelineSparseDistLite
from trec_pipelines.recorder import Action, ScheduleRecorder
from trec_pipelines.rewrite import RewriteResult, restore_model, rewrite_model

__all__ = [
    "Action",
    "EmbeddingTrainPipelineContext",
    "EvalPipelineFusedSparseDist",
    "EvalPipelineSparseDist",
    "PECPipelinedForward",
    "PECTrainPipelineContext",
    "PipelineStage",
    "PrefetchTrainPipelineContext",
    "PrefetchTrainPipelineSparseDist",
    "RewriteResult",
    "ScheduleRecorder",
    "SparseDataDistUtil",
    "StagedTrainPipeline",
    "TorchCompileConfig",
    "TrainPipelineBase",
    "TrainPipelineContext",
    "TrainPipelineFusedSparseDist",
    "TrainPipelinePEC",
    "TrainPipelinePT2",
    "TrainPipelineSemiSync",
    "TrainPipelineSparseDist",
    "TrainPipelineSparseDistCompAutograd",
    "TrainPipelineSparseDistLite",
    "restore_model",
    "rewrite_model",
]
