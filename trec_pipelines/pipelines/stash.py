"""The memory-stashing variants: TrainPipelineSparseDistOptStash and TrainPipelineSparseDistEmbStash.

Both keep SparseDist's schedule and add stash and restore points, through
:mod:`trec_pipelines.sparse.stashing` (torchrec's ``MemoryStashingManager`` where the
device has streams, nothing on CPU, where there is no device memory to free).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Optional, Tuple, Type, Union

import torch
from torchrec.distributed.train_pipeline import In, Out
from torchrec.distributed.train_pipeline.types import PipelineState
from torchrec.distributed.types import ShardingType
from typing_extensions import Unpack

from trec_pipelines.assembly.options import SparseDistTrainOptions, takes_options
from trec_pipelines.core.step_guard import guarded_step
from trec_pipelines.core.subclass_hooks import ASYNC_SUBMIT_OFF, Refused
from trec_pipelines.model.backward_hooks import (
    FirstGradTensorFinder,
    InjectionSite,
    InjectionTargetType,
    OutputDistTensorFinder,
)
from trec_pipelines.model.context import TrainPipelineContext
from trec_pipelines.model.rewrite import unwrap
from trec_pipelines.observe import recorder as rec
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist
from trec_pipelines.sparse.stashing import (
    Stashing,
    StashPlan,
    plan_stash,
    report_plan,
    stashing_for,
)

logger: logging.Logger = logging.getLogger(__name__)


@takes_options(SparseDistTrainOptions)
class TrainPipelineSparseDistOptStash(TrainPipelineSparseDist[In, Out]):
    """SparseDist's schedule; the optimizer state lives on the host between steps.

    ==========  =======  ==========================================================
    stream      slot     work
    ==========  =======  ==========================================================
    default     ``cur``  zero_grad, wait, forward, the previous stash issued,
                         backward (the restore starts inside), restore done,
                         step, stash started
    data_dist   ``nxt``  input_dist
    memcpy      ``new``  host-to-device copy (and the restore's copies)
    ==========  =======  ==========================================================

    torchrec's experimental class (``experimental_pipelines``).  Three batches in
    flight, in :class:`TrainPipelineSparseDist`'s slots.

    After each optimizer step its state (Adam's moments, Shampoo's factors) is
    copied to the host and its device memory freed, on a worker thread, so the
    next forward and backward have that memory; the backward brings it back,
    starting at ``site_fqn``'s output dist (overlapping that module's gradient
    all-to-all), and the step waits for it.  When the site's hook did not run
    in a step's backward (no collective there, or the module took no part in
    the loss), the state is restored before the step (logged once).
    :meth:`stash_plan` says what is moved, and a warning says when there is
    nothing to move.  On CPU the state is in host memory already: the stash and
    restore points do nothing and the results are SparseDist's, bit for bit.

    Differences from torchrec: :ref:`the migration guide <migrating-opt-stash>` (docs/guides/migrating.md).

    Example::

        pipeline = TrainPipelineSparseDistOptStash(
            dmp_model, optimizer, device, site_fqn="sparse_arch.embedding_bag_collection"
        )
        it = iter(dataloader)
        output = pipeline.progress(it)  # one batch a call, until StopIteration

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
    """

    _traits = TrainPipelineSparseDist._traits.updated(
        hooks={"_submit_inplace_copy": ASYNC_SUBMIT_OFF},
    )

    @property
    def _output_dist_site(self) -> InjectionSite:
        """Where the optimizer state's restore starts in the backward (torchrec's attribute)."""
        return self._restore_site

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
        self._restore_site = InjectionSite(
            fqn=site_fqn, tensor_finder=OutputDistTensorFinder(sharding_type=sharding_type)
        )
        self._stashing: Stashing = stashing_for(self._streams, self._device)
        self._after_first_rewrite.append(self._hook_restore)
        self._warned_no_restore = False
        self._plan_reported = False

    def stash_plan(self) -> StashPlan:
        """What this pipeline moves to the host after each step on this rank (the
        optimizer state, by torchrec's manager's rules; see
        :class:`~trec_pipelines.StashPlan`)."""
        return plan_stash(self._stashing, optimizer=self._optimizer)

    def _hook_restore(self) -> None:
        """After the first rewrite: the restore's hook at the site."""
        self.register_backward_hook(self._restore_site, _start_optimizer_restore)

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
            self._finish_optimizer_stash()                         # prv's stash issued (worker)
            self._enter_phase(PipelineState.CALL_BWD)
            self._backward(losses)                                 # cur, default: restore starts
            self.sync_embeddings(
                self._model, self._dmp_collection_sync_interval_batches, self.contexts[0]
            )
            self._finish_optimizer_restore()                       # cur, state back
            self._optimizer_step()                                 # cur, default
            self._start_optimizer_stash()                          # cur, state out (worker)
        self.dequeue_batch()
        return output

    def _finish_optimizer_stash(self) -> None:
        with self._recording.span(rec.STASH_WAIT, self.contexts[0].index):
            self._stashing.finish_optimizer_stash()

    def _restore_now(self) -> None:
        """The site's hook, inside the backward."""
        with self._recording.span(rec.STASH_RESTORE, self.contexts[0].index):
            self._stashing.start_optimizer_restore()

    def _finish_optimizer_restore(self) -> None:
        with self._recording.span(rec.STASH_WAIT, self.contexts[0].index):
            started = self._stashing.finish_optimizer_restore()
        if not started and self._stashing.enabled and not self._warned_no_restore:
            self._warned_no_restore = True
            logger.warning(
                "%s: the optimizer state restore at %r's output dist did not start in "
                "batch %d's backward; it was restored before the step instead (torchrec's "
                "class would step on state still on the host)",
                type(self).__name__,
                self._restore_site.fqn,
                self.contexts[0].index,
            )

    def _start_optimizer_stash(self) -> None:
        if not self._plan_reported:  # after the first step: lazy optimizers have state now
            self._plan_reported = True
            report_plan(type(self).__name__, self.stash_plan(), self._device, "optimizer state")
        with self._recording.span(rec.OPT_STASH, self.contexts[0].index):
            self._stashing.start_optimizer_stash(self._optimizer)


