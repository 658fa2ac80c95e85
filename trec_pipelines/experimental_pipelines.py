"""torchrec's experimental pipelines (``torchrec.distributed.train_pipeline.experimental_pipelines``), ours.

Importable from here, as upstream's module is named, and from the package root.
Each is a :class:`~trec_pipelines.TrainPipelineSparseDist` with its own
schedule; see each class.
"""

from trec_pipelines.pipelines.bwd_opt import TrainPipelineSparseDistBwdOpt
from trec_pipelines.pipelines.eval_cpu_sparse import EvalPipelineCPUSparse
from trec_pipelines.pipelines.prefetch_ems import TrainPipelinePrefetchEMS
from trec_pipelines.pipelines.sparse_dist_t import TrainPipelineSparseDistT
from trec_pipelines.pipelines.stash import (
    TrainPipelineSparseDistEmbStash,
    TrainPipelineSparseDistOptStash,
)
from trec_pipelines.pipelines.train_eval_hybrid import TrainEvalHybridPipelineBase

# In the order of the variants guide's table.
__all__ = [
    "TrainPipelineSparseDistT",
    "TrainPipelineSparseDistBwdOpt",
    "TrainEvalHybridPipelineBase",
    "TrainPipelineSparseDistOptStash",
    "TrainPipelineSparseDistEmbStash",
    "TrainPipelinePrefetchEMS",
    "EvalPipelineCPUSparse",
]
