"""The process group the pipelined input_dist runs on: the model's own, or a dedicated one.

[Note: a dedicated input-dist group]
A process group runs its collectives in the order they were issued: gloo on
one thread per group, NCCL on one internal stream per communicator.  A
pipeline starts batch ``i+1``'s input_dist (the ids' splits and values
all-to-alls) before batch ``i``'s forward, whose embedding output all-to-all
then queues behind the ids on the same group: where the link is the
bottleneck, the forward waits for the next batch's ids to cross it, and the
overlap the pipeline was built for is lost.

With ``input_dist_group="dedicated"`` the pipeline runs the input_dist of its
pipelined modules on a second group of the same ranks that carries nothing
else; the embeddings' output all-to-alls, DDP's all-reduce and every other
collective stay on the model's groups.  The all-to-alls move the same bytes
between the same ranks in the same order, so results are bit-identical.

* One dedicated group per distinct sharding group (a ``KJTAllToAll``'s
  ``_pg``), made with the original's backend and timeout, and reused by every
  pipeline over any model whose input_dist runs on that group.
* Made with :func:`torch.distributed.new_group`, which every rank of the world
  must call for every group in the same order.  The ranks first agree on the
  list: one ``all_gather_object`` over the world when a pipeline first
  rewrites a model, then every rank makes the groups missing on any rank in
  one global order (2D / ``DMPCollection`` sharding groups, whose members
  differ from rank to rank, included).  So every rank of the world must
  reach its pipeline's first batch; a pipeline that only some ranks run,
  over a group of more than one rank, needs ``input_dist_group="shared"``
  (one over a one-rank group has nothing to duplicate and runs no collective).
* Only the ``KJTAllToAll`` forwards the pipeline already overrides to fuse the
  splits are pointed at the dedicated group
  (:class:`~trec_pipelines.sparse.input_dist.SplitsOnlyKJTAllToAll`); the model's
  modules keep their own ``_pg``, so ``detach()`` and ``restore_model`` leave
  them exactly as they were.  A one-rank group is never duplicated.
* The cost: one more communicator per sharding group.  On NCCL that is its
  buffers (by default ``NCCL_BUFFSIZE`` = 4 MiB per channel and peer it
  connects) and its initialisation time; on gloo, one more set of TCP pairs.
  :func:`release_input_dist_groups` destroys them;
  ``torch.distributed.destroy_process_group()`` destroys them with the rest.
* Owned by :mod:`trec_pipelines.core.lifetime`, which releases them at
  interpreter exit; everything else here holds them weakly, so that release
  also stops their threads (see ``[Note: a clean exit]``).
"""

from __future__ import annotations

import datetime
import logging
import weakref
from typing import Dict, Iterable, List, Literal, Optional, Tuple, TypeAlias, get_args

import torch
import torch.distributed as dist

from trec_pipelines.core import lifetime

logger: logging.Logger = logging.getLogger(__name__)

InputDistGroup = Literal["shared", "dedicated"]
INPUT_DIST_GROUPS: Tuple[str, ...] = get_args(InputDistGroup)
DEFAULT_INPUT_DIST_GROUP: InputDistGroup = "dedicated"

# What the ranks agree on for one group: its ranks and backend.
GroupKey = Tuple[Tuple[int, ...], str]

GroupRef: TypeAlias = "weakref.ReferenceType[dist.ProcessGroup]"

# The model's group -> the dedicated group made for it (this process), both
# held weakly: the model's group lives as long as the model, ours in the registry.
_dedicated: "weakref.WeakKeyDictionary[dist.ProcessGroup, GroupRef]" = weakref.WeakKeyDictionary()


def dedicated_of(pg: dist.ProcessGroup) -> Optional[dist.ProcessGroup]:
    """The dedicated group made for the model's group ``pg``, if not released."""
    ref = _dedicated.get(pg)
    group = ref() if ref is not None else None
    return group if group is not None and lifetime.is_owned(group) else None