def _start_optimizer_restore(pipeline: TrainPipelineSparseDistOptStash[Any, Any]) -> None:
    pipeline._restore_now()


@takes_options(SparseDistTrainOptions)
class TrainPipelineSparseDistEmbStash(TrainPipelineSparseDist[In, Out]):
    """SparseDist's schedule; stashed embedding weights come back during the backward.

    ==========  =======  ==========================================================
    stream      slot     work
    ==========  =======  ==========================================================
    default     ``cur``  zero_grad, wait, forward (marked tables stashed after
                         their lookup), backward (restored at ``site_fqn``), step
    data_dist   ``nxt``  input_dist
    memcpy      ``new``  host-to-device copy
    ==========  =======  ==========================================================

    torchrec's experimental class (``experimental_pipelines``).  Three batches in
    flight, in :class:`TrainPipelineSparseDist`'s slots.

    The sharded embedding modules of tables configured with ``stash_weights``
    stash those weights to the host right after their lookup (inside the
    forward, when the stashing has streams), so the dense part has that device
    memory; this pipeline brings them back at ``site_fqn`` (a module name,
    whose first parameter's gradient hook is the site, or an
    :class:`~trec_pipelines.model.backward_hooks.InjectionSite`), before the backward
    reaches the embeddings.  With ``delay_stash`` the stashes wait until the
    forward reaches ``stash_site_fqn`` (a forward pre-hook there), or, without
    one, until the backward reaches the site.  :meth:`stash_plan` says what is
    moved, and a warning says when no table is marked.  On CPU the weights are
    in host memory already: nothing is stashed, the restore points do nothing,
    and the results are SparseDist's, bit for bit.

    Differences from torchrec: :ref:`the migration guide <migrating-emb-stash>` (docs/guides/migrating.md).

    Example::

        pipeline = TrainPipelineSparseDistEmbStash(
            dmp_model, optimizer, device, site_fqn="over_arch"
        )
        it = iter(dataloader)
        output = pipeline.progress(it)  # one batch a call, until StopIteration

    Args:
        delay_stash: Stash the embeddings only when the forward reaches ``stash_site_fqn`` (or,
            without one, when the backward reaches ``site_fqn``) instead of right after their
            lookup.
        stash_site_fqn: With ``delay_stash``: the module whose forward pre-hook stashes; ``None``:
            stash when the backward reaches ``site_fqn``.

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
    """

    _traits = TrainPipelineSparseDist._traits.updated(
        hooks={"_submit_inplace_copy": ASYNC_SUBMIT_OFF}
        | {
            hook: Refused(
                "the stash sites are hooked once, after the first rewrite, through _hook_sites",
                "_hook_sites()",
            )
            for hook in ("_try_hook_stash", "_log_ems_config")
        },
    )

    @property
    def _injection_site(self) -> Any:
        """Where the stashed embeddings' restore starts in the backward (torchrec's
        attribute: an ``InjectionSite``, or the fqn given)."""
        return self._restore_site

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        site_fqn: Union[str, InjectionSite],
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: Type[TrainPipelineContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Optional[Callable[[Optional[Any]], Tuple[torch.Tensor, Any]]] = None,
        dmp_collection_sync_interval_batches: Optional[int] = 1,
        enqueue_batch_after_forward: bool = False,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        delay_stash: bool = False,
        stash_site_fqn: Optional[str] = None,
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
        self._restore_site: Any = (
            InjectionSite(
                fqn=site_fqn,
                tensor_finder=FirstGradTensorFinder(),
                target_type=InjectionTargetType.PARAM_GRAD,
            )
            if isinstance(site_fqn, str)
            else site_fqn
        )
        self._delay_stash = delay_stash
        self._stash_site_fqn = stash_site_fqn
        self._stashing: Stashing = stashing_for(self._streams, self._device)
        self._stashing.set_delay_stash(delay_stash)
        self._after_first_rewrite.append(self._hook_sites)

    def stash_plan(self) -> StashPlan:
        """What this pipeline moves to the host between each lookup and its backward
        on this rank (the weights of the tables marked ``stash_weights``; see
        :class:`~trec_pipelines.StashPlan`)."""
        return plan_stash(self._stashing, model=self._model)

    def _hook_sites(self) -> None:
        """After the first rewrite: the delayed stashes' trigger, then the restore."""
        report_plan(type(self).__name__, self.stash_plan(), self._device, "embedding weights")
        if self._delay_stash and self._stash_site_fqn is None:
            self.register_backward_hook(self._restore_site, _execute_pending_stashes)
        if self._delay_stash and self._stash_site_fqn is not None:
            self._hook_stash_site(self._stash_site_fqn)
        self.register_backward_hook(self._restore_site, _restore_embedding_weights)

    def _hook_stash_site(self, fqn: str) -> None:
        """Run the delayed stashes when the forward reaches ``fqn``."""
        try:
            target = unwrap(self._model).get_submodule(fqn)
        except AttributeError:
            raise ValueError(
                f"{type(self).__name__}: stash_site_fqn={fqn!r} names no module of the "
                "model; give a module name relative to your model, e.g. 'over_arch'"
            ) from None
        stashing = self._stashing
        target.register_forward_pre_hook(lambda module, args: stashing.execute_pending_stashes())

    def _restore_now(self) -> None:
        with self._recording.span(rec.STASH_RESTORE, self.contexts[0].index):
            self._stashing.restore_embedding_weights()


def _execute_pending_stashes(pipeline: TrainPipelineSparseDistEmbStash[Any, Any]) -> None:
    pipeline._stashing.execute_pending_stashes()


def _restore_embedding_weights(pipeline: TrainPipelineSparseDistEmbStash[Any, Any]) -> None:
    pipeline._restore_now()
