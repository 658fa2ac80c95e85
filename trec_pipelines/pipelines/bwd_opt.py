"""TrainPipelineSparseDistBwdOpt: the optimizer steps inside the backward, at an output dist."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Optional, Tuple, Type

import torch
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.train_pipeline import In, Out
from torchrec.distributed.train_pipeline.types import PipelineState
from torchrec.distributed.types import ShardingType
from typing_extensions import Unpack

from trec_pipelines.assembly.options import SparseDistTrainOptions, takes_options
from trec_pipelines.core.step_guard import guarded_step
from trec_pipelines.core.subclass_hooks import ASYNC_SUBMIT_OFF
from trec_pipelines.model.backward_hooks import (
    InjectionSite,
    InjectionTargetType,
    OutputDistTensorFinder,
)
from trec_pipelines.model.context import TrainPipelineContext
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist

logger: logging.Logger = logging.getLogger(__name__)


@takes_options(SparseDistTrainOptions)
class TrainPipelineSparseDistBwdOpt(TrainPipelineSparseDist[In, Out]):
    """SparseDist's schedule, with ``optimizer.step()`` run during the backward.

    ==========  =======  ==========================================================
    stream      slot     work
    ==========  =======  ==========================================================
    default     ``cur``  zero_grad, wait, forward, backward (with the step inside)
    data_dist   ``nxt``  input_dist
    memcpy      ``new``  host-to-device copy
    ==========  =======  ==========================================================

    torchrec's experimental class (``experimental_pipelines``).  Three batches in
    flight, in :class:`TrainPipelineSparseDist`'s slots.

    The step is a backward hook at ``site_fqn``'s output dist (an
    :class:`~trec_pipelines.model.backward_hooks.OutputDistTensorFinder` of
    ``sharding_type``): it runs once the backward has launched that module's
    gradient all-to-all, overlapping it, instead of after the backward.  It
    steps on the gradients as they are at that point: what autograd has not
    reached yet (the module's own tables, a dense branch behind it) and what
    DDP has not yet averaged are stepped as they are, as in torchrec's class,
    whose results ours equal bit for bit.  That makes a race, in torchrec's
    class as in ours: DDP (``gradient_as_bucket_view``, torchrec's default)
    all-reduces a bucket of dense gradients in place, on another thread or
    stream, as soon as the bucket is full, and the step can read a gradient
    while it is being reduced.  The first step logs it; a DDP communication
    hook that waits for its all-reduce makes the step deterministic, and
    :class:`TrainPipelineSparseDist` has no such race.  When the site's hook
    does not run in a step's backward (no collective there, as on a one-rank
    group, or the module took no part in the loss), the optimizer steps after
    the backward instead (logged once).

    Differences from torchrec: :ref:`the migration guide <migrating-bwd-opt>` (docs/guides/migrating.md).

    Example::

        pipeline = TrainPipelineSparseDistBwdOpt(
            dmp_model, optimizer, device, site_fqn="sparse_arch.embedding_bag_collection"
        )
        it = iter(dataloader)
        output = pipeline.progress(it)  # one batch a call, until StopIteration

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
    """

    # torchrec's constructor takes no async_inplace_copy: it never submits a copy.
    _traits = TrainPipelineSparseDist._traits.updated(
        hooks={"_submit_inplace_copy": ASYNC_SUBMIT_OFF},
    )

    @property
    def _output_dist_site(self) -> InjectionSite:
        """Where the optimizer steps in the backward (torchrec's attribute)."""
        return self._step_site

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        site_fqn: str,
        sharding_type: ShardingType = ShardingType.TABLE_WISE,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: Type[TrainPipelineContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Optional[Callable[[Optional[Any]], Tuple[torch.Tensor, Any]]] = None,
        dmp_collection_sync_interval_batches: Optional[int] = 1,
        enqueue_batch_after_forward: bool = False,
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
            enqueue_batch_after_forward,
            enable_inplace_copy_batch,
            free_features_storage_early,
            clear_data_dist_inputs,
            **options,
        )
        self._step_site = InjectionSite(
            fqn=site_fqn,
            tensor_finder=OutputDistTensorFinder(sharding_type=sharding_type),
            target_type=InjectionTargetType.ACTIVATION,
        )
        self._after_first_rewrite.append(self._hook_step)
        # Whether this step's optimizer step ran inside its backward.
        self._stepped_in_backward = False
        self._warned_no_hook = False

    def _hook_step(self) -> None:
        """After the first rewrite: the step's hook, and the DDP race said once."""
        self.register_backward_hook(self._step_site, _step_in_backward)
        if any(isinstance(m, DistributedDataParallel) for m in self._model.modules()):
            logger.warning(
                "%s: the optimizer steps inside the backward while DDP may still be "
                "all-reducing dense gradients in place on another thread or stream: "
                "the step can read a gradient half reduced (torchrec's class too). "
                "Register a DDP comm hook that waits for its all-reduce for "
                "deterministic steps, or use TrainPipelineSparseDist.",
                type(self).__name__,
            )

    def _step_now(self) -> None:
        """The optimizer step, inside the backward (the site's hook)."""
        self._stepped_in_backward = True
        self._optimizer_step()

    @guarded_step
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one step on the next batch of ``dataloader_iter``; return its output.

        What every ``progress()`` does: :class:`~trec_pipelines.PipelineOptions`.
        """
        # See [Note: a progress() timeline] in trec_pipelines.pipelines.
        # fmt: off
        self._start_step(dataloader_iter)  # fill, pull host batches, stop at end of data
        training = self._model.training

        if training:
            self._zero_grad()                                      # cur, default
        self._wait_for_batch()                                     # cur, data_dist -> default
        if self._clear_data_dist_inputs:
            self.clear_sparse_data_dist_inputs(self.contexts[0])
        if len(self.batches) >= 2:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])  # nxt, data_dist
        if not self._enqueue_batch_after_forward:
            self.enqueue_batch(dataloader_iter)                    # new, memcpy
        losses, output = self._forward()                           # cur, default
        if self._enqueue_batch_after_forward:
            self.enqueue_batch(dataloader_iter)                    # new, memcpy (after lookup)
        if len(self.batches) >= 2:
            self.wait_sparse_data_dist(self.contexts[1])           # nxt, data_dist
        if training:
            self._stepped_in_backward = False
            self._enter_phase(PipelineState.CALL_BWD)
            self._backward(losses)                                 # cur, default: step inside
            self.sync_embeddings(
                self._model, self._dmp_collection_sync_interval_batches, self.contexts[0]
            )
            if not self._stepped_in_backward:
                self._step_after_backward()                        # cur, default (no hook ran)
        self.dequeue_batch()
        return output

    def _step_after_backward(self) -> None:
        if not self._warned_no_hook:
            self._warned_no_hook = True
            logger.warning(
                "%s: the optimizer step at %r's output dist did not run in batch %d's "
                "backward (no collective to hook there, or the module took no part in "
                "the loss); it steps after the backward instead (torchrec's class would "
                "not step at all)",
                type(self).__name__,
                self._step_site.fqn,
                self.contexts[0].index,
            )
        self._optimizer_step()


def _step_in_backward(pipeline: TrainPipelineSparseDistBwdOpt[Any, Any]) -> None:
    pipeline._step_now()
