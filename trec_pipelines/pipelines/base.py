"""TrainPipelineBase: the batch's host-to-device copy overlapped with compute."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torchrec.distributed.train_pipeline import In, Out, TrainPipeline

from trec_pipelines import recorder as rec
from trec_pipelines._types import AnyShardedModule
from trec_pipelines.agreement import agreement_group
from trec_pipelines.pipelines._common import check_device, check_model_device, check_optimizer
from trec_pipelines.recorder import Recordable
from trec_pipelines.resume import Resumable
from trec_pipelines.stages import (
    BatchSource,
    ParkedEpochs,
    backward,
    copy_to_device,
    wait_for_batch,
)
from trec_pipelines.step_guard import StepGuard, guarded_step, skip_failed_batch
from trec_pipelines.streams import make_streams
from trec_pipelines.takeover import take_model_over

logger: logging.Logger = logging.getLogger(__name__)


class TrainPipelineBase(TrainPipeline[In, Out], Recordable, Resumable):
    """Two batches in flight: batch ``i`` trains while batch ``i+1`` is copied.

    ===========  =======  =========================================
    stream       slot     work
    ===========  =======  =========================================
    default      ``cur``  zero_grad, wait, forward, backward, step
    memcpy       ``nxt``  host-to-device copy
    ===========  =======  =========================================

    ``cur`` is the batch being trained and ``nxt`` the one on its way to the
    device.  The copy of ``nxt`` is issued right after the forward of ``cur``,
    so on a GPU it overlaps the backward and the optimizer step.

    The model runs its own forward (or ``custom_model_fwd``); no module is
    rewritten.  Each ``progress()`` pulls its host batch before issuing any
    work, so an error from the iterator reaches the caller with the pipeline
    untouched.  A step that raises is rolled back and the next call retries its
    batch (:meth:`skip_failed_batch` drops one that fails every time).  In eval
    mode (``model.eval()``) a step is the forward only.  After
    ``StopIteration``, calling ``progress()`` again starts a new epoch, with a
    new iterator or the same one refilled.  Our keyword-only options
    (``sync_exhaustion``, ``validate_batches``) are described in the
    :doc:`options guide </guides/options>`.

    Differences from torchrec: :ref:`the migration guide <migrating-base>` (docs/guides/migrating.md).

    Example::

        pipeline = TrainPipelineBase(model, optimizer, torch.device("cuda"))
        it = iter(dataloader)
        while True:
            try:
                output = pipeline.progress(it)
            except StopIteration:
                break
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        custom_model_fwd: Optional[Callable[[Any], Tuple[torch.Tensor, List[torch.Tensor]]]] = None,
        enable_inplace_copy_batch: bool = False,
        *,
        sync_exhaustion: bool = False,
        validate_batches: bool = True,
    ) -> None:
        super().__init__()
        check_optimizer(optimizer, type(self).__name__)
        check_model_device(model, device, type(self).__name__)
        self._model = model
        self._optimizer = optimizer
        self._device = check_device(device, type(self).__name__)
        self._model_fwd: Callable[[Any], Tuple[torch.Tensor, Any]] = custom_model_fwd or model
        self._enable_inplace_copy_batch = enable_inplace_copy_batch
        self._streams = make_streams(device, memcpy=True)
        self._source = BatchSource(
            agreement_group(self, model, sync_exhaustion),
            keep_in_flight=True,
            validate=validate_batches,
        )
        self._step_guard = StepGuard()
        self._cur_batch: Optional[Any] = None
        self._cur_index = 0
        self._connected = False
        # The in-flight batch of an iterator set aside by a switch.
        self._parked = ParkedEpochs()
        # The model's sharded modules, found once (see _take_over_model).
        self._sharded: Optional[Dict[str, AnyShardedModule]] = None

    def _copy(self, iterator: Iterator[Any]) -> None:
        """Load the next batch and issue its copy on the memcpy stream."""
        batch = self._source.next(iterator)
        index = self._source.last_index
        if batch is None:
            self._cur_batch = None
            return
        with self._span(rec.H2D, index, "memcpy"):
            self._cur_batch = copy_to_device(
                batch, self._device, self._streams.memcpy, self._enable_inplace_copy_batch
            )
        self._cur_index = index

    @guarded_step
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        self._begin_call()
        self._take_over_model()
        self._switch_iterator(dataloader_iter)
        # Pull the host batches this call copies before any work: an iterator
        # error then reaches the caller with the pipeline untouched.
        self._source.fetch_ahead(dataloader_iter, 1 if self._connected else 2)
        self._step_guard.begin()  # from here a failure is rolled back and retried
        if not self._connected:
            self._copy(dataloader_iter)  # fill: the first batch's copy
            self._connected = True
        cur, i = self._cur_batch, self._cur_index
        if cur is None:
            self._end_epoch()
            raise StopIteration
        training = self._model.training
        if training:
            with self._span(rec.ZERO_GRAD, i):
                self._optimizer.zero_grad()
        with self._span(rec.WAIT_BATCH, i):  # memcpy -> default
            wait_for_batch(cur, self._streams.memcpy, record=not self._enable_inplace_copy_batch)
        with self._span(rec.FORWARD, i):
            losses, output = self._model_fwd(cur)
        del cur  # from here only autograd holds what it saved of cur's input
        self._copy(dataloader_iter)  # nxt: H2D on memcpy, overlaps backward + step
        if training:
            with self._span(rec.BACKWARD, i):
                backward(losses)
            with self._span(rec.OPTIMIZER_STEP, i):
                self._optimizer.step()
        return output

    def _switch_iterator(self, dataloader_iter: Iterator[Any]) -> None:
        """Park the previous iterator's in-flight batch when another is passed,
        and resume it when that iterator comes back (as SparseDist does)."""
        source = self._source
        if dataloader_iter is source.iterator:
            return
        previous = source.iterator
        if (
            previous is not None
            and self._connected
            and (self._cur_batch is not None or source.holding)
        ):
            logger.warning(
                "%s: a different iterator was passed mid-epoch; the previous one's "
                "in-flight batch is parked and resumes when it is passed again",
                type(self).__name__,
            )
            self._parked.park(previous, (self._cur_batch, self._cur_index, source.save()))
            self._cur_batch, self._connected = None, False
        parked = self._parked.resume(dataloader_iter)
        if parked is not None:
            self._cur_batch, self._cur_index, state = parked
            source.restore(state)
            self._connected = True

    def _drop_in_flight_state(self) -> None:
        """Forget the in-flight device batch; the step guard gives the host
        batches back (see :mod:`trec_pipelines.step_guard`)."""
        self._cur_batch, self._connected = None, False

    def _take_over_model(self) -> None:
        """Detach any pipeline left attached to the model (an eval pipeline whose
        data ended): its forward wrappers would otherwise take this step's forward
        for one of its batches (see :mod:`trec_pipelines.takeover`)."""
        self._sharded = take_model_over(self, self._model, self._sharded)

    def skip_failed_batch(self) -> int:
        """Drop the batch the last, failed ``progress()`` was training (see
        :meth:`TrainPipelineSparseDist.skip_failed_batch`); returns its index."""
        return skip_failed_batch(self)

    def _end_epoch(self) -> None:
        self._connected = False
        self._source.end_epoch()

    def reset(self) -> None:
        """Forget the in-flight (and parked) batches; the next ``progress()`` starts a new epoch."""
        self._cur_batch = None
        self._parked.clear()
        self._source.drop_in_flight()
        self._step_guard.failed = None
        self._end_epoch()
