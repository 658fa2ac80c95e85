"""What every pipeline stands on: its batches, its step's start, its model.

[Note: the core under every pipeline]
Each variant writes its own ``progress()`` as a literal timeline.  What
comes before the timeline, and what lives between two steps, is the same for
every one of them and is written once, in :class:`PipelineCore`:

* construction from torchrec's ``model``, ``optimizer`` and ``device`` plus
  our options (:mod:`trec_pipelines.assembly.options`),
  :meth:`PipelineCore._init_core`: the checks, the
  :class:`~trec_pipelines.data.source.BatchSource` (validation, and the ranks'
  agreement on each pull), the :class:`~trec_pipelines.core.step_guard.StepGuard`,
  and the :class:`~trec_pipelines.assembly.pipelined_model.PipelinedModel`;
* the start of a step (:meth:`PipelineCore._start_step`): the schedule
  recorder's new call, the take-over of a model another pipeline left
  attached, the iterator switch (parking the previous iterator's in-flight
  batches, :meth:`PipelineCore._switch_iterator`), pulling the host batches
  the step will copy, and the step guard's begin; where the step is
  (torchrec's ``_state``, :meth:`PipelineCore._enter_phase`) and the checked
  forward (:meth:`PipelineCore._call_forward`);
* what a user calls between steps: :meth:`~PipelineCore.skip_failed_batch`
  and :attr:`~PipelineCore.unused_batches`.

A variant says what it holds in flight through three small methods
(:meth:`~PipelineCore._in_flight`, :meth:`~PipelineCore._set_aside`,
:meth:`~PipelineCore._bring_back`) and how many host batches a step pulls
(:meth:`~PipelineCore._batches_to_fetch`); the rest follows.

The core stands on
:class:`~trec_pipelines.assembly.torchrec_state.TorchrecState` (torchrec's
attributes, as typed properties onto the parts of ours that own them); the
SparseDist family adds
:class:`~trec_pipelines.pipelines.sparse_dist_rewrite.SparseDistRewrite`
(torchrec's rewrite hooks and ``attach``/``detach``).  What every pipeline has
besides is held and called, not inherited; what a
class is, its flags and its decisions on torchrec's hooks, is one
:class:`~trec_pipelines.assembly.traits.Traits` (``_traits``); the
subclass-hook checks run from ``__init_subclass__``
(:func:`~trec_pipelines.core.subclass_hooks.check_subclass`), which wraps a
subclass's own ``progress()`` in the step guard
(:func:`~trec_pipelines.core.step_guard.guarded_user_step`); the recording
methods hand each call to ``self._recording``
(:class:`~trec_pipelines.observe.recording.Recording`) and the checkpoint
methods to :func:`~trec_pipelines.assembly.resume.save_state` and
:func:`~trec_pipelines.assembly.resume.load_state`, one line each.
StagedTrainPipeline stands on the core too: it shares the start of the
set-up (:meth:`PipelineCore._init_options`, :meth:`PipelineCore._agreement_over`;
the others start with :meth:`PipelineCore._init_core`), overrides what it does
its own way (pulling, ``skip_failed_batch``, the resume hooks) and runs no step guard.
"""

from __future__ import annotations

import logging
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Tuple,
    cast,
)

import torch
from torchrec.distributed.train_pipeline.types import PipelineState

from trec_pipelines.assembly import resume
from trec_pipelines.assembly.options import PipelineOptions, accepted_options, resolve_options
from trec_pipelines.assembly.pipelined_model import PipelinedModel
from trec_pipelines.assembly.torchrec_state import TorchrecState
from trec_pipelines.assembly.traits import Traits
from trec_pipelines.core.checks import (
    check_device,
    check_forward_output,
    check_model_device,
    check_optimizer,
)
from trec_pipelines.core.input_dist_group import InputDistGroup
from trec_pipelines.core.model_step import Precision
from trec_pipelines.core.step_guard import StepGuard, guarded_user_step
from trec_pipelines.core.streams import StreamSet
from trec_pipelines.core.subclass_hooks import check_subclass, overrides_outside
from trec_pipelines.data.agreement import AgreementChannel, agreement_group
from trec_pipelines.data.parked import ParkedEpochs
from trec_pipelines.data.source import BatchSource
from trec_pipelines.observe.action_records import Action, Transfer
from trec_pipelines.observe.ledger import LedgerSummary, MemorySample
from trec_pipelines.observe.recorder import ScheduleRecorder
from trec_pipelines.observe.recording import Recording

