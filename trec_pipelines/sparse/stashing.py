"""Memory stashing for the stash variants (OptStash, EmbStash, PrefetchEMS): one place.

torchrec's ``MemoryStashingManager`` (``torchrec.distributed.memory_stashing``)
moves device memory to the host between the moment it was last read and the
moment it is needed again: an optimizer's state between two steps, an
embedding table's weights between its lookup and its backward (the sharded
embedding modules stash them right after the lookup when their table config
says ``stash_weights`` and the manager has streams), a UVM cache between the
forward and the backward.  The copies run on its own host-to-device and
device-to-host streams and a worker thread; its state is global (class level).

The pipelines never call it directly: they hold a :class:`Stashing`, which is
the manager's on a device with streams and a no-op on one without (CPU), where
every tensor already lives in host memory and there is nothing to free.  So the
schedules, their hooks and their recorded verbs are the same everywhere, and a
test can put a recording stand-in in its place.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple, cast

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor

from trec_pipelines.core.streams import StreamSet, new_stream
from trec_pipelines.sparse.embedding_kernels import embedding_kernels

logger: logging.Logger = logging.getLogger(__name__)


class Stashing:
    """Where nothing is stashed (no device memory to free): every call is a no-op.

    The subclass :class:`ManagerStashing` does the work; the pipelines call
    these methods at the points of their schedules.
    """

    enabled: bool = False

    def set_delay_stash(self, delay: bool) -> None:
        """Embedding stashes wait for :meth:`execute_pending_stashes` instead of
        running right after the lookup."""

    def execute_pending_stashes(self) -> None:
        """Run the embedding stashes delayed by :meth:`set_delay_stash`."""

    def restore_embedding_weights(self) -> None:
        """Bring the stashed embedding weights back (before their backward)."""

    def restore_cache(self) -> None:
        """Bring stashed UVM caches back (PrefetchEMS)."""

    def start_optimizer_restore(self) -> None:
        """Start bringing the optimizer state back, on the worker thread."""

    def finish_optimizer_restore(self) -> bool:
        """Wait until the optimizer state is back; False if no restore had been
        started, in which case it is restored now."""
        return True

    def finish_optimizer_stash(self) -> None:
        """Wait for the previous step's optimizer stash to be issued (its
        restore must not start before)."""

    def start_optimizer_stash(self, optimizer: torch.optim.Optimizer) -> None:
        """Start moving ``optimizer``'s state to the host, on the worker thread."""


class ManagerStashing(Stashing):
    """torchrec's ``MemoryStashingManager``, given this pipeline's streams."""

    enabled = True

    def __init__(self, streams: StreamSet, device: torch.device) -> None:
        from torchrec.distributed.memory_stashing import MemoryStashingManager

        # Typed Any: torchrec annotates CUDA streams, ours are the device-generic kind.
        self._manager: Any = cast(Any, MemoryStashingManager)
        # Host-to-device copies share the memcpy stream (as torchrec's classes
        # do); device-to-host copies get a stream of their own.
        self._manager.set_streams(streams.memcpy, new_stream(device))
        self._restore: Optional["Future[None]"] = None
        self._stash: Optional["Future[Any]"] = None
        self._await_restore: Callable[[], None] = _nothing

    def set_delay_stash(self, delay: bool) -> None:
        self._manager.set_delay_stash(delay)

    def execute_pending_stashes(self) -> None:
        self._manager.execute_pending_stashes()

    def restore_embedding_weights(self) -> None:
        self._manager.restore_embedding_weights()

    def restore_cache(self) -> None:
        self._manager.restore_emo_cache()

    def start_optimizer_restore(self) -> None:
        self._restore = self._manager.restore_optimizer_state_threaded()

    def finish_optimizer_restore(self) -> bool:
        started = self._restore is not None
        if self._restore is not None:
            self._restore.result()
            self._restore = None
        else:
            self._manager.restore_optimizer_state()
        self._await_restore()
        self._await_restore = _nothing
        return started

    def finish_optimizer_stash(self) -> None:
        if self._stash is not None:
            self._await_restore, _ = self._stash.result()
            self._stash = None

    def start_optimizer_stash(self, optimizer: torch.optim.Optimizer) -> None:
        self._stash = self._manager.stash_optimizer_state_threaded(optimizer)


def _nothing() -> None:
    pass


def stashing_for(streams: StreamSet, device: torch.device) -> Stashing:
    """The manager's stashing where the device has streams, else the no-op one."""
    if streams.memcpy is None:
        logger.info(
            "memory stashing: %s has no streams and no device memory to free; the "
            "stash and restore points of the schedule do nothing",
            device.type,
        )
        return Stashing()
    return ManagerStashing(streams, device)


# --------------------------------------------------------------------- plan

