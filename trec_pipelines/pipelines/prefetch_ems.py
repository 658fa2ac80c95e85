"""TrainPipelinePrefetchEMS: EmbStash; stashed caches restored and the next batch prefetched before the backward."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterator, Optional, Tuple, Type, Union

import torch
from torchrec.distributed.train_pipeline import In, Out
from torchrec.distributed.train_pipeline.types import PipelineState
from torchrec.distributed.types import NoWait
from typing_extensions import Unpack

from trec_pipelines.assembly.options import SparseDistTrainOptions, takes_options
from trec_pipelines.core.step_guard import guarded_step
from trec_pipelines.core.streams import current_stream, on_stream, record_stream, wait_stream
from trec_pipelines.model.backward_hooks import InjectionSite
from trec_pipelines.model.context import TrainPipelineContext
from trec_pipelines.observe import recorder as rec
from trec_pipelines.pipelines.stash import TrainPipelineSparseDistEmbStash
from trec_pipelines.sparse.cache_prefetch import NO_CACHE_KERNELS, reads_a_cache

logger: logging.Logger = logging.getLogger(__name__)


@takes_options(SparseDistTrainOptions)
class TrainPipelinePrefetchEMS(TrainPipelineSparseDistEmbStash[In, Out]):
    """EmbStash for tables behind a UVM cache: the cache is stashed, then restored and refilled.

    ==========  =======  ==========================================================
    stream      slot     work
    ==========  =======  ==========================================================
    default     ``cur``  zero_grad, wait, forward (stash inside), restore
                         (``cur``) and prefetch (``nxt``), backward, step
    data_dist   ``nxt``  input_dist
    memcpy      ``new``  host-to-device copy
    ==========  =======  ==========================================================

    torchrec's experimental class (``experimental_pipelines``).  Three batches in
    flight, in :class:`TrainPipelineSparseDist`'s slots; ``nxt``'s input dist is waited for
    before ``cur``'s backward, for the prefetch, and its forward then finds it
    done.

    For a table in ``fused_uvm_caching`` the device memory is the cache, not
    the weights: the sharded module stashes it inside the forward (flushing
    dirty rows to the UVM weights first) on the device-to-host stream, so the
    dense forward and backward have that memory.  Before the backward the
    pipeline restores the stashed weights and caches of ``cur`` and prefetches
    ``nxt``'s rows into the cache, on the current stream.  The restore and the
    prefetch run in eval mode too (the forward stashed).  A module without a
    cache (every kernel of
    :data:`~trec_pipelines.sparse.cache_prefetch.NO_CACHE_KERNELS`) has nothing to
    prefetch: it is left out, and its input dist for ``nxt`` keeps overlapping
    the backward.  On CPU nothing is stashed, and the results are
    SparseDist's, bit for bit.

    Differences from torchrec: :ref:`the migration guide <migrating-prefetch-ems>` (docs/guides/migrating.md).

    Example::

        pipeline = TrainPipelinePrefetchEMS(
            dmp_model, optimizer, device, site_fqn="over_arch"
        )
        it = iter(dataloader)
        output = pipeline.progress(it)  # one batch a call, until StopIteration

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
    """

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
        **options: Unpack[SparseDistTrainOptions],
    ) -> None:
        super().__init__(
            model,
            optimizer,
            device,
            site_fqn,
            execute_all_batches,
            apply_jit,
            context_type,
            pipeline_postproc,
            custom_model_fwd,
            dmp_collection_sync_interval_batches,
            enqueue_batch_after_forward,
            enable_inplace_copy_batch,
            free_features_storage_early,
            **options,
        )
        # Per pipelined module: whether it has a cache for the prefetch to fill.
        self._cache_readers: Dict[str, bool] = {}

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
        if len(self.batches) >= 2:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])  # nxt, data_dist
        if not self._enqueue_batch_after_forward:
            self.enqueue_batch(dataloader_iter)                    # new, memcpy
        losses, output = self._forward()                           # cur, default (stash inside)
        if self._enqueue_batch_after_forward:
            self.enqueue_batch(dataloader_iter)                    # new, memcpy (after lookup)
        if len(self.batches) >= 2:
            self.wait_sparse_data_dist(self.contexts[1])           # nxt, data_dist
        self._restore_and_prefetch()                               # cur, default; nxt, data_dist
        if training:
            self._enter_phase(PipelineState.CALL_BWD)
            self._backward(losses)                                 # cur, default
            self.sync_embeddings(
                self._model, self._dmp_collection_sync_interval_batches, self.contexts[0]
            )
            self._optimizer_step()                                 # cur, default
        self.dequeue_batch()
        return output

    def _reads_a_cache(self, name: str, module: Any) -> bool:
        """Whether ``module`` has a cache to prefetch into (decided once per module).

        A module without one (HBM or UVM tables, no cache) is left out of the
        prefetch, so its input dist for ``nxt`` is not waited for before the
        backward: it keeps overlapping the backward as in SparseDist.  Same
        results (its prefetch would do nothing); torchrec's class waits anyway.
        """
        known = self._cache_readers.get(name)
        if known is None:
            known = self._cache_readers[name] = reads_a_cache(module)
            if not known:
                logger.info(
                    "%s: %r reads no cache (its kernels are %s only); its next input dist "
                    "is not waited for to prefetch, and overlaps the backward",
                    type(self).__name__,
                    name,
                    "/".join(sorted(NO_CACHE_KERNELS)),
                )
        return known

    def _restore_and_prefetch(self) -> None:
        """Bring ``cur``'s stashed rows back, then prefetch ``nxt``'s (torchrec's hook,
        honoured: after ``nxt``'s input_dist, before ``cur``'s backward)."""
        self._restore_cur()  # cur, default
        if len(self.batches) >= 2:
            self._prefetch_nxt()  # nxt, data_dist -> default

    def _restore_cur(self) -> None:
        """Bring back what ``cur``'s forward stashed: weights, then UVM caches."""
        with self._recording.span(rec.STASH_RESTORE, self.contexts[0].index):
            self._stashing.restore_embedding_weights()
            self._stashing.restore_cache()

    def _prefetch_nxt(self) -> None:
        """Prefetch ``nxt``'s rows into the caches, on the current stream.

        ``nxt``'s tensors all-to-all is waited for on the data_dist stream and
        left in its context already done, so ``nxt``'s forward takes it as is.
        """
        context = self.contexts[1]
        here = current_stream(self._device)
        with self._recording.span(rec.EMB_PREFETCH, context.index):
            for name, module, _ in self._pipelined.input_dist_modules():
                request = context.input_dist_tensors_requests.get(name)
                if request is None or not self._reads_a_cache(name, module):
                    continue  # no cache to fill: nxt's input dist stays in flight
                with on_stream(self._streams.data_dist):
                    dist_input = request.wait()
                context.input_dist_tensors_requests[name] = NoWait(dist_input)
                wait_stream(here, self._streams.data_dist)
                record_stream(dist_input, here)
                module.prefetch(dist_input=dist_input, ctx=context.module_contexts.get(name))
