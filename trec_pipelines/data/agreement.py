"""Ranks agreeing on each batch they pull: the end of the data, and a malformed batch.

[Note: agreeing on each batch]
A step's collectives pair up only if every rank is at the same batch index.
Two things a rank learns alone, as it pulls a host batch, break that: its
data ended while the others' did not, or its batch is malformed
(``validate_batches``) while the others' are fine.  A rank that stops, or
drops the batch, on its own leaves the others in the step's next collective
until the process group times out; if it then goes on, it trains batch
``k + 1`` against the others' ``k``, and the ranks stay out of step (at the
end of the data one rank runs a step alone, and hangs).

So each pull is agreed before the step issues any work on it.  Every rank
reports one code per pull: the pull's number and its outcome (:data:`ENDED`,
:data:`MALFORMED`, :data:`FINE`, :data:`FAILED`); every rank then knows every
rank's code.

* A pull whose ``next()`` raised on any rank (:data:`FAILED`) makes every rank
  raise for it, before any work, in the same ``progress()``: that rank its
  iterator's error, the others ``PeerFailedError`` naming it (see
  ``[Note: a loader error on one rank]`` in
  :mod:`trec_pipelines.data.pull_failure`).  This goes first of all.

* A batch malformed on any rank is dropped on every rank, and every rank
  raises ``MalformedBatchError`` for it, naming the batch and the ranks it was
  malformed on (there the error also says what is wrong).  This goes first,
  so the error is seen even when another rank's data ended at that pull.
* Otherwise, when any rank's data ended, the epoch ends on every rank, with
  ``StopIteration``, at the same step.  A rank that had a batch logs it and
  counts it in ``unused_batches``; the batch is not trained, and the next
  epoch starts from the iterator passed then.  That is the training policy
  (stop at the shortest rank).  The eval pipelines pad instead
  (``uneven_data="pad"``, see ``[Note: padding uneven eval data]`` in
  :mod:`trec_pipelines.data.padding`): the decision tells "some rank ended"
  (:attr:`Agreed.ended`) from "every rank ended" (:attr:`Agreed.all_ended`),
  and the epoch ends only at the latter.
* Codes whose pull numbers differ mean the ranks are out of step (a retry
  or skip on some ranks only): every rank raises ``OutOfStepError``.

How the codes travel, at no collective of their own in the steady state:
every sharded step already makes one exchange every rank joins, the fused
splits all-to-all of the pipelined ``input_dist``, and the code rides in it
as one more int64 per rank (:mod:`trec_pipelines.sparse.carried_agreement`).
Where a step makes no such exchange (Base and PT2 run the model's own
forward; a ``StagedTrainPipeline`` without a ``SparseDataDistUtil`` stage; a
loader thread pulls while steps run; a model with no world-spanning sharded
group) each
pull's code is all-reduced on a gloo group of its own instead, as are the
pulls made before the first exchange (a fill).

One pull ahead: waiting for a code where the batch is pulled would put a
round trip in every step.  So :meth:`BatchSource.fetch_ahead
<trec_pipelines.data.source.BatchSource.fetch_ahead>`, at the top of each
``progress()``, first takes the batches the call needs, whose codes went out
during the previous call and have had a whole step to come back, then pulls
one more, whose code goes out with this call's splits exchange (or its
all-reduce is started, ``async_op``).  A malformed batch still raises before
its step issues any work, on every rank.  The price: one more host batch
pulled from the iterator and held (also in a checkpoint, see ``[Note: exact
resume]``), host memory on a GPU, never device memory; ``agree_ahead=False``
drops it and agrees on each pull as it is made, a round trip in every step
(the memory guide shows the batch's bytes).  A pipeline that only calls
:meth:`~trec_pipelines.data.source.BatchSource.next` (an eval loader thread)
agrees on each pull as it makes it, inside its own thread, and so does a class
with a user's ``_next_batch``, which pulls in the copy stage where torchrec
calls it (see ``[Note: a user's _next_batch pulls at torchrec's moment]``).

When it runs: whenever the model's steps join collectives across ranks
(``sync_exhaustion=None``, the default; ``True`` insists, ``False`` turns it
off).  torchrec has no such agreement: there a rank whose data ended leaves,
and the others fail at their next collective, or wait for the process
group's timeout (30 minutes by default).  What it costs is in the
performance guide (``make bench`` with ``--agreement-off`` runs each of our
pipelines with and without it, paired).

The group for the all-reduces: gloo, so the codes are CPU tensors (no device
synchronisation on any backend), and a group of its own, so an all-reduce
never queues behind the model's all-to-alls in flight. It spans the world, is
made by the pipeline's constructor with ``torch.distributed.new_group`` (so
every rank of the world constructs its pipeline at the same point, as it
builds the sharded model), and gets the timeout of the model's process group.
A model on a one-rank process group (a rank training or measuring on its own)
has no one to agree with: no group is made, whatever ``sync_exhaustion``. It is owned by
:mod:`trec_pipelines.core.lifetime` (the pipeline's channel holds it weakly):
once its pipeline is collected it is destroyed by the next pipeline's
constructor, so a program that builds a pipeline per eval pass does not keep a
gloo group (threads, sockets) per pass, and at
interpreter exit in any case (see ``[Note: a clean exit]``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trec_pipelines.core import lifetime
from trec_pipelines.core.errors import OutOfStepError
from trec_pipelines.core.input_dist_group import _timeout_of
from trec_pipelines.model.rewrite import sharded_modules

# What a rank reports for one pull (the low three bits of its code); NOTHING is
# what a rank with no pull to report carries in a splits exchange; FAILED: its
# iterator raised.
ENDED, MALFORMED, FINE, NOTHING, FAILED = 0, 1, 2, 3, 4
# A code is pull * PER_PULL + outcome: ``divmod(code, PER_PULL)`` reads (pull, outcome).
PER_PULL = 1 << 3
# The pull number rides above the outcome, modulo this (an int32 splits tensor holds it).
_PULLS = 1 << 27


def encode(pull: int, outcome: int) -> int:
    """One rank's report of pull number ``pull``."""
    return (pull % _PULLS) * PER_PULL + outcome


