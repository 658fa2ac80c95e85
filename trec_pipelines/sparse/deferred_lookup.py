"""Tables whose lookup SemiSync leaves to their own batch's forward.

[Note: semi-sync and tables the dense optimizer updates]
Semi-sync looks batch ``i+1`` up before batch ``i``'s backward and update, so
that ``i+1``'s embeddings all-to-all overlaps ``i``'s backward.  That suits a
table whose optimizer is fused into the kernel (FBGEMM's TBE): its rows are
written inside the embedding backward, outside autograd, and the early lookup
simply reads them one update old.  A table with the ``dense`` compute kernel
is different: its weight is an ordinary autograd parameter, saved by the
lookup for its backward and updated in place by the dense optimizer after the
backward.  Looked up early, its saved weight is modified before the lookup's
own backward, which autograd rejects ("modified by an inplace operation").
``data_parallel`` tables always have the dense kernel (each rank holds a
replica, DDP averages the gradient), and torchrec's planner picks them for
small tables.

Such a table has nothing to gain from running ahead either: a
``data_parallel`` table has no embeddings all-to-all at all (its input and
output dists pass the local batch through).  So SemiSync leaves the lookup of
every sharding group whose tables all have the dense kernel to the batch's own
forward, after the previous step's update: those tables train synchronously,
like the dense parameters (with ``stash_gradients``, their gradient is applied
a step late, like the dense parameters').  A sharding group that mixes
dense-kernel and fused tables is looked up as one, so it cannot be split;
SemiSync refuses it at its first batch, naming the tables.

The deferral works on the sharded module's own ``compute_and_output_dist``:
while the other groups are looked up ahead, each deferred group's lookup and
output dist are replaced by stand-ins, and the awaitable the module returns
holds, in that group's place, one that runs the real lookup and output dist
when the forward waits for it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torchrec.distributed.types import Awaitable

DENSE_KERNEL = "dense"


@dataclass(frozen=True)
class DeferredGroup:
    """One sharding group of a sharded module, looked up in its batch's forward."""

    # A sharded module holding ``_lookups``, ``_output_dists`` and ``_sharding_types``
    # (torchrec's attributes, untyped here).
    owner: Any
    index: int  # the group's position in those lists
    sharding_type: str
    tables: Tuple[str, ...]
    module: str  # the name of the pipelined module it belongs to


@dataclass(frozen=True)
class DeferralPlan:
    """Which groups of a pipeline's modules are looked up in the forward, and which not."""

    deferred: Tuple[DeferredGroup, ...]
    # (module name, sharding type, tables) of the groups looked up ahead.
    ahead: Tuple[Tuple[str, str, Tuple[str, ...]], ...]

    def is_deferred(self, module: str, parameter: str) -> bool:
        """Whether ``parameter`` (a name within pipelined ``module``, such as
        ``embedding_bags.t0.weight``) is the weight of a deferred table."""
        parts = parameter.split(".")
        return len(parts) >= 2 and any(
            g.module == module and parts[-2] in g.tables for g in self.deferred
        )

    def describe(self) -> str:
        """One line for the log: the synchronous and the semi-synchronous tables."""
        sync = ", ".join(f"{list(g.tables)} ({g.sharding_type})" for g in self.deferred)
        semi = ", ".join(f"{list(tables)} ({kind})" for _, kind, tables in self.ahead)
        return (
            f"looked up in their own batch's forward (synchronous): {sync or 'none'}; "
            f"looked up a step ahead (semi-synchronous): {semi or 'none'}"
        )


def _groups(module: nn.Module) -> Iterator[Any]:
    """The module and its submodules that look up sharding groups one by one."""
    for sub in module.modules():
        lookups = getattr(sub, "_lookups", None)
        dists = getattr(sub, "_output_dists", None)
        kinds = getattr(sub, "_sharding_types", None)
        plan = getattr(sub, "module_sharding_plan", None)
        if (
            isinstance(lookups, (list, nn.ModuleList))
            and isinstance(dists, (list, nn.ModuleList))
            and isinstance(kinds, list)
            and isinstance(plan, dict)
            and len(lookups) == len(dists) == len(kinds)
        ):
            yield sub


