"""TrainPipelineBase: the batch's host-to-device copy overlapped with compute."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
from torchrec.distributed.train_pipeline import In, Out, TrainPipeline
from typing_extensions import Unpack

from trec_pipelines.assembly.options import TrainBatchOptions, takes_options
from trec_pipelines.assembly.pipeline import PipelineCore
from trec_pipelines.core.step_guard import guarded_step
from trec_pipelines.core.streams import copy_to_device, make_streams, wait_for_batch
from trec_pipelines.core.subclass_hooks import never_called
from trec_pipelines.observe import recorder as rec

logger: logging.Logger = logging.getLogger(__name__)


@takes_options(TrainBatchOptions)
class TrainPipelineBase(PipelineCore, TrainPipeline[In, Out]):
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
    new iterator or the same one refilled.

    Differences from torchrec: :ref:`the migration guide <migrating-base>` (docs/guides/migrating.md).

    Example::

        pipeline = TrainPipelineBase(model, optimizer, torch.device("cuda"))
        it = iter(dataloader)
        output = pipeline.progress(it)  # one batch a call, until StopIteration

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
    """

    _traits = PipelineCore._traits.updated(
        hooks={
            "sync_embeddings": never_called("TrainPipelineBase", "nothing (call it yourself)"),
        },
    )

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        custom_model_fwd: Optional[Callable[[Any], Tuple[torch.Tensor, List[torch.Tensor]]]] = None,
        enable_inplace_copy_batch: bool = False,
        **options: Unpack[TrainBatchOptions],
    ) -> None:
        super().__init__()
        self._init_core(model, optimizer, device, options)
        self._model_fwd = custom_model_fwd or model
        self._enable_inplace_copy_batch = enable_inplace_copy_batch
        self._streams = make_streams(self._device, memcpy=True)
        self._cur_batch: Optional[Any] = None
        self._cur_index = 0
        self._training = 0  # the index of the batch this step trains
        self._connected = False
        self._batch_count = 0  # steps that trained a batch (torchrec's counter)
        # The epoch ended: the next step starts a new one.  ``_connected`` stays
        # True until then, as torchrec's reads after the end.
        self._epoch_ended = False

    # ------------------------------------------------------------ torchrec's hooks

    def _connect(self, dataloader_iter: Iterator[Any]) -> None:
        """The first batch of an epoch, copied (torchrec's hook, honoured: the first
        ``progress()`` of each epoch calls it)."""
        self._copy_next_batch(dataloader_iter)
        self._connected = True

    def _copy_next_batch(self, dataloader_iter: Iterator[Any]) -> None:
        """Pull the next host batch and copy it (it becomes ``cur``); at the end of
        the data ``cur`` is None."""
        host = self._source.next(dataloader_iter)
        if host is None:
            self._cur_batch = None
        else:
            self._copy_batch_to_gpu(host)

    def _copy_batch_to_gpu(self, cur_batch: Any) -> None:
        """Issue the copy of host batch ``cur_batch`` on the memcpy stream; it becomes
        the batch the next step trains (torchrec's hook, honoured: after the forward)."""
        index = self._source.last_index
        with self._recording.span(rec.H2D, index, "memcpy"):
            self._cur_batch = copy_to_device(
                cur_batch, self._device, self._streams.memcpy, self._enable_inplace_copy_batch
            )
        self._cur_index = index

    def _wait_for_batch(self, cur_batch: Any) -> None:
        """Order the default stream after ``cur_batch``'s copy (torchrec's hook, honoured)."""
        with self._recording.span(rec.WAIT_BATCH, self._cur_index):  # memcpy -> default
            wait_for_batch(
                cur_batch, self._streams.memcpy, record=not self._enable_inplace_copy_batch
            )

    def _backward(self, losses: torch.Tensor) -> None:
        """The backward of the summed per-sample losses, through ``grad_scaler`` if any
        (torchrec's hook, honoured)."""
        with self._recording.span(rec.BACKWARD, self._training):
            self._precision.backward(torch.sum(losses, dim=0))

    def _optimizer_step(self) -> None:
        """The optimizer step, through ``grad_scaler`` if any (ours calls it where
        torchrec's Base calls ``optimizer.step()`` itself, so an override takes effect)."""
        with self._recording.span(rec.OPTIMIZER_STEP, self._training):
            self._precision.step(self._optimizer)

    def _reset_data_iter(self) -> None:
        """Forget the epoch's copied batch (torchrec's hook, honoured: ``reset()`` calls it)."""
        self._cur_batch, self._connected = None, False

    def reset(self) -> None:
        super().reset()
        self._epoch_ended = True
        self._reset_data_iter()

    # --------------------------------------------------------------- schedule

    @guarded_step
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one step on the next batch of ``dataloader_iter``; return its output.

        What every ``progress()`` does: :class:`~trec_pipelines.PipelineOptions`.
        """
        # See [Note: a progress() timeline] in trec_pipelines.pipelines.
        # fmt: off
        if self._epoch_ended:  # the fill of the new epoch copies its first batch
            self._epoch_ended = self._connected = False
        self._start_step(dataloader_iter)  # take-over, iterator switch, host batches
        if not self._connected:
            self._connect(dataloader_iter)                         # cur, memcpy (fill)
        if self._source.end.stopped_from_outside and self._cur_batch is not None:
            # _data_iter_stopped written from outside after cur was copied: as
            # torchrec's, cur is not trained.
            self._cur_batch = None
            self._source.drop_in_flight()
        cur, i = self._cur_batch, self._cur_index
        self._training = i  # the copy of nxt below moves _cur_index on
        if cur is None:
            self._epoch_ended = True  # the next step starts a new epoch
            self._source.end_epoch()
            raise StopIteration
        self._batch_count += 1
        training = self._model.training
        if training:
            with self._recording.span(rec.ZERO_GRAD, i):
                self._optimizer.zero_grad()                        # cur, default
        self._wait_for_batch(cur)                                  # cur, memcpy -> default
        with self._recording.span(rec.FORWARD, i), self._precision.autocast():
            losses, output = self._call_forward(cur)               # cur, default
        del cur  # from here only autograd holds what it saved of cur's input
        self._copy_next_batch(dataloader_iter)                     # nxt, host -> memcpy
        if training:
            self._backward(losses)                                 # cur, default
            self._optimizer_step()                                 # cur, default
        return output
        # fmt: on

    def _batches_to_fetch(self) -> int:
        return 1 if self._connected else 2  # the fill copies cur too

    def _in_flight(self) -> int:
        return int(self._connected and self._cur_batch is not None)

    def _set_aside(self) -> Tuple[Optional[Any], int, bool]:
        state = (self._cur_batch, self._cur_index, self._connected)
        self._cur_batch, self._connected = None, False
        return state

    def _bring_back(self, state: Tuple[Optional[Any], int, bool]) -> None:
        self._cur_batch, self._cur_index, self._connected = state
