"""EvalPipelineSparseDist: forward only, with the host-to-device copy on a loader thread.

[Note: recording the loader's copies]
The schedule recorder is written only by the thread that calls ``progress()``,
so it needs no lock and its order is that thread's order of calls.  The loader
thread never touches it: the ``progress()`` call that takes batch ``k`` from
the loader records ``H2D[ik]@memcpy`` with ``thread="loader"``, just before its
first action on that batch.  The copy stands where the schedule first depends
on it, not at the moment the loader issued it, which varies from run to run;
so the recorded sequence is the same on every run.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Iterator, Optional, Tuple

import torch
from torchrec.distributed.train_pipeline import In, Out

from trec_pipelines import recorder as rec
from trec_pipelines.handoff import OneSlotHandoff
from trec_pipelines.pipelines._common import predictions
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist
from trec_pipelines.rewrite import Strategy
from trec_pipelines.stages import BatchSource, copy_to_device

# A loaded batch and its index in the order of loading.
Loaded = Tuple[Any, int]

# The thread name the loader's copies are recorded under.
_LOADER_THREAD = "loader"


class _BatchLoader:
    """A daemon thread that loads batches and copies them to the device, one ahead.

    ``load`` returns the next batch already on the device, or ``None`` at the
    end of the data.  The thread leaves each batch in a one-batch hand-over
    slot and loads the next only once :meth:`take` has emptied it, so it holds
    at most one batch.  It ends at the end of the data, on the first exception
    ``load`` raises (kept for :meth:`take`), or when :meth:`stop` is called;
    it never calls ``load`` again after any of these.

    ``load`` must not hold the pipeline: the pipeline stops the thread when it
    is collected, which it could not be while the thread kept it alive.
    """

    def __init__(self, load: Callable[[], Optional[Loaded]]) -> None:
        self._handoff: OneSlotHandoff[Loaded] = OneSlotHandoff()
        self._thread = threading.Thread(
            target=self._handoff.produce, args=(load,), name="trec_pipelines-loader", daemon=True
        )
        self._thread.start()

    def take(self) -> Optional[Loaded]:
        """The next batch, waiting for it; ``None`` once the data has ended.

        An exception raised by ``load`` is raised here once, after every batch
        loaded before it has been taken; later calls return ``None``.
        """
        try:
            loaded = self._handoff.take()
        except BaseException:
            self._thread.join()  # it has finished: this only reaps it
            raise
        if loaded is None:
            self._thread.join()
        return loaded

    def stop(self, wait: bool = True) -> None:
        """End the thread, dropping a batch it holds.

        With ``wait`` return only once it has ended, which takes as long as a
        ``next()`` already under way; without, it ends after that call.
        """
        self._handoff.stop()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()


def _load_and_copy(
    source: BatchSource,
    iterator: Iterator[Any],
    device: torch.device,
    stream: Optional[torch.Stream],
    inplace: bool,
) -> Optional[Loaded]:
    """The loader thread's work for one batch: pull it, copy it on ``stream``."""
    batch = source.next(iterator)
    if batch is None:
        return None
    return copy_to_device(batch, device, stream, inplace), source.last_index