# torchrec's manager leaves optimizer state tensors smaller than this where they are.
OPTIMIZER_STATE_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class StashPlan:
    """What a stash variant moves to the host and back each step on one rank.

    Computed from the model and the optimizer by the rules of torchrec's
    ``MemoryStashingManager``, not measured: on CPU nothing moves (the memory
    is host memory already), and this says what would on a GPU.

    Attributes:
        optimizer_state_bytes: OptStash: the optimizer state moved out after
            each step and back during the next backward.  The manager takes
            plain device tensors of ``optimizer.state`` of at least
            :data:`OPTIMIZER_STATE_MIN_BYTES`; a sharded state (the fused
            embedding optimizers' ``ShardedTensor`` s) is not one, and stays.
        optimizer_state_tensors: how many tensors that is.
        embedding_weight_bytes: EmbStash and PrefetchEMS: the device weights
            of the embedding kernels holding a table marked ``stash_weights``,
            moved out after the lookup and back before the backward.  On CPU,
            the same kernels' host weights (what their device weights would be).
        embedding_tables: the tables marked ``stash_weights``, on this rank.
        moved: whether this device really moves them (it has streams).
    """

    optimizer_state_bytes: int = 0
    optimizer_state_tensors: int = 0
    embedding_weight_bytes: int = 0
    embedding_tables: Tuple[str, ...] = ()
    moved: bool = False

    @property
    def total_bytes(self) -> int:
        return self.optimizer_state_bytes + self.embedding_weight_bytes


def optimizer_state_to_stash(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """The tensors of ``optimizer``'s state the manager moves (on a GPU: the device ones)."""
    found: List[torch.Tensor] = []
    for state in optimizer.state.values():
        if isinstance(state, dict):
            for value in state.values():
                _collect_state_tensors(value, found)
    return found


def _collect_state_tensors(value: Any, found: List[torch.Tensor]) -> None:
    if isinstance(value, ShardedTensor):
        return  # not a device tensor to the manager: its shards stay
    if isinstance(value, torch.Tensor):
        if value.numel() * value.element_size() >= OPTIMIZER_STATE_MIN_BYTES:
            found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect_state_tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _collect_state_tensors(item, found)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _collect_state_tensors(getattr(value, f.name, None), found)
    elif hasattr(value, "__dict__"):
        for item in vars(value).values():
            _collect_state_tensors(item, found)


def embedding_weights_to_stash(model: torch.nn.Module) -> Tuple[int, Tuple[str, ...]]:
    """Bytes of the embedding kernels' weights holding a ``stash_weights`` table, and those tables."""
    total, tables = 0, []
    for module in model.modules():
        for kernel in embedding_kernels(module) or ():
            config = getattr(kernel, "_config", None)
            marked = [
                t.name
                for t in getattr(config, "embedding_tables", ())
                if getattr(t, "stash_weights", False)
            ]
            if not marked:
                continue
            tbe = getattr(kernel, "_emb_module", None)
            weights = getattr(tbe, "weights_dev", None)
            if weights is None or weights.numel() == 0:
                weights = getattr(tbe, "weights_host", None)
            if not isinstance(weights, torch.Tensor):
                continue  # not a fused kernel (data_parallel's dense one): never stashed
            tables += marked
            total += weights.numel() * weights.element_size()
    return total, tuple(tables)


def plan_stash(
    stashing: Stashing,
    *,
    optimizer: Optional[torch.optim.Optimizer] = None,
    model: Optional[torch.nn.Module] = None,
) -> StashPlan:
    """The plan of a pipeline stashing ``optimizer``'s state and/or ``model``'s marked tables."""
    state = optimizer_state_to_stash(optimizer) if optimizer is not None else []
    weight_bytes, tables = embedding_weights_to_stash(model) if model is not None else (0, ())
    return StashPlan(
        optimizer_state_bytes=sum(t.numel() * t.element_size() for t in state),
        optimizer_state_tensors=len(state),
        embedding_weight_bytes=weight_bytes,
        embedding_tables=tables,
        moved=stashing.enabled,
    )


def report_plan(pipeline: str, plan: StashPlan, device: torch.device, what: str) -> None:
    """Log, once per pipeline, what it stashes; warn when it stashes nothing.

    ``what`` is ``"optimizer state"`` or ``"embedding weights"``.  A stash variant
    with nothing to stash trains exactly as SparseDist, which torchrec's classes
    do without a word.
    """
    size = plan.optimizer_state_bytes if what == "optimizer state" else plan.embedding_weight_bytes
    if size == 0:
        why = (
            "no tensor of its state is a plain one of 1 MiB or more (the fused embedding "
            "optimizers' sharded state stays on the device)"
            if what == "optimizer state"
            else "no embedding table on this rank has stash_weights=True (set it in the "
            "tables' EmbeddingBagConfig to stash them between lookup and backward)"
        )
        logger.warning(
            "%s: nothing to stash: %s; it trains as TrainPipelineSparseDist", pipeline, why
        )
        return
    where = (
        "to the host each step"
        if plan.moved
        else f"nowhere on {device.type} (host memory already); on a GPU it would move it"
    )
    tables = f" (tables {', '.join(plan.embedding_tables)})" if what != "optimizer state" else ""
    logger.info("%s: %.2f MiB of %s%s moves %s", pipeline, size / 2**20, what, tables, where)
