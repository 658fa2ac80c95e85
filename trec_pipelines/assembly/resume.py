"""A pipeline's part of a checkpoint: the batches it pulled and has not trained yet.

[Note: exact resume]
A checkpoint usually holds the model, the optimizers and the data loader's own
state (torchdata's ``StatefulDataLoader``: what it has yielded).  A pipeline
pulls batches ahead of training, so the loader's state is ahead of the model by
the batches in flight: up to three for SparseDist (``cur``, ``nxt``, ``new``),
four for SemiSync.  Restarting from those three states alone skips them.

So a pipeline has a state of its own (:class:`Resumable`'s methods, the
``torch.distributed.checkpoint.stateful.Stateful`` shape): the host copies of
the batches it pulled and has not trained, oldest first, each with its index
(what ``sync_embeddings`` and the recorder count by), and the index the next
batch pulled from the iterator takes.  It is taken between ``progress()``
calls; the step guard already keeps these host copies (see
[Note: retrying a failed step] in :mod:`trec_pipelines.core.step_guard`), so
taking it costs no work in the steps.  Loaded into a freshly built pipeline,
before its first ``progress()``, the batches go back to its
:class:`~trec_pipelines.data.source.BatchSource` exactly as a failed step's are
given back: the first ``progress()`` fills the pipeline from them, re-running
their copies and input_dists, and trains them first, in order; then the
iterator (the loader restored from its own state) goes on.  Each batch is
trained once, and the weights equal those of the run that never stopped, bit
for bit: no variant's numerics depend on when a batch's copy or input_dist
ran, only on the weights its lookup reads, which the model checkpoint holds.
Variants whose in-flight work read older weights keep what exactness needs
besides (its :class:`ResumeHooks`' ``extra_state()``: SemiSync's
looked-up embeddings and stashed gradients).

The state is per rank, under a key naming the rank (``"rank_3"``), as
torchtitan stores its data loader: every rank saves its own entry into one
``torch.distributed.checkpoint`` checkpoint, and each loads its own back.  The
entry is one ``bytes`` value (the fields below, serialised with ``torch.save``),
so a fresh pipeline's ``state_dict()`` has the same keys as the saved one, as
``torch.distributed.checkpoint.load`` requires, and ``torch.load`` with
``weights_only=True`` reads a per-rank file.  It holds host tensors only (a
batch on the device is copied to the host); its size is the host size of the
batches in flight plus a few hundred bytes.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Protocol, Tuple, Type, runtime_checkable

import torch
import torch.distributed as dist

from trec_pipelines.data.parked import ParkedEpochs
from trec_pipelines.data.source import BatchSource

logger: logging.Logger = logging.getLogger(__name__)

# Bumped when the saved fields change meaning; a newer one is refused.
FORMAT = 1

_CPU = torch.device("cpu")


@dataclass
class SavedPipeline:
    """One rank's pipeline state, as :meth:`Resumable.state_dict` serialises it.

    Attributes:
        format: :data:`FORMAT` when saved.
        variant: the class that saved it (for messages; any train variant loads it).
        rank: the global rank that saved it.
        world_size: the number of ranks then.
        batches: ``(index, host batch)`` of every batch pulled and not trained,
            oldest first: the resumed pipeline trains them first, in this order.
        next_index: the index of the next batch pulled from the iterator.
        extra: what a variant needs besides (its ``ResumeHooks.extra_state()``),
            host tensors only.
    """

    format: int
    variant: str
    rank: int
    world_size: int
    batches: List[Tuple[int, Any]]
    next_index: int
    extra: Dict[str, Any] = field(default_factory=dict)


def _rank_and_world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_key(rank: int) -> str:
    """The key one rank's pipeline state is stored under."""
    return f"rank_{rank}"