logger: logging.Logger = logging.getLogger(__name__)


def check_depth(cls: type[PipelineCore], depth: Any) -> int:
    """``depth`` as given by the class keyword of ``cls``, checked: a positive
    int, on a pipeline that counts the batches it holds (the SparseDist family)."""
    name = cls.__name__
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise TypeError(
            f"{name}: depth must be a positive int (the most batches the pipeline holds "
            f"in flight right after a step's copy: 3 in TrainPipelineSparseDist), got {depth!r}"
        )
    if cls._traits.depth == 0:
        raise TypeError(
            f"{name}: depth={depth} applies to a pipeline that holds a queue of batches "
            f"(TrainPipelineSparseDist and its subclasses); {cls.__mro__[1].__name__} holds "
            "a fixed number: subclass TrainPipelineSparseDist, or drop the depth keyword"
        )
    return depth


class PipelineCore(TorchrecState):
    """The shared part of every pipeline (see [Note: the core under every pipeline])."""

    # What the class is: every answer the core asks of it (see [Note: a pipeline's traits]).
    _traits: Traits = Traits()

    def __init_subclass__(cls, depth: Optional[int] = None, **kwargs: Any) -> None:
        """``depth``: how many batches a subclass holds in flight right after a
        step's copy, when it holds more (or fewer) than its base, declared with the
        class (``class MyPipeline(TrainPipelineSparseDist, depth=4): ...``; see the
        guide to writing a variant)."""
        super().__init_subclass__(**kwargs)
        if depth is not None:
            cls._traits = cls._traits.updated(depth=check_depth(cls, depth))
        traits = cls._traits
        check_subclass(cls, guarded_user_step if traits.guards_user_progress else None)
        pulls = traits.pulls_through_next_batch and overrides_outside(cls, "_next_batch")
        if pulls != traits.pulls_when_copied:
            cls._traits = traits.updated(pulls_when_copied=pulls)

    # Where a step is (torchrec's ``_state``, written by torchrec's base class at
    # construction; outside code writes it too).  Holds torchrec's enum.
    _state: PipelineState
    _streams: StreamSet
    # The schedule recorder's holder; class-level until a pipeline records.
    _recording: Recording

    _options: PipelineOptions
    _model: torch.nn.Module
    _device: torch.device
    _source: BatchSource
    _step_guard: StepGuard
    _parked: ParkedEpochs
    _pipelined: PipelinedModel
    _optimizer: torch.optim.Optimizer
    _agreement: Optional[AgreementChannel]
    _precision: Precision
    # Set when another pipeline detached this one to take the model over.
    _taken_over_by: Optional[str]
    # The model's forward, or custom_model_fwd (torchrec's attribute, read and
    # called by subclasses as it is: see call_forward for ours).
    _model_fwd: Callable[..., Any]

    # ------------------------------------------------------------- construction

    def _init_core(
        self,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        device: Any,
        options: Mapping[str, Any],
        *,
        input_dist_group: Optional[InputDistGroup] = None,
    ) -> None:
        """Check torchrec's arguments, resolve our options and build the shared parts
        (every pipeline's constructor calls it first, after ``super().__init__()``).

        ``input_dist_group`` overrides the option's value for the splits fusion
        (a variant whose input_dist never runs ahead keeps it on the model's group).
        """
        name = type(self).__name__
        self._init_options(options)
        if self._traits.requires_optimizer:
            check_optimizer(optimizer, name, model)
        self._device = check_device(device, name)
        check_model_device(model, self._device, name)
        self._model = model
        # None only for the eval variants, which never step it.
        self._optimizer = cast(torch.optim.Optimizer, optimizer)
        # A pull made in the copy stage is agreed there, by an all-reduce of its own.
        carried = self._traits.carries_agreement and not self._traits.pulls_when_copied
        self._agreement = self._agreement_over(model, carried=carried)
        self._precision = Precision(
            self._device,
            self._options["autocast_dtype"],
            self._options["grad_scaler"],
            model=model,
            pipeline=name,
        )
        self._source = self._new_source()
        self._step_guard = StepGuard(
            "training" if self._traits.requires_optimizer else "evaluating"
        )
        # In-flight batches of iterators set aside by a switch (see _switch_iterator).
        self._parked = ParkedEpochs()
        group = input_dist_group or self._options["input_dist_group"]
        self._pipelined = PipelinedModel(self, model, group)
        # Set when another pipeline detached this one to take the model over.
        self._taken_over_by = None

    def _init_options(self, options: Mapping[str, Any]) -> None:
        """The set-up every pipeline starts with, StagedTrainPipeline's too: its
        recording (off) and our options, resolved for its class."""
        self._recording = Recording()
        self._options = resolve_options(type(self).__name__, type(self), options)

    def _agreement_over(
        self, model: Optional[torch.nn.Module], *, carried: bool
    ) -> Optional[AgreementChannel]:
        """The channel the ranks training ``model`` agree on each pull over (None
        alone or with ``sync_exhaustion=False``); ``carried``: on the splits exchange."""
        group = agreement_group(self, model, self._options["sync_exhaustion"])
        return None if group is None else AgreementChannel(group, carried=carried)

    def _new_source(self) -> BatchSource:
        """A source of host batches for a new epoch count, with the ranks' agreement."""
        return BatchSource(
            self._agreement,
            keep_in_flight=True,
            validate=self._options["validate_batches"],
            # Only a user's _next_batch is called back: ours would hand the pull
            # straight back to the source, which pulls itself.
            puller=self._next_batch if self._traits.pulls_when_copied else None,
            agree_ahead=self._options["agree_ahead"] and not self._traits.pulls_when_copied,
            # An eval pipeline pads a rank whose data ended (training stops at the shortest).
            pad_uneven="uneven_data" in accepted_options(type(self))
            and self._options["uneven_data"] == "pad",
        )

    # ------------------------------------------------------------ torchrec's hooks

    def _next_batch(self, dataloader_iter: Iterator[Any]) -> Optional[Any]:
        """The next host batch from ``dataloader_iter``, or None at the end of the data.

        torchrec's hook, honoured: where a subclass overrides it, every host
        batch is pulled through it, once (otherwise the source pulls itself).
        Ours pulls before the step that copies the batch issues any work (at the
        top of ``progress()``; with several ranks agreeing, a step ahead); a
        class that overrides it pulls where torchrec's calls it, in the copy
        stage, so the override reads ``batches``, ``contexts``,
        ``_dataloader_iter`` and ``_dataloader_exhausted`` as torchrec's class
        has them then.  An override may skip batches (return the next one it
        keeps), transform them, or return another batch (a copy of
        ``self.batches[0]`` to pad a rank whose data ended);
        ``super()._next_batch(dataloader_iter)`` pulls.  Returning None ends the
        epoch.

        Called by a subclass's own ``progress()`` (not by ours), it is torchrec's
        pull at torchrec's point: a new iterator starts a new epoch, an ended
        epoch gives None without calling ``next()``, and the end of the data sets
        ``_dataloader_exhausted`` (Base: ``_data_iter_stopped``) there and then.
        """
        if self._source.pulling:
            return self._source.hook_next(dataloader_iter)
        return self._source.direct_next(dataloader_iter)

    def _enter_phase(self, phase: PipelineState) -> None:
        """Set ``_state`` to ``phase`` (``IDLE`` at a step's start, ``CALL_FWD``,
        ``CALL_BWD``) where torchrec's class does (``tracks_state``)."""
        if self._traits.tracks_state:
            self._state = phase

    def _call_forward(self, batch: Any) -> Tuple[torch.Tensor, Any]:
        """``self._model_fwd(batch)``, checked in a training pipeline to have returned
        torchrec's pair ``(losses, output)`` (a type and a length check): a forward
        that returns a bare loss, a dict or a longer tuple gets an error naming the
        fix instead of Python's unpacking error.  A subclass's own step that calls
        ``_model_fwd`` directly gets what it returns, as on torchrec."""
        # Annotated, not cast: typing.cast is a call of its own on every step.
        output: Tuple[torch.Tensor, Any] = self._model_fwd(batch)
        if (type(output) is tuple and len(output) == 2) or not self._traits.requires_optimizer:
            return output
        checked: Tuple[torch.Tensor, Any] = check_forward_output(output, type(self).__name__)
        return checked

    # ------------------------------------------------------- the in-flight batches

    def _in_flight(self) -> int:
        """How many device batches this pipeline holds between two steps."""
        return 0

    def _set_aside(self) -> Any:
        """Hand over the in-flight batches (for parking) and hold none."""
        return None

    def _bring_back(self, state: Any) -> None:
        """Hold again what :meth:`_set_aside` handed over."""

    def _batches_to_fetch(self) -> int:
        """How many host batches this step copies: pulled before any work is issued."""
        return 1

    def _drop_in_flight_state(self) -> None:
        """Forget the in-flight device batches; the step guard gives their host
        batches back to the source (see :mod:`trec_pipelines.core.step_guard`)."""
        self._set_aside()

    # ----------------------------------------------------------- a step's start

    def _start_step(self, dataloader_iter: Iterator[Any]) -> None:
        """What every step does before its timeline, in one place (see the module
        note of :mod:`trec_pipelines.core.step_guard`)."""
        self._recording.begin_call()
        if self._pipelined.looked_at != self._pipelined.changes.count:  # a wrapper changed since
            self._take_over_model()
        if dataloader_iter is not self._source.iterator:
            self._switch_iterator(dataloader_iter)
        # Pull the host batches this call copies before any work: an iterator error
        # then reaches the caller with the pipeline untouched.  A user's _next_batch
        # pulls in the copy stage instead, where torchrec calls it.
        ahead = 0 if self._traits.pulls_when_copied else self._batches_to_fetch()
        self._source.fetch_ahead(dataloader_iter, ahead)
        self._step_guard.begin()  # from here a failure is rolled back and retried

    def _take_over_model(self) -> None:
        """Detach any other pipeline whose forward wrappers are on this model
        (an eval pipeline left attached when its data ended; see
        :mod:`trec_pipelines.sparse.takeover`); a step's start calls it when a
        wrapper changed since this pipeline last looked."""
        self._pipelined.take_over()

    def _switch_iterator(self, dataloader_iter: Iterator[Any]) -> None:
        """Set the previous iterator's in-flight batches aside when another is passed.

        Called with an iterator other than the current epoch's.  Alternating
        iterators (train, then an eval pass, then train again) must
        not feed one iterator's in-flight batches to the other's steps (torchrec
        #3751).  The previous iterator's batches, with whatever work is already
        under way for them, are parked untouched; passing that iterator again
        resumes them exactly where they were, so training is identical to never
        having switched.
        """
        source = self._source
        previous = source.iterator
        on_device = self._in_flight()
        in_flight = on_device + source.holding
        if previous is not None and in_flight:
            self._parked.park(previous, (self._set_aside(), source.save(), on_device))
            logger.warning(
                "%s: a different iterator was passed with %d batch(es) of the previous "
                "one in flight; they are parked and resume when that iterator is passed "
                "again (reset() drops them)",
                type(self).__name__,
                in_flight,
            )
        parked = self._parked.resume(dataloader_iter)
        if parked is not None:
            state, saved, _ = parked
            self._bring_back(state)
            source.restore(saved)

    # ------------------------------------------------------------ between steps

    def reset(self) -> None:
        """Drop the in-flight (and parked) batches; the next ``progress()`` starts a new
        epoch, its first batch numbered 0."""
        dropped = self._in_flight() + sum(count for _, _, count in self._parked.states())
        dropped += self._source.rewound
        if dropped:
            logger.warning(
                "%s.reset() drops %d in-flight batch(es) that were never trained",
                type(self).__name__,
                dropped,
            )
        self._set_aside()
        self._parked.clear()
        self._source.drop_in_flight()
        self._step_guard.failed = None
        self._source.end_epoch()  # the next progress() starts a new epoch
        # Batch indices start from 0 again, as in torchrec: the DMPCollection
        # sync every N batches (sync_embeddings) counts from the reset.
        self._source.restart_count()

    def skip_failed_batch(self) -> int:
        """Drop the batch the last ``progress()`` failed on instead of retrying it.

        After a ``progress()`` that raised, the next call retries the same batch
        from scratch.  For a batch that fails every time, call this (on every
        rank) before the next ``progress()``: the batch is logged and never
        trained, and training goes on with the one after it.  Returns the
        skipped batch's index; raises ``RuntimeError`` if the last call did not
        fail.
        """
        return self._step_guard.skip_failed(self._source, type(self).__name__)

    @property
    def unused_batches(self) -> int:
        """Batches this rank pulled but did not train because another rank's data
        ended first (``sync_exhaustion=True``)."""
        return self._source.unused

    # ------------------------------------------------- checkpoint and resume

    def state_dict(self) -> Dict[str, Any]:
        """This rank's in-flight batches, for a checkpoint (``{"rank_<r>": bytes}``).

        Call it between ``progress()`` calls (also before the first, and after
        ``StopIteration``), on every rank, next to the model's, the optimizers'
        and the data loader's states, taken at the same point.  It holds the host
        copies of the batches pulled and not trained (SparseDist: at most 3;
        SemiSync: 4) and their indices, plus a few hundred bytes; SemiSync adds
        its looked-up embeddings and stashed gradients.  Load it with
        :meth:`load_state_dict` into a new pipeline before its first ``progress()``.
        """
        return resume.save_state(self)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Train the batches a checkpointed pipeline had in flight first, then go on.

        ``state_dict`` is what :meth:`state_dict` returned (on this rank, or the
        same keys loaded from a ``torch.distributed.checkpoint`` holding every
        rank's).  Call it on a new pipeline before its first ``progress()``;
        then pass an iterator that continues where the checkpointed one stopped
        (a data loader restored from its own state taken at the same point).
        """
        resume.load_state(self, state_dict)

    # --------------------------------------------------------------- recording

    def enable_schedule_recording(self, memory: bool = False) -> ScheduleRecorder:
        """Record every verb, with timing, from the next ``progress()`` call on.

        ``memory=True`` also measures, after each verb, the tensor storage the
        pipeline holds (:meth:`memory_ledger`); it slows every verb down.
        """
        return self._recording.enable(self, memory)

    def disable_schedule_recording(self) -> None:
        """Stop recording, and drop what was recorded."""
        self._recording.disable()

    @property
    def schedule_actions(self) -> List[Action]:
        """The recorded actions, oldest first (empty when recording is off)."""
        return self._recording.actions()

    @property
    def schedule_transfers(self) -> List[Transfer]:
        """The all-to-alls the recorded verbs put on the link, oldest first
        (empty when recording is off); ``completed`` is None for one still in flight."""
        return self._recording.transfers()

    def schedule(self) -> List[Tuple[str, str, List[Any]]]:
        """The schedule table: one ``(task, stream, cells)`` row per task.

        ``cells[k]`` is the batch index the task handled in ``progress()`` call
        ``k`` (a tuple when it handled several, as in the fill), or None.
        """
        return self._recording.schedule()

    def print_schedule(self, n: Optional[int] = None) -> str:
        """Print (and return) the first ``n`` columns of :meth:`schedule`."""
        return self._recording.print_schedule(n)

    def export_trace(self, path: str) -> None:
        """Write a Chrome/Perfetto trace: one track per stream plus the CPU thread
        (and a counter of what the pipeline held, when the memory ledger is on)."""
        self._recording.export_trace(path)

    def save_timeline(self, path: str, calls: Optional[Tuple[int, int]] = None) -> None:
        """Draw the recorded timeline (streams x time) to a PNG: a lane per
        stream, one for the CPU thread, one per process group for the link, and
        a memory track when the memory ledger is on."""
        self._recording.save_timeline(self, path, calls)

    @property
    def memory_samples(self) -> List[MemorySample]:
        """What the pipeline held after each recorded verb (empty unless ``memory=True``)."""
        return self._recording.memory_samples()

    def memory_ledger(self) -> LedgerSummary:
        """Peak and steady state of what the pipeline held, by kind (see :mod:`trec_pipelines.observe.ledger`)."""
        return self._recording.memory_ledger()

    def print_memory(self) -> str:
        """Print (and return) :meth:`memory_ledger` as a table."""
        return self._recording.print_memory()

    def exposed_time(self) -> Dict[str, float]:
        """Seconds the training thread spent in each task, plus ``"step"``: the total."""
        return self._recording.exposed_time()