@dataclass(frozen=True)
class Agreed:
    """One pull, as every rank saw it."""

    malformed_on: List[int]  # the (global) ranks whose batch is malformed
    ended: bool  # some rank's data ended
    all_ended: bool = False  # every rank's data ended (padding waits for this)
    failed_on: List[int] = field(default_factory=list)  # ranks whose next() raised


def _model_groups(model: torch.nn.Module) -> List[Optional[dist.ProcessGroup]]:
    """The process group of each of the model's sharded modules (None where a
    module does not say which it runs on)."""
    groups: List[Optional[dist.ProcessGroup]] = []
    for module in sharded_modules(model).values():
        pg = getattr(getattr(module, "_env", None), "process_group", None)
        if pg not in groups:
            groups.append(pg)
    return groups


def _model_ranks(model: torch.nn.Module) -> Optional[List[int]]:
    """The ranks ``model``'s steps join collectives with: those of its sharded
    modules' and DDPs' process groups (a module that names none: the world);
    None when it has neither."""
    groups: List[Optional[dist.ProcessGroup]] = list(_model_groups(model))
    groups += [
        getattr(m, "process_group", None)
        for m in model.modules()
        if isinstance(m, DistributedDataParallel)
    ]
    if not groups:
        return None
    ranks: set[int] = set()
    for pg in groups:
        ranks.update(
            range(dist.get_world_size()) if pg is None else dist.get_process_group_ranks(pg)
        )
    return sorted(ranks)


