"""A pull's agreement carried by the step's own splits all-to-all.

Every sharded step already makes one exchange every rank joins: the fused
splits all-to-all of the pipelined ``input_dist``.  One more int64 per rank
rides in it: the code of the oldest pull the batch source has not agreed yet
(see ``[Note: agreeing on each batch]`` in :mod:`trec_pipelines.data.agreement`),
or NOTHING.  Waiting for the splits, as the step does anyway, then hands
every rank's code to that pull's agreement, at no collective of its own.

Only an exchange on a group that spans the world carries codes (the first
such group of a step; the others are left as they are).  Every rank builds
the same exchanges in the same order, so the same exchange carries the same
pull on every rank; a rank whose code differs in pull number, or carries
NOTHING where the others carry a pull, is out of step, and every rank raises
:class:`~trec_pipelines.core.errors.OutOfStepError` there, as it waits for the
splits.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import SplitsAllToAllAwaitable
from torchrec.distributed.embedding_sharding import (
    FusedKJTListSplitsAwaitable,
    KJTSplitsAllToAllMeta,
)

from trec_pipelines.data.agreement import (
    NOTHING,
    PER_PULL,
    Agreement,
    AgreementChannel,
    CarriedCode,
    out_of_step,
)


class _SplitsWithCode(SplitsAllToAllAwaitable, CarriedCode):
    """The splits all-to-all with one more column: this rank's code, to every rank.

    Waiting strips the column and delivers it; the result is kept, so the
    agreement may wait first and the fused splits awaitable after.
    """

    def __init__(
        self, tensors: List[torch.Tensor], pg: dist.ProcessGroup, channel: AgreementChannel
    ) -> None:
        channel.carrier_found()
        self._agreement: Optional[Agreement] = channel.take()
        code = channel.nothing() if self._agreement is None else self._agreement.code
        column = torch.full((pg.size(),), code, dtype=tensors[0].dtype, device=tensors[0].device)
        super().__init__(input_tensors=tensors + [column], pg=pg)
        self._ranks: Sequence[int] = dist.get_process_group_ranks(pg)
        self._splits: Optional[List[List[int]]] = None
        if self._agreement is not None:
            self._agreement.carrier = self

    def _wait_impl(self) -> List[List[int]]:
        if self._splits is not None:
            return self._splits
        received = super()._wait_impl()
        self._splits, codes = received[:-1], received[-1]
        agreement, self._agreement = self._agreement, None
        if agreement is None:
            if any(code % PER_PULL != NOTHING for code in codes):  # some rank sent a pull
                raise out_of_step(codes, self._ranks)
            return self._splits
        agreement.carrier = None  # no cycle left to hold this exchange (and its group)
        agreement.deliver(codes, self._ranks)
        agreement.result()  # raises here, on every rank, if they are out of step
        return self._splits

    def wait_code(self) -> None:
        self.wait()


class CarryingFusedSplits(FusedKJTListSplitsAwaitable):
    """torchrec's fused splits awaitable over ``pg``, whose all-to-all also
    carries one pull's code for ``channel`` (see the module note)."""

    def __init__(
        self,
        requests: List[Any],
        contexts: List[Any],
        pg: dist.ProcessGroup,
        channel: AgreementChannel,
    ) -> None:
        super().__init__(requests=requests, contexts=contexts, pg=None)  # launches nothing
        tensors = [
            tensor
            for awaitable in self._awaitables
            if isinstance(awaitable, KJTSplitsAllToAllMeta)
            for tensor in awaitable.splits_tensors
        ]
        assert tensors, "a fused group with nothing to exchange is waited on its own"
        self._splits_awaitable = _SplitsWithCode(tensors, pg, channel)
