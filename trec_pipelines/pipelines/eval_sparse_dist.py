"""EvalPipelineSparseDist: forward only, the host-to-device copy on a loader thread or inline.

[Note: recording the loader's copies]
The schedule recorder is written only by the thread that calls ``progress()``,
so it needs no lock and its order is that thread's order of calls.  The copy
of batch ``k`` is recorded as ``H2D[ik]@memcpy`` by the ``progress()`` call
that takes the batch, just before that call's first action on it:

* inline (no loader thread), around the copy itself, with ``thread="main"``:
  the training thread issues it there, and the span times it;
* with a loader thread, which never touches the recorder, as an empty span at
  the hand-over, with ``thread="loader"``.  The copy stands where the schedule
  first depends on it, not at the moment the thread issued it, which varies
  from run to run.

So the recorded sequence is the same on every run and in both modes; only the
thread label of the ``H2D`` actions tells them apart.

[Note: a failed eval step]
Both eval pipelines (this one and EvalPipelineFusedSparseDist) run each
``progress()`` inside the step guard, as the train pipelines do (see
:mod:`trec_pipelines.core.step_guard`).  When a step raises after it began
issuing work (the forward, an input_dist, a lookup), it is rolled back and the
next ``progress()`` evaluates the same batch again from its host copy, then
goes on; ``skip_failed_batch()`` drops that batch instead.  The forward runs
under ``no_grad`` and changes nothing, so the retry returns what the failed
step would have returned.  Going on with the next batch is not an option: the
failed step may have stopped anywhere (``nxt``'s input_dist started and not
waited, ``cur``'s lookup issued), and none of that can be resumed where it
stopped; the rollback issues it all again.  With several ranks the failure
is told to the others, which end within seconds naming this rank and the
batch, and a retry goes on only where every rank failed at that batch
(``[Note: a failed step on one rank]`` in :mod:`trec_pipelines.core.peer_failure`).

What a failed step leaves behind here: no batch on the device and no loader.
The loader is stopped once it is idle (a loader thread first finishes the
pull or copy it is in), so every batch it pulled, the one it holds included,
is listed in flight in the source, and the guard gives them all back, in
order.  The next ``progress()`` starts a loader on the same iterator (the
epoch goes on), which hands those batches out first, then pulls on.  An error
the stopped loader thread had met and not handed over yet (the iterator's, a
malformed batch) is raised by the new one right after those batches, where
the stopped one would have raised it: both modes still give the same
batches, results and errors.

The loading's own errors are not a failed step
(:meth:`~trec_pipelines.core.step_guard.StepGuard.leave_as_is`): as before,
an error loading a batch reaches the call that needs it and ends the loading
(the batches in flight still come out; a malformed batch is only dropped),
with nothing rolled back.  With several ranks the ranks agree on each pull,
so every rank raises in the same call.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    ContextManager,
    Iterator,
    Optional,
    Tuple,
    Union,
    cast,
)

import torch
from torchrec.distributed.train_pipeline import In, Out
from typing_extensions import Unpack

from trec_pipelines.assembly.options import EvalSparseDistOptions, takes_options
from trec_pipelines.assembly.resume import ResumeHooks
from trec_pipelines.core import lifetime
from trec_pipelines.core.checks import predictions
from trec_pipelines.core.errors import MalformedBatchError
from trec_pipelines.core.step_guard import guarded_step
from trec_pipelines.core.streams import copy_to_device, has_streams
from trec_pipelines.core.subclass_hooks import never_called
from trec_pipelines.data.one_slot_handoff import OneSlotHandoff
from trec_pipelines.data.padding import first_real_output, unwrap
from trec_pipelines.data.source import BatchSource
from trec_pipelines.data.validation import shares_kjt_storage, warn_shared_features
from trec_pipelines.observe import recorder as rec
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist

# A loaded batch, its index in the order of loading, and whether it pads
# (see [Note: padding uneven eval data] in trec_pipelines.data.padding).
Loaded = Tuple[Any, int, bool]
# A batch on the device, its index, whether it still uses the loader's
# storage (it was on the device already; see shares_kjt_storage), and whether it pads.
Copied = Tuple[Any, int, bool, bool]

# Opens a schedule-recorder span: (task, batch index, stream role, thread label).
SpanFactory = Callable[[str, Optional[int], str, str], ContextManager[None]]

# The thread labels the copies are recorded under, and the loader thread's name.
_MAIN_THREAD = "main"
_LOADER_THREAD = "loader"
LOADER_THREAD_NAME = "trec_pipelines-loader"


@dataclass(frozen=True)
class _Load:
    """One epoch's loading: pull from ``iterator`` through ``source``, copy on ``stream``."""

    source: BatchSource
    iterator: Iterator[Any]
    device: torch.device
    stream: Optional[torch.Stream]
    inplace: bool
    free_features: bool = False  # free_features_storage_early: check for shared storage

    def pull(self) -> Optional[Loaded]:
        """The next host batch, its index and whether it pads; ``None`` at the end of the data."""
        batch = self.source.next(self.iterator)
        if batch is None:
            return None
        host, padding = unwrap(batch)
        return host, self.source.last_index, padding

    def copy(self, host: Any) -> Tuple[Any, bool]:
        """Issue ``host``'s host-to-device copy on ``stream``: the device batch, and
        whether it still uses ``host``'s storage."""
        batch = copy_to_device(host, self.device, self.stream, self.inplace)
        return batch, self.free_features and shares_kjt_storage(host, batch)

    def __call__(self) -> Optional[Copied]:
        """The loader thread's work for one batch: pull it, copy it."""
        pulled = self.pull()
        if pulled is None:
            return None
        host, index, padding = pulled
        batch, shared = self.copy(host)
        return batch, index, shared, padding