def steps_are_collective(model: Optional[torch.nn.Module]) -> bool:
    """True when a training step of ``model`` joins collectives with other ranks:
    it has sharded modules or a ``DistributedDataParallel`` on a process group
    of more than one rank; with ``model=None`` (a pipeline that does not hold
    the model, as ``StagedTrainPipeline``), whenever the world has more than
    one rank.  A model sharded over a one-rank group (a rank training on its
    own) runs no collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False
    if model is None:
        return True
    ranks = _model_ranks(model)
    return ranks is not None and len(ranks) > 1


def agreement_group(
    owner: object, model: Optional[torch.nn.Module], sync_exhaustion: Optional[bool]
) -> Optional[dist.ProcessGroup]:
    """The gloo group the :class:`~trec_pipelines.data.source.BatchSource` of
    ``owner`` (a pipeline) agrees on each pull over, or None when it agrees on
    nothing (see ``[Note: agreeing on each batch]``).  ``sync_exhaustion=None``
    agrees when the model's steps are collective (:func:`steps_are_collective`).
    Once ``owner`` is collected, the next call destroys the group."""
    lifetime.release_orphans()
    initialized = dist.is_available() and dist.is_initialized()
    if sync_exhaustion and not initialized:
        raise RuntimeError(
            "sync_exhaustion=True agrees on the end of data across ranks and needs "
            "torch.distributed initialised first (dist.init_process_group(...))"
        )
    if sync_exhaustion is None:
        sync_exhaustion = steps_are_collective(model)
    if not sync_exhaustion:
        return None
    ranks = _model_ranks(model) if model is not None else None
    if ranks is not None and len(ranks) == 1:
        # The model trains on this rank alone: there is no one to agree with,
        # and a group made here alone would be one the other ranks never make.
        return None
    groups = _model_groups(model) if model is not None else []
    timeout = next(filter(None, (_timeout_of(pg) for pg in groups if pg is not None)), None)
    # Over the world, by every rank at the same point: a model on some ranks
    # of the world (2D sharding's replica groups) still ends its data in step
    # with the others.
    group = dist.new_group(backend="gloo", timeout=timeout)
    assert isinstance(group, dist.ProcessGroup)  # every rank is a member
    return lifetime.own_group(group, owner=owner)


class Agreement:
    """One pull's agreement, under way: :meth:`result` waits for it."""

    def __init__(self, channel: "AgreementChannel", pull: int, outcome: int) -> None:
        self.code = (pull % _PULLS) * PER_PULL + outcome  # as encode() writes it
        self._channel = channel
        # Every rank's code (in the order of ``_ranks``), once known.
        self._codes: Optional[List[int]] = None
        self._ranks: Sequence[int] = channel.ranks
        # What the codes say, once read (see result()).
        self._agreed: Optional[Agreed] = None
        self._flags: Optional[torch.Tensor] = None
        self._work: Optional[dist.Work] = None
        # The splits exchange carrying this code, once one does (see CarriedCode).
        self.carrier: Optional["CarriedCode"] = None

    def all_reduce(self) -> None:
        """Start exchanging this pull's code on the channel's own group."""
        group = self._channel._group() or self._channel.group  # the property raises: released
        self._flags = torch.zeros(group.size(), dtype=torch.int64)
        self._flags[group.rank()] = self.code
        self._work = dist.all_reduce(self._flags, group=group, async_op=True)

    def deliver(self, codes: List[int], ranks: Sequence[int]) -> None:
        """Every rank's code, as a splits exchange brought them (see CarriedCode)."""
        self._codes, self._ranks, self._agreed = codes, ranks, None
        self._channel.carried_pulls += 1

    def result(self) -> Agreed:
        """Every rank's outcome of this pull (waits for the exchange carrying it).

        A carried pull is read twice, by the exchange (which raises there if the
        ranks are out of step) and by the batch source: the codes are decided
        once, and the decision is kept until other codes are delivered."""
        if self._agreed is not None:
            return self._agreed
        if self._codes is None and self.carrier is not None:
            self.carrier.wait_code()
        if self._codes is None:
            if self._work is None:  # carried by nothing yet: agree now
                self._channel.withdraw(self)
                self.all_reduce()
            assert self._work is not None and self._flags is not None
            self._work.wait()
            self._work = None
            self._codes = self._flags.tolist()
        self._agreed = decide(self._codes, self._ranks)
        return self._agreed


def decide(codes: Sequence[int], ranks: Sequence[int]) -> Agreed:
    """One pull's outcome from every rank's code; raises :class:`OutOfStepError`
    on every rank alike when the ranks' pull numbers differ."""
    # One pass over the ranks' codes, each read as (pull, outcome): it runs on
    # every pull, so it builds nothing it does not return.
    first_pull: Optional[int] = None
    malformed_on: List[int] = []
    failed_on: List[int] = []
    ended = 0
    for rank, code in zip(ranks, codes, strict=True):
        pull, outcome = divmod(code, PER_PULL)
        if outcome == NOTHING or (first_pull is not None and pull != first_pull):
            raise out_of_step(codes, ranks)
        first_pull = pull
        if outcome == ENDED:
            ended += 1
        elif outcome == MALFORMED:
            malformed_on.append(rank)
        elif outcome == FAILED:
            failed_on.append(rank)
    return Agreed(malformed_on, ended > 0, ended == len(codes), failed_on)


