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
    new iterator or the same one refilled.  Our keyword-only options are listed at the end
    and in the :doc:`options guide </guides/options>`.

    Differences from torchrec: :ref:`the migration guide <migrating-base>` (docs/guides/migrating.md).

    Example::

        pipeline = TrainPipelineBase(model, optimizer, torch.device("cuda"))
        it = iter(dataloader)
        while True:
            try:
                output = pipeline.progress(it)
            except StopIteration:
                break

    torchrec's parameters, in torchrec's order:

    Args:
        model: The model: its forward takes a batch on ``device`` and, in a training pipeline,
            returns ``(losses, output)`` (the eval pipelines also take a model that returns
            predictions alone). Usually a ``DistributedModelParallel``, whose sharded modules'
            input_dist the pipeline runs ahead; a model without sharded modules trains unpipelined
            (logged).
        optimizer: The optimizer over the parameters the backward does not update itself (not the
            fused, in-backward embedding optimizer), stepped once per trained batch. The eval
            pipelines take ``None``.
        device: The device batches are copied to and the model runs on: a ``torch.device`` or a
            string naming one (``"cuda:0"``, ``"cpu"``).
        custom_model_fwd: A function of the device batch called instead of ``model(batch)``,
            returning ``(losses, output)`` as the forward would; ``None``: the model's forward.
        enable_inplace_copy_batch: Copy each batch into device memory allocated on the default
            stream, the copy itself on the memcpy stream (no ``record_stream`` needed); ``False``:
            ``batch.to(device)`` on the memcpy stream.

    Our keyword-only options (each described in the options guide):

    * ``sync_exhaustion``: The ranks agree on every batch they pull, so data that ends on one rank
      first ends every rank's epoch at the same step (an eval pipeline pads until every rank's data
      ended instead: ``uneven_data``), and a batch malformed on one rank is dropped on all. None
      (the default) agrees whenever the model's steps join collectives across ranks; True insists
      (and needs torch.distributed); False turns it off.
    * ``agree_ahead``: With the ranks agreeing on each batch (``sync_exhaustion``), pull one host
      batch a step ahead so its agreement rides the current step's exchange, at the cost of one more
      host batch held (pulled from the iterator, not yet copied to the device; see the memory
      guide). False holds none: each pull is agreed as it is made, with a blocking round trip of its
      own on a gloo group. No effect without the agreement.
    * ``validate_batches``: Check each host batch's KeyedJaggedTensors as it is pulled: a malformed
      one raises ``MalformedBatchError`` before any work is issued for it.
    * ``autocast_dtype``: Run each training forward under ``torch.autocast`` on the pipeline's
      device with this dtype (``torch.bfloat16``, or ``torch.float16`` on CUDA); None runs it as the
      model is.
    * ``grad_scaler``: A ``torch.amp.GradScaler``: the backward scales the summed loss, and the
      optimizer steps through the scaler (unscale, skip the step on inf or nan, update the scale).
      The fused (in-backward) embedding optimizers see the scaled gradients: see the options guide.
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
        host = self._source.next(dataloader_iter)
        if host is None:
            self._cur_batch = None
        else:
            self._copy_batch_to_gpu(host)
        self._connected = True

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

        ``dataloader_iter`` is an iterator (``iter(dataloader)``, not the data loader
        itself), the same one for every call of an epoch.  A training step runs the
        forward, the backward of ``torch.sum(losses, dim=0)`` and the optimizer step
        (the forward alone when the model is in eval mode) and returns the second
        element of the forward's ``(losses, output)``; the class docstring shows what
        else the step overlaps.  At the end of the data it raises ``StopIteration``;
        calling it again then starts a new epoch, with a new iterator or the same one
        refilled (a spent iterator ends again at once).  A step that raises is rolled
        back: the next call retries the same batch, and :meth:`skip_failed_batch`
        drops it instead.  With several ranks, call it on every rank alike.
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
        host = self._source.next(dataloader_iter)                  # nxt, host
        if host is None:
            self._cur_batch = None
        else:
            self._copy_batch_to_gpu(host)                          # nxt, memcpy
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
