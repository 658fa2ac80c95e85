"""TrainPipelineSparseDistT: SparseDist with every host-to-device copy issued by a thread."""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Type

import torch
from torchrec.distributed.train_pipeline import In, Out
from typing_extensions import Unpack

from trec_pipelines.assembly.options import SparseDistTrainOptions, takes_options
from trec_pipelines.core.subclass_hooks import ASYNC_SUBMIT_OFF
from trec_pipelines.data.inplace_copy import BatchQueue, make_copy_worker
from trec_pipelines.model.context import TrainPipelineContext
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist


@takes_options(SparseDistTrainOptions)
class TrainPipelineSparseDistT(TrainPipelineSparseDist[In, Out]):
    """:class:`TrainPipelineSparseDist`'s schedule; a background thread issues the copies.

    ==========  =======  ==========================================================
    stream      slot     work
    ==========  =======  ==========================================================
    default     ``cur``  zero_grad, wait, forward, backward, step
    data_dist   ``nxt``  input_dist: splits all-to-all, then tensors all-to-all
    memcpy      ``new``  host-to-device copy, issued by the worker thread
    ==========  =======  ==========================================================

    torchrec's experimental class (``experimental_pipelines``).  Three batches in
    flight, in SparseDist's slots; ``new``'s slot holds the copy's Future until the next step
    first reads it, before any stream waits for the copy.

    Every copy of ``new``, in place (``enable_inplace_copy_batch``) or not, is
    submitted to one worker thread, so the training thread does not spend the
    CPU time of issuing it (the machinery of ``async_inplace_copy``, see
    the note "async in-place copy" in the source of ``trec_pipelines.data.inplace_copy``).  The
    copy is always issued before the forward: there is no
    ``enqueue_batch_after_forward`` and no ``async_inplace_copy`` parameter.
    On a device without streams (CPU) there is no device copy to issue: the
    copies stay on the training thread (logged once).  Everything else,
    results included, is SparseDist's, bit for bit.

    Differences from torchrec: :ref:`the migration guide <migrating-sparse-dist-t>` (docs/guides/migrating.md).

    Example::

        pipeline = TrainPipelineSparseDistT(dmp_model, optimizer, torch.device("cuda"))
        it = iter(dataloader)
        output = pipeline.progress(it)  # one batch a call, until StopIteration

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
    """

    # torchrec's constructor takes no async_inplace_copy: it never submits a copy.
    _traits = TrainPipelineSparseDist._traits.updated(
        hooks={"_submit_inplace_copy": ASYNC_SUBMIT_OFF},
    )

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: Type[TrainPipelineContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Optional[Callable[[Optional[Any]], Tuple[torch.Tensor, Any]]] = None,
        dmp_collection_sync_interval_batches: Optional[int] = 1,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        **options: Unpack[SparseDistTrainOptions],
    ) -> None:
        super().__init__(
            model,
            optimizer,
            device,
            execute_all_batches,
            apply_jit,
            context_type,
            pipeline_postproc,
            custom_model_fwd,
            dmp_collection_sync_interval_batches,
            enqueue_batch_after_forward=False,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            **options,
        )
        self._copy_worker = make_copy_worker(self, False, every_copy=True)
        self.batches = BatchQueue(self.batches)  # its slots may hold the worker's Futures