class _BatchLoader:
    """A daemon thread that loads batches and copies them to the device, one ahead.

    ``load`` returns the next batch already on the device, or ``None`` at the
    end of the data.  The thread leaves each batch in a one-batch hand-over
    slot and loads the next only once :meth:`take` has emptied it, so it holds
    at most one batch.  It ends at the end of the data, on the first exception
    ``load`` raises (kept for :meth:`take`), or when :meth:`stop` is called;
    it never calls ``load`` again after any of these.  A malformed batch
    (:class:`~trec_pipelines.core.errors.MalformedBatchError`) does not end it: the
    :meth:`take` that would have got that batch raises the error, and the
    thread goes on with the next one.

    ``load`` must not hold the pipeline: the pipeline stops the thread when it
    is collected, which it could not be while the thread kept it alive.
    """

    def __init__(self, load: _Load, left: Optional[BaseException] = None) -> None:
        self._handoff: OneSlotHandoff[Copied] = OneSlotHandoff(recoverable=(MalformedBatchError,))
        work: Callable[[], Optional[Copied]] = load if left is None else _ThenRaise(load, left)
        self._thread = threading.Thread(
            target=self._handoff.produce, args=(work,), name=LOADER_THREAD_NAME, daemon=True
        )
        self._thread.start()
        # Stopped and joined at interpreter exit if still running (see [Note: a clean exit]).
        lifetime.own_thread(self._thread, self._handoff.stop)

    def take(self, span: SpanFactory) -> Optional[Copied]:
        """The next batch, waiting for it; ``None`` once the data has ended.

        Its copy is recorded through ``span`` at the hand-over (see
        [Note: recording the loader's copies]).  An exception raised by
        ``load`` is raised here once, after every batch loaded before it has
        been taken; later calls return ``None``.
        """
        try:
            loaded = self._handoff.take()
        except MalformedBatchError:
            raise  # dropped; the thread is loading the next batch
        except BaseException:
            self._thread.join()  # it has finished: this only reaps it
            raise
        if loaded is None:
            self._thread.join()
            return None
        with span(rec.H2D, loaded[1], "memcpy", _LOADER_THREAD):
            pass  # issued by the thread already
        return loaded

    def settle(self) -> None:
        """Wait until the thread is idle: it holds its next batch, or it has ended."""
        self._handoff.settle()

    def stop(self, wait: bool = True) -> None:
        """End the thread, dropping a batch it holds.

        With ``wait`` return only once it has ended, which takes as long as a
        ``next()`` already under way; without, it ends after that call.
        """
        self._handoff.stop()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    def stop_for_retry(self) -> Optional[BaseException]:
        """End the thread once it is idle, dropping a batch it holds (the source
        lists it in flight), and return the error it met and :meth:`take` did not
        raise yet, if any (see [Note: a failed eval step])."""
        left = self._handoff.stop_when_idle()
        self._thread.join()
        return left


class _ThenRaise:
    """A loader thread's work after a failed step: the batches the rollback gave
    back first, then the error the stopped thread had not handed over, then on."""

    def __init__(self, load: _Load, left: BaseException) -> None:
        self._load: _Load = load
        self._left: Optional[BaseException] = left

    def __call__(self) -> Optional[Copied]:
        if self._left is not None and not self._load.source.rewound:
            left, self._left = self._left, None
            raise left  # where the stopped thread met it
        return self._load()