def to_host(value: Any) -> Any:
    """``value`` with its tensors on the host (a batch, a tensor, a list or dict of them)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(_CPU)
    to = getattr(value, "to", None)
    if callable(to):  # a Pipelineable batch (before tuple: it may be a NamedTuple)
        return to(device=_CPU, non_blocking=False)
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v) for v in value)
    return value


def encode(saved: SavedPipeline) -> bytes:
    buffer = io.BytesIO()
    # Shallow: asdict() would turn the user's dataclass batches into dicts too.
    torch.save({f.name: getattr(saved, f.name) for f in fields(saved)}, buffer)
    return buffer.getvalue()


def decode(blob: bytes) -> SavedPipeline:
    # Not weights_only: the batches are the user's own classes (a dataclass of
    # KeyedJaggedTensors), as trusted as the checkpoint they come from.
    fields = torch.load(io.BytesIO(blob), map_location=_CPU, weights_only=False)
    if not isinstance(fields, dict) or "format" not in fields:
        raise ValueError("not a trec_pipelines pipeline state")
    if fields["format"] > FORMAT:
        raise ValueError(
            f"the pipeline state has format {fields['format']}, newer than this "
            f"trec_pipelines reads ({FORMAT}); upgrade trec_pipelines to load it"
        )
    return SavedPipeline(**fields)


@runtime_checkable
class Resumable(Protocol):
    """The checkpoint methods every pipeline has, in the shape of
    ``torch.distributed.checkpoint.stateful.Stateful``.

    A pipeline's state is the batches it pulled and has not trained yet: saved
    next to the model's, the optimizers' and the data loader's states and
    loaded into a new pipeline, each batch is trained once and the resumed run
    equals the uninterrupted one (see the :doc:`checkpoint guide </guides/checkpoint>`).
    Every pipeline has these methods (``isinstance(pipeline, Resumable)`` is
    True); each calls :func:`save_state` or :func:`load_state`.
    """

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

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Train the batches a checkpointed pipeline had in flight first, then go on.

        ``state_dict`` is what :meth:`state_dict` returned (on this rank, or the
        same keys loaded from a ``torch.distributed.checkpoint`` holding every
        rank's).  Call it on a new pipeline before its first ``progress()``;
        then pass an iterator that continues where the checkpointed one stopped
        (a data loader restored from its own state taken at the same point).
        """


class NamesResumeHooks(Protocol):
    """What the checkpoint functions read of a pipeline class's
    :class:`~trec_pipelines.assembly.traits.Traits`: the hooks it names."""

    @property
    def resume(self) -> Type[ResumeHooks]: ...


class CheckpointedPipeline(Protocol):
    """What :func:`save_state`, :func:`load_state` and the default
    :class:`ResumeHooks` read of a pipeline: its traits, which name its hooks,
    and the batch source that holds its batches in flight."""

    @property
    def _traits(self) -> NamesResumeHooks: ...

    @property
    def _source(self) -> BatchSource: ...


class ResumeHooks:
    """What :func:`save_state` and :func:`load_state` ask of a pipeline (see
    [Note: exact resume]).

    The defaults serve a pipeline whose ``_source`` (a BatchSource with
    ``keep_in_flight=True``) holds every batch pulled and not trained.  A
    variant that needs more names a subclass of its own in its traits
    (``Traits.resume``): SemiSync keeps its looked-up embeddings
    (:meth:`extra_state`), the eval pipeline settles its loader thread
    (:meth:`settle`), StagedTrainPipeline, which pulls its own way, lists its
    batches itself (:meth:`unfinished`, :meth:`is_fresh`, :meth:`resume`).
    Made for each call, so it holds nothing between two.  A subclass that reads
    more of its pipeline declares ``pipeline`` as its class.
    """

    pipeline: CheckpointedPipeline

    def __init__(self, pipeline: CheckpointedPipeline) -> None:
        self.pipeline = pipeline

    def unfinished(self) -> Tuple[List[Tuple[int, Any]], int]:
        """``(index, host batch)`` pulled and not trained, oldest first; the next index."""
        batches, next_index = self.pipeline._source.unfinished()
        return batches, next_index

    def is_fresh(self) -> bool:
        """Nothing pulled yet (or since ``reset()``): the state may be loaded."""
        return bool(self.pipeline._source.is_fresh())

    def resume(self, batches: List[Tuple[int, Any]], next_index: int) -> None:
        """Serve ``batches`` first, then number new ones from ``next_index``."""
        self.pipeline._source.resume(batches, next_index)

    def settle(self) -> None:
        """Finish whatever is still pulling batches (a loader thread) before the state is read."""

    def extra_state(self) -> Dict[str, Any]:
        """What exactness needs besides the batches (host tensors after ``to_host``)."""
        return {}

    def load_extra_state(self, extra: Dict[str, Any], variant: str) -> None:
        """Take :meth:`extra_state` of the saving pipeline back (``variant`` saved it)."""
        ignore_extra_state(type(self.pipeline).__name__, extra, variant)

    def blocker(self) -> Optional[str]:
        """Why the pipeline's state cannot be taken or loaded now, or None."""
        # StagedTrainPipeline parks nothing: it has no ParkedEpochs.
        return parked_blocker(getattr(self.pipeline, "_parked", None))