def _registered(pg: dist.ProcessGroup) -> bool:
    """Whether ``pg`` is still a live group of this process (not destroyed)."""
    try:
        dist.get_process_group_ranks(pg)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def _key(pg: dist.ProcessGroup) -> GroupKey:
    return tuple(dist.get_process_group_ranks(pg)), str(dist.get_backend(pg))


def _timeout_of(pg: dist.ProcessGroup) -> Optional[datetime.timedelta]:
    """The collective timeout ``pg`` was made with, so a wedged input_dist fails as
    soon as the model's own collectives would (None: the backend's default)."""
    for device_type in ("cuda", "cpu"):
        try:
            backend = pg._get_backend(torch.device(device_type))
        except RuntimeError:
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


def dedicated_groups(
    groups: Iterable[dist.ProcessGroup],
) -> Dict[dist.ProcessGroup, dist.ProcessGroup]:
    """Map each of this rank's input_dist ``groups`` (size > 1) to its dedicated group.

    Collective over the world: every rank calls it at the same point (a
    pipeline's first rewrite), whatever groups it holds; see
    ``[Note: a dedicated input-dist group]``.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    mine = [pg for pg in dict.fromkeys(groups) if pg.size() > 1]
    if not mine:
        # Only one-rank groups (a pipeline one rank runs on its own, as the
        # bench's overhead phase): nothing to duplicate, and no collective,
        # which the other ranks would not join.
        return {}
    missing = sorted({_key(pg) for pg in mine if not _has_live_dedicated(pg)})
    gathered: List[Optional[List[GroupKey]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, missing)
    wanted = sorted({key for keys in gathered for key in keys or ()})
    timeouts = {_key(pg): _timeout_of(pg) for pg in mine}
    made: Dict[GroupKey, dist.ProcessGroup] = {}
    for ranks, backend in wanted:
        # Every rank makes every group, in one order; a non-member gets a placeholder.
        group = dist.new_group(
            ranks=list(ranks),
            backend=backend,
            timeout=timeouts.get((ranks, backend)),
            group_desc="trec_pipelines_input_dist",
        )
        if dist.get_rank() in ranks:
            assert isinstance(group, dist.ProcessGroup)
            made[(ranks, backend)] = lifetime.own_group(group)
    for pg in mine:
        # A group made in this round replaces any older one: every member must
        # hold the one its peers made.
        if _key(pg) in made:
            _dedicated[pg] = weakref.ref(made[_key(pg)])
    if made:
        logger.info(
            "trec_pipelines: made %d dedicated input_dist process group(s) for ranks %s",
            len(made),
            [list(ranks) for ranks, _ in made],
        )
    found = {pg: dedicated_of(pg) for pg in mine}
    return {pg: group for pg, group in found.items() if group is not None}


def _has_live_dedicated(pg: dist.ProcessGroup) -> bool:
    group = dedicated_of(pg)
    return group is not None and _registered(group)


def release_input_dist_groups(group: Optional[dist.ProcessGroup] = None) -> int:
    """Destroy the dedicated input_dist groups made for ``group`` (every one if None).

    For a process that tears down one set of groups and goes on with another
    (``torch.distributed.destroy_process_group()`` with no argument already
    destroys them).  A pipeline that ran on one makes a new one when it next
    fuses its input_dist (its next rewrite, or ``attach()`` after ``detach()``);
    one still attached raises at its next input_dist.  Returns how many were
    destroyed.
    """
    originals = list(_dedicated) if group is None else [group] if group in _dedicated else []
    destroyed = 0
    for original in originals:
        dedicated = dedicated_of(original)
        del _dedicated[original]
        if dedicated is None or any(dedicated_of(other) is dedicated for other in _dedicated):
            continue  # released already, or still serving another group with the same ranks
        destroyed += lifetime.release_group(dedicated)
    return destroyed