class _InlineLoader:
    """:class:`_BatchLoader`'s contract without a thread: :meth:`take` loads the batch itself.

    Loading ends as the thread's does: at the end of the data, on the first
    exception (raised by the :meth:`take` that hit it) other than a malformed
    batch, or on :meth:`stop`; ``load`` is never called again after any of these.
    """

    def __init__(self, load: _Load) -> None:
        self._load: Optional[_Load] = load

    def take(self, span: SpanFactory) -> Optional[Copied]:
        """Pull the next batch and copy it, recorded through ``span``; ``None``
        once the data has ended.  An exception propagates, once."""
        load, self._load = self._load, None  # ended, unless this batch loads
        if load is None:
            return None
        try:
            pulled = load.pull()
        except MalformedBatchError:
            self._load = load  # dropped; the next take() loads the next batch
            raise
        if pulled is None:
            return None
        host, index, padding = pulled
        with span(rec.H2D, index, "memcpy", _MAIN_THREAD):
            batch, shared = load.copy(host)
        self._load = load
        return batch, index, shared, padding

    def settle(self) -> None:
        """Nothing runs between calls (see :meth:`_BatchLoader.settle`)."""

    def stop(self, wait: bool = True) -> None:
        """End loading; ``wait`` is for :class:`_BatchLoader`'s signature (nothing runs)."""
        self._load = None

    def stop_for_retry(self) -> Optional[BaseException]:
        """End loading; nothing is left (every error was raised by :meth:`take`)."""
        self._load = None
        return None


# Either loader: they share ``take(span)``, ``stop(wait)`` and ``stop_for_retry()``.
_Loader = Union[_BatchLoader, _InlineLoader]


# Why torchrec's Eval never calls a hook (see "Subclassing" in the migration guide).
_LOADS_ON_ITS_THREAD = "it pulls and copies each batch on its own loading thread"
_EVALUATES = "it evaluates: no backward, no optimizer step"


class _EvalResume(ResumeHooks):
    pipeline: EvalPipelineSparseDist[Any, Any]

    def settle(self) -> None:
        """Let the loader thread finish the pull it may be in, so every batch it
        took from the iterator is listed in the source for a checkpoint."""
        if self.pipeline._loader is not None:
            self.pipeline._loader.settle()