def save_state(pipeline: CheckpointedPipeline) -> Dict[str, Any]:
    """``pipeline``'s in-flight batches, for a checkpoint (see :meth:`Resumable.state_dict`)."""
    name = type(pipeline).__name__
    hooks: ResumeHooks = pipeline._traits.resume(pipeline)
    blocker = hooks.blocker()
    if blocker is not None:
        raise RuntimeError(f"{name}.state_dict(): {blocker}")
    hooks.settle()
    rank, world = _rank_and_world()
    batches, next_index = hooks.unfinished()
    saved = SavedPipeline(
        format=FORMAT,
        variant=name,
        rank=rank,
        world_size=world,
        batches=[(index, to_host(batch)) for index, batch in batches],
        next_index=next_index,
        extra=to_host(hooks.extra_state()),
    )
    return {rank_key(rank): encode(saved)}


def load_state(pipeline: CheckpointedPipeline, state_dict: Mapping[str, Any]) -> None:
    """Load ``state_dict`` into ``pipeline`` (see :meth:`Resumable.load_state_dict`)."""
    name = type(pipeline).__name__
    hooks: ResumeHooks = pipeline._traits.resume(pipeline)
    rank, world = _rank_and_world()
    key = rank_key(rank)
    if key not in state_dict:
        raise KeyError(
            f"{name}.load_state_dict(): no state for rank {rank} (found "
            f"{sorted(state_dict)}). Each rank loads the state its own rank "
            "saved: save pipeline.state_dict() on every rank."
        )
    saved = decode(state_dict[key])
    if saved.world_size != world:
        raise ValueError(
            f"{name}.load_state_dict(): the state was saved by rank {saved.rank} of "
            f"{saved.world_size}, and this is rank {rank} of {world}. A rank's "
            "in-flight batches are its share of the data: resume on as many ranks "
            "as saved, or start the epoch afresh without load_state_dict()."
        )
    if not hooks.is_fresh():
        raise RuntimeError(
            f"{name}.load_state_dict() on a pipeline that has already pulled "
            "batches: build a new pipeline (or call reset()) and load the state "
            "before its first progress()."
        )
    blocker = hooks.blocker()
    if blocker is not None:
        raise RuntimeError(f"{name}.load_state_dict(): {blocker}")
    hooks.load_extra_state(saved.extra, saved.variant)
    hooks.resume(saved.batches, saved.next_index)
    if saved.batches:
        logger.info(
            "%s: resuming with %d batch(es) in flight from a %s checkpoint "
            "(indices %d..%d); they are trained first",
            name,
            len(saved.batches),
            saved.variant,
            saved.batches[0][0],
            saved.batches[-1][0],
        )


def ignore_extra_state(name: str, extra: Dict[str, Any], variant: str) -> None:
    """Warn that the ``variant`` checkpoint holds ``extra`` state the pipeline
    class ``name`` does not use."""
    if extra:
        logger.warning(
            "%s: the %s checkpoint also holds %s, which this variant does not use: "
            "its in-flight batches are trained as this variant trains them",
            name,
            variant,
            sorted(extra),
        )


def parked_blocker(parked: Optional[ParkedEpochs]) -> Optional[str]:
    """Why the state of a pipeline with ``parked`` epochs cannot be taken or
    loaded now (batches of another iterator are parked), or None."""
    if parked is not None and parked.states():
        return (
            "batches of another iterator are parked (a different iterator was "
            "passed mid-epoch); their iterator cannot be checkpointed with them. "
            "Finish that iterator's epoch, or call reset() to drop them, first."
        )
    return None