def out_of_step(codes: Sequence[int], ranks: Sequence[int]) -> OutOfStepError:
    """The error every rank raises alike when the ranks' ``codes`` are not of one pull
    (a rank that reports NOTHING has no pull)."""
    read = [divmod(code, PER_PULL) for code in codes]  # (pull, outcome) of each rank
    return OutOfStepError.at([None if o == NOTHING else p for p, o in read], ranks)


class CarriedCode:
    """What a splits exchange needs to carry one pull's code (see
    ``[Note: agreeing on each batch]``); implemented by the exchange."""

    def wait_code(self) -> None:
        """Wait for the exchange, which delivers the code to its agreement."""
        raise NotImplementedError


class AgreementChannel:
    """How one batch source's pulls are agreed: each pull's code rides the next
    splits exchange of the step (``carried``), or, where no exchange carries it, an
    all-reduce of its own on ``group``, started as the pull is made."""

    # A pipeline's first input_dist runs before its splits are fused (see
    # trec_pipelines.sparse.input_dist), and a fill may start two.
    MISSES_BEFORE_GIVING_UP = 4

    def __init__(self, group: dist.ProcessGroup, carried: bool) -> None:
        # Weakly: the group is owned by trec_pipelines.core.lifetime (released at exit).
        self._group = weakref.ref(group)
        self.carried = carried
        self.ranks: List[int] = dist.get_process_group_ranks(group)
        # Pulls waiting for an exchange to carry them, oldest first.
        self._waiting: Deque[Agreement] = deque()
        self._missed = 0  # exchanges in a row that carried nothing (see missed(), carrier_found())
        self.carried_pulls = 0  # pulls whose codes a splits exchange carried

    @property
    def group(self) -> dist.ProcessGroup:
        """The gloo group of the all-reduces."""
        group = self._group()
        if group is None:
            raise RuntimeError(
                "the process group the ranks agree on each batch over was released "
                "(the interpreter is exiting); build a new pipeline to train again"
            )
        return group

    def start(self, pull: int, ended: bool, malformed: bool, failed: bool = False) -> Agreement:
        """Report pull number ``pull``: a batch that ``ended`` or is ``malformed`` here,
        or whose ``next()`` ``failed``."""
        outcome = FAILED if failed else ENDED if ended else MALFORMED if malformed else FINE
        agreement = Agreement(self, pull, outcome)
        if self.carried:
            self._waiting.append(agreement)
        else:
            agreement.all_reduce()
        return agreement

    def carrier_found(self) -> None:
        """A splits exchange that carries a code is being made: the run of
        exchanges that could not (:meth:`missed`) ends, and its count starts again
        from 0 (those were a model's first input_dists, not exchanges that never carry)."""
        self._missed = 0

    def take(self) -> Optional[Agreement]:
        """The oldest pull waiting to be carried, taken off the queue for the
        exchange that carries it (None: nothing waits, the exchange carries NOTHING)."""
        return self._waiting.popleft() if self._waiting else None

    def withdraw(self, agreement: Agreement) -> None:
        """``agreement`` is agreed on its own: no exchange will carry it."""
        with contextlib.suppress(ValueError):
            self._waiting.remove(agreement)

    def missed(self) -> None:
        """A splits exchange could carry no code (none of its groups spans the
        world, or its splits are not fused yet: a model's first input_dist).
        After a few in a row the steps' exchanges are taken never to carry."""
        self._missed += 1
        if self._missed >= self.MISSES_BEFORE_GIVING_UP:
            self.no_carrier()

    def no_carrier(self) -> None:
        """The step's exchanges cannot carry codes (none spans the world):
        every pull from now on is agreed by an all-reduce of its own."""
        self.carried = False
        while self._waiting:
            self._waiting.popleft().all_reduce()

    @staticmethod
    def nothing() -> int:
        """The code of a rank with nothing to report in an exchange."""
        return encode(0, NOTHING)