class EvalPipelineSparseDist(TrainPipelineSparseDist[In, Out]):
    """Forward only; ``cur`` runs while ``nxt`` is in input_dist and a loader thread copies.

    ============  ==========  ================================================
    stream        slot        work
    ============  ==========  ================================================
    default       ``cur``     wait, forward under ``torch.no_grad()``
    data_dist     ``nxt``     input_dist
    memcpy        loader      host-to-device copy of the batch after ``nxt``,
                              issued by the loader thread
    ============  ==========  ================================================

    Two batches are in flight in the pipeline (``cur`` and ``nxt``); the
    loader thread holds at most one more, the one it is loading or has loaded,
    and starts on the next when ``progress()`` takes it.  There is no
    zero_grad, backward or optimizer step, and the model's mode is left as the
    caller set it (call ``model.eval()`` first).  ``optimizer`` is accepted for
    torchrec compatibility, unused, and may be ``None``.

    ``progress()`` returns the model's predictions: for a model returning
    ``(loss, pred)`` (any 2-tuple), ``pred``, as torchrec does; for any other
    output (a tensor, a dict, a list), the output itself.

    Loader thread: started by the first ``progress()`` of an epoch on the
    iterator passed to it, which it reads until the end (an iterator passed
    later in the epoch is ignored, with a warning).  An exception the iterator
    raises reaches the ``progress()`` call that needs the next batch, after
    every batch before it was returned; the batches in flight then still run
    on the next calls, which end with ``StopIteration``.  The thread ends at
    the end of the data, on ``reset()`` (which drops the batches in flight and
    the one the loader holds) and when the pipeline is collected.  As in the
    other variants, the next epoch starts without ``reset()``.

    Schedule recording: the loader's copy of batch ``k`` is recorded as
    ``H2D[ik]@memcpy`` with ``thread="loader"`` by the ``progress()`` call that
    takes the batch, just before that call's first action on it (see
    [Note: recording the loader's copies]).

    Same constructor as torchrec 1.8.0's ``EvalPipelineSparseDist`` (plus
    ``rewrite_strategy``).  Differences, all fixes: our own loader thread,
    which is joined instead of abandoned, hands every batch over exactly once
    and does not skip batches on retryable errors; forward under ``no_grad``;
    predictions-only models work; the first batch's input_dist is started once,
    not twice; a new epoch starts without ``reset()``.

    Example::

        model.eval()
        pipeline = EvalPipelineSparseDist(dmp_model, None, device)
        it = iter(dataloader)
        while True:
            try:
                predictions = pipeline.progress(it)
            except StopIteration:
                break
    """

    _requires_optimizer = False
    _retries_failed_steps = False

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        device: torch.device,
        apply_jit: bool = False,
        pipeline_postproc: bool = False,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        rewrite_strategy: Strategy = "auto",
        on_unpipelined: str = "warn",
        sync_exhaustion: bool = False,
        validate_batches: bool = True,
    ) -> None:
        self._loader: Optional[_BatchLoader] = None  # first: __del__ reads it
        self._loader_iter: Optional[Iterator[Any]] = None
        super().__init__(
            model,
            optimizer,  # type: ignore[arg-type]
            device,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            rewrite_strategy=rewrite_strategy,
            on_unpipelined=on_unpipelined,
            sync_exhaustion=sync_exhaustion,
            validate_batches=validate_batches,
        )

    # ----------------------------------------------------------- loader thread

    def _start_loader(self, dataloader_iter: Iterator[Any]) -> _BatchLoader:
        self._loader_iter = dataloader_iter
        device, memcpy = self._device, self._streams.memcpy
        if device.index is None and memcpy is not None:
            # "cuda" means the current device, and a new thread's is device 0:
            # name the one this thread made the memcpy stream on.
            device = memcpy.device
        return _BatchLoader(
            functools.partial(
                _load_and_copy,
                self._source,  # the thread's alone until it is stopped
                dataloader_iter,
                device,
                memcpy,
                self._enable_inplace_copy_batch,
            )
        )

    def _stop_loader(self) -> None:
        if self._loader is not None:
            self._loader.stop()
            self._loader = None
            self._loader_iter = None

    def _take_batch(self) -> bool:
        """Queue the loader's next batch; False once the data has ended."""
        assert self._loader is not None
        loaded = self._loader.take()
        if loaded is None:
            return False
        batch, index = loaded
        # Recorded at the hand-over, see [Note: recording the loader's copies].
        with self._span(rec.H2D, index, "memcpy", _LOADER_THREAD):
            pass
        self.batches.append(batch)
        self.contexts.append(self._context_type(index=index))
        return True

    # --------------------------------------------------------------- schedule

    def _predict(self) -> Any:
        with self._span(rec.FORWARD, self.contexts[0].index):
            with torch.no_grad():
                return predictions(self._model(self.batches[0]))

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        self._begin_call()
        self._take_over_model()  # from a train pipeline sharing the model, if any
        self._ensure_attached()
        if self._loader is None:
            # fill: a new epoch; cur is copied by the loader, then input_dist
            assert not self.batches, "in-flight batches without a loader"
            self._loader = self._start_loader(dataloader_iter)
            if self._take_batch():
                self._init_input_dist(self.batches[0], self.contexts[0])
                self.wait_sparse_data_dist(self.contexts[0])
        elif dataloader_iter is not self._loader_iter:
            # Its loader thread is reading the first iterator: running the new
            # one's steps on those batches would attribute outputs wrongly.
            raise RuntimeError(
                f"{type(self).__name__}.progress() got a different iterator mid-epoch "
                "while its loader thread reads the first one. Pass the same iterator "
                "until StopIteration, or call reset() (dropping the batches in flight) "
                "to switch now."
            )
        has_nxt = self._take_batch()                               # nxt, copied by the loader
        if not self.batches:
            self._stop_loader()
            self._source.end_epoch()
            raise StopIteration
        ctx = self.contexts[0]

        self._wait_for_batch()                                     # cur, data_dist -> default
        if self._clear_data_dist_inputs:
            self.clear_sparse_data_dist_inputs(ctx)
        if has_nxt:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])  # nxt, data_dist
        output = self._predict()                                   # cur, default, no_grad
        if has_nxt:
            self.wait_sparse_data_dist(self.contexts[1])           # nxt, data_dist
        self.dequeue_batch()
        return output

    # ------------------------------------------------------------ lifecycle

    def reset(self) -> None:
        """Stop the loader and drop the batches in flight; the next ``progress()`` starts an epoch."""
        self._stop_loader()
        super().reset()

    def __del__(self) -> None:
        # Only signal: joining from a finalizer can deadlock at interpreter
        # exit, when daemon threads no longer run.
        if self._loader is not None:
            self._loader.stop(wait=False)
