"""What a stage of :class:`~trec_pipelines.pipelines.staged.StagedTrainPipeline` is,
what the objects behind its stages may be told, and what a batch between two
stages (:class:`InFlight`) and a failed step (:class:`StageFailure`) carry.

A :class:`PipelineStage` names a callable and the stream it runs on.  The
callable's owner (a :class:`~trec_pipelines.pipelines.sparse_data_dist_util.SparseDataDistUtil`)
may need to know which of its methods run as stages, carry the ranks' agreement,
or hear that a batch was dropped: the protocols here say how, and the finders
pick those owners out of a list of stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Protocol, Tuple, TypeVar, runtime_checkable

import torch
from torchrec.streamable import Pipelineable

from trec_pipelines.core.streams import has_streams, record_stream, wait_event
from trec_pipelines.data.agreement import AgreementChannel

# What the last stage hands the caller, for annotating stage callables (torchrec's name).
StageOut = TypeVar("StageOut", bound=Pipelineable)


@dataclass
class PipelineStage:
    """One step a batch takes before the model's forward.

    Attributes:
        name: shown in logs and in the recorded schedule.
        runnable: ``batch -> batch``; must not need gradients (copy to device,
            input_dist, postprocessing on the device, ...).
        stream: the stream the stage runs on.  ``None``, or a stream of a
            device without streams (``torch.Stream(device="cpu")``), runs it on
            the current stream.
        fill_callback: called after this stage while the pipeline fills
            (also when the stage had no batch to work on).
        data_exhausted_callback: called each time this stage finds no batch
            because the data ran out, the pipeline is flushing, or the batch
            it would have worked on was dropped by
            :meth:`StagedTrainPipeline.skip_failed_batch`.
    """

    name: str
    runnable: Callable[[Any], Any]
    stream: Optional[torch.Stream]
    fill_callback: Optional[Callable[[], None]] = None
    data_exhausted_callback: Optional[Callable[[], None]] = None


@runtime_checkable
class StageAware(Protocol):
    """An object whose bound methods are stage runnables and which must know,
    before the first batch, which of them the pipeline runs
    (:class:`SparseDataDistUtil`: how many batches it keeps in flight)."""

    def stage_declared(self, verb: str) -> None: ...


@runtime_checkable
class CarriesAgreement(Protocol):
    """An object whose stage makes the step's splits all-to-all, which can carry
    the ranks' agreement on each loaded batch (:class:`SparseDataDistUtil`; see
    ``[Note: agreeing on each batch]``)."""

    def carry_agreement(self, channel: AgreementChannel) -> None: ...

    @property
    def trained_model(self) -> Optional[torch.nn.Module]:
        """The model whose steps the loaded batches feed (its process groups
        say which ranks agree)."""
        ...


@runtime_checkable
class SkipAware(Protocol):
    """An object whose stages keep state per batch, told when
    :meth:`StagedTrainPipeline.skip_failed_batch` drops one
    (:class:`SparseDataDistUtil`: the batch's context)."""

    def batch_skipped(self, passed: bool, filling: bool) -> None: ...


def declare_stages(stages: List[PipelineStage]) -> None:
    """Tell each :class:`StageAware` owner which of its methods a stage runs."""
    for stage in stages:
        owner = getattr(stage.runnable, "__self__", None)
        if isinstance(owner, StageAware):
            owner.stage_declared(stage.runnable.__name__)


def agreement_carriers(stages: List[PipelineStage]) -> List[CarriesAgreement]:
    """The :class:`CarriesAgreement` objects whose verbs the stages run."""
    found: List[CarriesAgreement] = []
    for stage in stages:
        owner = getattr(stage.runnable, "__self__", None)
        if isinstance(owner, CarriesAgreement) and all(owner is not o for o in found):
            found.append(owner)
    return found


def skip_aware_owners(stages: List[PipelineStage]) -> List[Tuple[int, SkipAware]]:
    """Each :class:`SkipAware` object behind the stages' callables (a wrapped
    runnable hides its owner, the callbacks may still show it), with the
    index of its first stage."""
    found: List[Tuple[int, SkipAware]] = []
    for stage_idx, stage in enumerate(stages):
        for part in (stage.runnable, stage.fill_callback, stage.data_exhausted_callback):
            owner = getattr(part, "__self__", None)
            if isinstance(owner, SkipAware) and all(owner is not o for _, o in found):
                found.append((stage_idx, owner))
    return found


def side_stream(stream: Optional[torch.Stream]) -> Optional[torch.Stream]:
    """``stream`` if work can be issued to it apart from the current stream, else ``None``."""
    if stream is None or not has_streams(stream.device):
        return None
    return stream


@dataclass
class InFlight:
    """A batch between two stages.

    Attributes:
        value: what the last stage returned.
        stream: where the last stage ran (``None``: nowhere yet, or no streams).
        event: recorded on ``stream`` after the last stage (``None`` on CPU);
            a consumer on another stream waits on it.
        index: the batch's position in loading order (for recording and logs).
        host: the batch as the iterator gave it, for a checkpoint (see
            ``[Note: exact resume]`` in :mod:`trec_pipelines.assembly.resume`).
    """

    value: Any
    stream: Optional[torch.Stream]
    event: Optional[torch.Event]
    index: int
    host: Any = None

    def hand_to(self, consumer: Optional[torch.Stream], consumer_name: str) -> None:
        """Make ``consumer`` wait for the last stage and keep ``value`` alive for it."""
        if self.event is None or consumer is None or consumer == self.stream:
            return
        wait_event(consumer, self.event)
        if not hasattr(self.value, "record_stream"):
            raise TypeError(
                f"{consumer_name} gets a {type(self.value).__name__} from another "
                "stream, which cannot cross streams: return a torch.Tensor or a "
                "torchrec Pipelineable (it needs record_stream(stream)) from the "
                "stage before, or give both the same stream"
            )
        record_stream(self.value, consumer)


@dataclass(frozen=True)
class StageFailure:
    """Where the last ``progress()`` raised, for :meth:`StagedTrainPipeline.skip_failed_batch`.

    Attributes:
        where: what raised, for messages ("stage 'h2d'", "the data iterator", ...).
        slot: the slot of the batch a stage raised on; ``None`` when no stage
            was working on a batch (the iterator, a callback, validation).
        index: that batch's index (for validation: the dropped batch's).
        error: the exception's type and message, for logs.
        stage: the index of the stage that raised on the batch.
    """

    where: str
    slot: Optional[int]
    index: Optional[int]
    error: str
    stage: Optional[int] = None


__all__ = [
    "CarriesAgreement",
    "PipelineStage",
    "SkipAware",
    "StageAware",
    "StageOut",
    "agreement_carriers",
    "declare_stages",
    "side_stream",
    "skip_aware_owners",
]