def plan_deferral(modules: Sequence[Tuple[str, nn.Module]], pipeline: str) -> DeferralPlan:
    """Sort the groups of ``modules`` by kernel; raise ``ValueError`` on a mixed group.

    Reads each module's sharding plan, which is the same on every rank, so
    every rank defers the same groups and refuses the same models.
    """
    deferred: List[DeferredGroup] = []
    ahead: List[Tuple[str, str, Tuple[str, ...]]] = []
    for name, module in modules:
        for owner in _groups(module):
            plan: Any = owner.module_sharding_plan
            for index, kind in enumerate(owner._sharding_types):
                kernels = {
                    table: str(sharding.compute_kernel)
                    for table, sharding in plan.items()
                    if sharding.sharding_type == kind
                }
                dense = tuple(sorted(t for t, k in kernels.items() if k == DENSE_KERNEL))
                fused = tuple(sorted(t for t, k in kernels.items() if k != DENSE_KERNEL))
                if dense and fused:
                    raise ValueError(
                        f"{pipeline}: module '{name}' looks up its {kind} tables {list(dense)} "
                        f"(dense kernel) and {list(fused)} (kernels "
                        f"{sorted({kernels[t] for t in fused})}) as one group, which "
                        "semi-sync cannot train: a dense-kernel table is updated in place "
                        "by the dense optimizer after the next batch's lookup has read it, "
                        "and one group is looked up all ahead or all in the forward. Give "
                        f"the {kind} tables of '{name}' one kind of kernel: a fused kernel "
                        "(semi-synchronous; e.g. ParameterConstraints(compute_kernels="
                        "['fused'])), or move the dense-kernel ones to data_parallel "
                        "(synchronous, looked up in their own batch's forward)."
                    )
                if dense:
                    deferred.append(DeferredGroup(owner, index, kind, dense, name))
                elif fused:
                    ahead.append((name, kind, fused))
    return DeferralPlan(tuple(deferred), tuple(ahead))


class _LookupInForward(Awaitable[torch.Tensor]):
    """A deferred group's embeddings: looked up and output-dist'ed when waited for."""

    def __init__(
        self, lookup: nn.Module, dist: nn.Module, features: Any, sharding_context: Any
    ) -> None:
        super().__init__()
        self._lookup = lookup
        self._dist = dist
        self._features = features
        self._sharding_context = sharding_context

    def _wait_impl(self) -> torch.Tensor:
        embeddings = self._lookup(self._features)
        result: torch.Tensor = self._dist(embeddings, self._sharding_context).wait()
        return result


class _HeldLookup(nn.Module):
    """Stands in for a deferred group's lookup: keeps the group's input, computes nothing."""

    def __init__(self, lookup: nn.Module) -> None:
        super().__init__()
        self.real = lookup
        self.features: Optional[Any] = None

    def forward(self, features: Any) -> torch.Tensor:
        self.features = features
        return torch.empty(0)


class _HeldDist(nn.Module):
    """Stands in for a deferred group's output dist: returns the lookup to run later."""

    def __init__(self, held: _HeldLookup, dist: nn.Module) -> None:
        super().__init__()
        self.held = held
        self.real = dist

    def forward(self, _embeddings: torch.Tensor, sharding_context: Any = None) -> Any:
        features, self.held.features = self.held.features, None
        return _LookupInForward(self.held.real, self.real, features, sharding_context)


@contextlib.contextmanager
def deferring(plan: DeferralPlan) -> Iterator[None]:
    """Within: the deferred groups' lookups wait for the forward (see the Note above)."""
    swapped: List[Tuple[DeferredGroup, nn.Module, nn.Module]] = []
    try:
        for group in plan.deferred:
            lookups: Any = group.owner._lookups
            dists: Any = group.owner._output_dists
            lookup, dist = lookups[group.index], dists[group.index]
            swapped.append((group, lookup, dist))
            held = _HeldLookup(lookup)
            lookups[group.index] = held
            dists[group.index] = _HeldDist(held, dist)
        yield
    finally:
        for group, lookup, dist in swapped:
            group.owner._lookups[group.index] = lookup
            group.owner._output_dists[group.index] = dist