@takes_options(EvalSparseDistOptions)
class EvalPipelineSparseDist(TrainPipelineSparseDist[In, Out]):
    """Forward only; ``cur`` runs while ``nxt`` is in input_dist, batches copied ahead by a loader.

    ============  ==========  ================================================
    stream        slot        work
    ============  ==========  ================================================
    default       ``cur``     wait, forward under ``torch.no_grad()``
    data_dist     ``nxt``     input_dist
    memcpy        loader      with a loader thread: host-to-device copy of the
                              batch after ``nxt``, issued by the thread
    memcpy        ``nxt``     inline: its host-to-device copy, issued at the
                              top of ``progress()`` just before its input_dist
    ============  ==========  ================================================

    Two batches are in flight in the pipeline (``cur`` and ``nxt``); a loader
    thread holds at most one more, the one it is loading or has loaded, and
    starts on the next when ``progress()`` takes it.  Both modes
    (``loader_thread``) give the same batches, results and errors, and record
    the copy of batch ``k`` as ``H2D[ik]@memcpy`` (with
    ``thread="loader"`` or ``"main"``) just before the call's first action on
    that batch (the note "recording the loader's copies" in the source of
    ``trec_pipelines.pipelines.eval_sparse_dist``).

    There is no zero_grad, backward or optimizer step, and the model's mode is
    the caller's (call ``model.eval()`` first); ``optimizer`` is unused and may
    be ``None``.  ``progress()`` returns the predictions: ``pred`` of a
    ``(loss, pred)`` pair (any 2-tuple), any other output (a tensor, a dict, a
    list) as it is.  An epoch reads the iterator given to its first
    ``progress()`` to the end; another iterator passed mid-epoch raises
    ``RuntimeError`` (finish the epoch or call ``reset()``).  An exception
    raised while loading (the iterator, the copy) reaches the call that needs
    that batch, after every batch before it was returned, and ends the
    loading: the batches in flight still come out, then ``StopIteration``.  A
    malformed batch (``MalformedBatchError``) is only dropped: that call
    raises, the next goes on.  A ``progress()`` that raises after its loading
    (the forward, an input_dist) is rolled back: the next call evaluates that
    batch again (``skip_failed_batch()`` drops it), and with several ranks the
    others end within seconds naming this rank and the batch (the note "a
    failed eval step" in the source of this module).  The loader thread ends
    at the end of the data, on ``reset()`` (which drops the batches in flight
    and the loader's) and when the pipeline is collected; the next epoch
    starts without ``reset()``.

    Differences from torchrec: :ref:`the migration guide <migrating-eval>` (docs/guides/migrating.md).

    Example::

        model.eval()
        pipeline = EvalPipelineSparseDist(dmp_model, None, device)
        it = iter(dataloader)
        predictions = pipeline.progress(it)  # one batch a call, until StopIteration

    Args:
        loader_thread: Ours, keyword-only: ``None`` (default) loads on a thread of its own
            on a device with streams (CUDA, MTIA), where its copy overlaps the forward, and
            inline on CPU, where the thread's Python work would only compete with
            ``progress()`` for the GIL; ``True`` always starts one (for an iterator whose
            loading releases the GIL), ``False`` never does.

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
    """

    # torchrec's class leaves _state IDLE; its Eval loads on its own thread and
    # never pulls through _next_batch.
    _traits = TrainPipelineSparseDist._traits.updated(
        hooks=(
            {
                "_next_batch": never_called(
                    "EvalPipelineSparseDist",
                    "the iterator you pass (wrap it to filter batches)",
                    _LOADS_ON_ITS_THREAD,
                ),
                "_submit_inplace_copy": never_called(
                    "EvalPipelineSparseDist", "the iterator you pass", _LOADS_ON_ITS_THREAD
                ),
                "_shutdown_async_inplace_copy": never_called(
                    "EvalPipelineSparseDist",
                    "nothing: there is no asynchronous copy to shut down",
                    "its finaliser (1.9.2) stops its loading thread only",
                ),
            }
            | {
                hook: never_called(
                    "EvalPipelineSparseDist", "progress(dataloader_iter)", _EVALUATES
                )
                for hook in ("_backward", "_optimizer_step", "sync_embeddings")
            }
            | {
                hook: never_called(
                    "EvalPipelineSparseDist", "progress(dataloader_iter)", _LOADS_ON_ITS_THREAD
                )
                for hook in (
                    "copy_batch_to_gpu",
                    "inplace_copy_batch_to_gpu",
                    "enqueue_batch",
                    "fill_pipeline",
                )
            }
        ),
        tracks_state=False,
        pulls_through_next_batch=False,
        requires_optimizer=False,
        resume=_EvalResume,
    )

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
        loader_thread: Optional[bool] = None,
        **options: Unpack[EvalSparseDistOptions],
    ) -> None:
        self._loader: Optional[_Loader] = None  # first: __del__ reads it
        self._loader_iter: Optional[Iterator[Any]] = None
        # (iterator, error) a loader thread stopped by a failed step had not handed
        # over: the next loader on that iterator raises it (see [Note: a failed eval step]).
        self._loader_left: Optional[Tuple[Iterator[Any], BaseException]] = None
        if loader_thread is not None and not isinstance(loader_thread, bool):
            raise TypeError(
                "loader_thread must be None (a loader thread on devices with streams, "
                f"inline on CPU), True or False, got {loader_thread!r}"
            )
        super().__init__(
            model,
            optimizer,  # type: ignore[arg-type]
            device,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            # uneven_data is ours, not the training parent's: the options are
            # checked against this class (resolve_options reads type(self)).
            **cast(Any, options),
        )
        # Decided as the streams were made above: a thread where copies overlap.
        self._loader_thread: bool = (
            has_streams(self._device) if loader_thread is None else loader_thread
        )
        if self._loader_thread and self._agreement is not None:
            # The loader thread pulls while the steps exchange splits: a pull
            # must not race an exchange for its code, so each is agreed alone.
            self._agreement.no_carrier()

    # ------------------------------------------------------------------ loader

    def _start_loader(self, dataloader_iter: Iterator[Any]) -> _Loader:
        self._loader_iter = dataloader_iter
        device, memcpy = self._device, self._streams.memcpy
        if device.index is None and memcpy is not None:
            # "cuda" means the current device, and a new thread's is device 0:
            # name the one this thread made the memcpy stream on.
            device = memcpy.device
        load = _Load(
            self._source,  # a loader thread's alone until it is stopped
            dataloader_iter,
            device,
            memcpy,
            self._enable_inplace_copy_batch,
            self._free_features_storage_early,
        )
        left, self._loader_left = self._loader_left, None
        if not self._loader_thread:
            return _InlineLoader(load)
        return _BatchLoader(load, left[1] if left and left[0] is dataloader_iter else None)

    def _stop_loader(self) -> None:
        if self._loader is not None:
            self._loader.stop()
            self._loader = None
            self._loader_iter = None

    def _take_batch(self) -> bool:
        """Queue the loader's next batch, on the device; False once the data has ended.

        A loading error is not the step's (see [Note: a failed eval step]): the
        pipeline stays as it is; any error but a malformed batch ends the loading,
        also for a loader started after a later failed step."""
        assert self._loader is not None
        try:
            loaded = self._loader.take(self._recording.span)  # records its H2D
        except MalformedBatchError:
            self._step_guard.leave_as_is()  # dropped; loading goes on with the next batch
            raise
        except Exception:
            self._source.stop_pulling()  # the loader has ended (a thread: joined)
            self._step_guard.leave_as_is()
            raise
        if loaded is None:
            return False
        batch, index, shared, padding = loaded
        if shared:
            warn_shared_features(self)
        self.batches.append(batch)
        context = self._create_context()
        context.index, context.features_shared_with_loader = index, shared  # the loader's
        context.padding = padding
        self.contexts.append(context)
        return True

    # --------------------------------------------------------------- schedule

    def _predict(self) -> Any:
        with self._recording.span(rec.FORWARD, self.contexts[0].index):
            with torch.no_grad():
                return predictions(self._model(self.batches[0]))

    @guarded_step
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one step on the next batch of ``dataloader_iter``; return its output.

        What every ``progress()`` does: :class:`~trec_pipelines.PipelineOptions`.
        """
        # See [Note: padding uneven eval data] in trec_pipelines.data.padding.
        return first_real_output(lambda: self._evaluate_step(dataloader_iter))

    def _evaluate_step(self, dataloader_iter: Iterator[Any]) -> Tuple[Any, bool]:
        """One step: ``cur``'s predictions, and whether ``cur`` was a padding batch."""
        # See [Note: a progress() timeline] in trec_pipelines.pipelines.
        # fmt: off
        self._recording.begin_call()
        self._take_over_model()  # from a train pipeline sharing the model, if any
        if self._loader is None:
            assert not self.batches, "in-flight batches without a loader"
            self._loader = self._start_loader(dataloader_iter)  # a new epoch
        elif dataloader_iter is not self._loader_iter:
            # The epoch reads the first iterator to its end (on a loader thread
            # possibly): running the new one's steps on those batches would
            # attribute outputs wrongly.
            raise RuntimeError(
                f"{type(self).__name__}.progress() got a different iterator mid-epoch, "
                "while the epoch reads the first one to its end. Pass the same iterator "
                "until StopIteration, or call reset() (dropping the batches in flight) "
                "to switch now."
            )
        if not self._loader_thread and not self._source.end.exhausted:
            # Pull what this call takes before any work: with several ranks the
            # next pull's agreement then starts a step ahead, carried by this
            # step's splits exchange (see [Note: agreeing on each batch]).
            try:
                self._source.fetch_ahead(dataloader_iter, 1 if self.batches else 2)
            except MalformedBatchError:
                raise  # dropped; the next call goes on with the next batch
            except Exception:
                # Loading ends on the iterator's first error, as on the loader
                # thread: the batches already pulled are still evaluated.
                self._source.stop_pulling()
                raise
        self._step_guard.begin()  # from here a failure is rolled back and retried
        if not self.batches:
            # fill: cur is copied by the loader, then input_dist (a malformed
            # first batch raises here, and the next call fills with the next)
            if self._take_batch():
                self._init_pipelined_modules(
                    self.batches[0], self.contexts[0], self._pipelined_forward_type
                )
                self.wait_sparse_data_dist(self.contexts[0])
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
        self.dequeue_batch()  # the guard retires cur's host copy once progress() returns
        return output, ctx.padding

    # ------------------------------------------------------------ lifecycle

    def _drop_in_flight_state(self) -> None:
        """A failed step (see [Note: a failed eval step]): stop the loader once it
        is idle, so the guard's rewind gives back every batch it pulled, and keep
        the error it had not handed over for the next loader."""
        if self._loader is not None:
            left = self._loader.stop_for_retry()
            if left is not None and self._loader_iter is not None:
                self._loader_left = (self._loader_iter, left)
            self._loader = None
            self._loader_iter = None
        super()._drop_in_flight_state()

    def reset(self) -> None:
        """Stop the loader and drop the batches in flight; the next ``progress()`` starts an epoch."""
        self._stop_loader()
        self._loader_left = None
        super().reset()

    def __del__(self) -> None:
        # Only signal: joining from a finalizer can deadlock at interpreter
        # exit, when daemon threads no longer run.
        if self._loader is not None:
            self._loader.stop(wait=False)
