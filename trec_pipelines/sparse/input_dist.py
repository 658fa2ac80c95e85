"""Starting and finishing the sparse ``input_dist`` of the pipelined modules.

``input_dist`` is two collectives: the *splits* all-to-all (how many ids each
rank sends where) and then the *tensors* all-to-all (the ids themselves).  The
pipelines start the first phase for every module, fuse the splits of all modules
that share a process group into a single collective, and later wait for it,
which issues the tensors phase.

To fuse, each ``KJTAllToAll`` inside a pipelined module is made to return only
its splits metadata (:class:`SplitsOnlyKJTAllToAll`) instead of launching its
own splits collective; ``FusedKJTListSplitsAwaitable`` (torchrec) then launches
one collective per process group.

The splits-only forward may run on another process group of the same ranks
than the module's own (``input_dist_group="dedicated"``, see
``[Note: a dedicated input-dist group]`` in :mod:`trec_pipelines.core.input_dist_group`):
both all-to-alls then go there, through the group the metadata names.

A ``KJTAllToAll`` on a one-rank group is left as it is: it has nothing to
exchange and its own forward already skips the splits collective, so its
request is waited on its own.  (torchrec's pipelines fuse it anyway and run a
splits all-to-all of one rank every step; a plain loop over the same model
never does.)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, cast

import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import KJTAllToAll, KJTAllToAllTensorsAwaitable
from torchrec.distributed.embedding_sharding import (
    FusedKJTListSplitsAwaitable,
    KJTListAwaitable,
    KJTListSplitsAwaitable,
    KJTSplitsAllToAllMeta,
)
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from trec_pipelines._types import AnyShardedModule
from trec_pipelines.core import lifetime
from trec_pipelines.core.input_dist_group import GroupRef, InputDistGroup, dedicated_groups
from trec_pipelines.data.agreement import AgreementChannel
from trec_pipelines.model.context import TrainPipelineContext
from trec_pipelines.model.postproc import use_context_for_postprocs
from trec_pipelines.model.rewrite import RewriteResult
from trec_pipelines.sparse.carried_agreement import CarryingFusedSplits

logger: logging.Logger = logging.getLogger(__name__)


class SplitsOnlyKJTAllToAll:
    """Stands in for ``KJTAllToAll.forward``: returns the splits metadata only."""

    def __init__(self, pg: dist.ProcessGroup, splits: List[int], stagger: int) -> None:
        # Weakly: a dedicated group is owned by trec_pipelines.core.lifetime, and
        # one this override kept alive would keep its threads past the exit.
        self._group: GroupRef = weakref.ref(pg)
        # A dedicated group stays usable only until it is released.
        self._owned = lifetime.is_owned(pg)
        # The registry's release count when the group was last found usable.
        self._checked_at = lifetime.Releases.count
        # This rank's place in the group, which names its keys: fixed for the
        # group's life, so asked once rather than on every input_dist.
        self._rank = dist.get_rank(pg)
        self._splits = splits
        self._stagger = stagger
        self._bounds = [0] + list(itertools.accumulate(splits))
        # What this override replaced (set by fuse_kjt_splits), to undo it.
        self.replaced: Optional["KJTDistOverride"] = None

    @property
    def _pg(self) -> dist.ProcessGroup:
        """The group, or an error saying it was released.  Whether a dedicated group
        is still owned is looked up only after some group was released since the
        last look (the registry's release count moved)."""
        pg = self._group()
        if pg is not None and self._checked_at == lifetime.Releases.count:
            return pg
        if pg is None or (self._owned and not lifetime.is_owned(pg)):
            raise RuntimeError(
                "the process group this pipelined input_dist ran on was released "
                "(release_input_dist_groups(), or the interpreter is exiting); call the "
                "pipeline's detach() then attach() to make a new one"
            )
        self._checked_at = lifetime.Releases.count
        return pg

    def __call__(self, input: KeyedJaggedTensor) -> KJTSplitsAllToAllMeta:
        with torch.no_grad():
            if len(input.keys()) != self._bounds[-1]:
                raise ValueError(
                    f"input_dist got a KeyedJaggedTensor with {len(input.keys())} keys "
                    f"but the sharding plan expects {self._bounds[-1]}; the batch must "
                    "carry exactly the features the sharded module was planned for"
                )
            pg = self._pg  # raises if the group was released
            rank = self._rank
            device = input.values().device
            input_splits = input.dist_splits(self._splits)
            splits_tensors = [torch.tensor(s, device=device) for s in input_splits]
            if not input.variable_stride_per_key():
                # Every rank also learns every other rank's batch size.
                splits_tensors.append(torch.tensor([input.stride()] * pg.size(), device=device))
            return KJTSplitsAllToAllMeta(
                pg=pg,
                _input=input,
                splits=self._splits,
                splits_tensors=splits_tensors,
                input_splits=input_splits,
                input_tensors=input.dist_tensors(),
                labels=input.dist_labels(),
                keys=input.keys()[self._bounds[rank] : self._bounds[rank + 1]],
                device=device,
                stagger=self._stagger,
            )


@dataclass(frozen=True)
class KJTDistOverride:
    """One ``KJTAllToAll`` whose forward was swapped, and how to undo it."""

    dist_module: KJTAllToAll
    had_instance_forward: bool
    original_forward: Optional[Callable[..., Any]]


def _kjt_all_to_alls(modules: Sequence[AnyShardedModule]) -> List[KJTAllToAll]:
    found: List[KJTAllToAll] = []
    for module in modules:
        for fqn, child in module.named_modules():
            if getattr(child, "_has_uninitialized_input_dist", False):
                raise RuntimeError(
                    f"{fqn or type(module).__name__}: input_dist is not initialised yet; "
                    "run one input_dist before fusing its splits"
                )
            for input_dist in getattr(child, "_input_dists", None) or []:
                kjt_dist = getattr(input_dist, "_dist", None)
                if isinstance(kjt_dist, KJTAllToAll):
                    found.append(kjt_dist)
    return found


def kjt_process_groups(modules: Sequence[AnyShardedModule]) -> List[dist.ProcessGroup]:
    """The distinct process groups the ``KJTAllToAll``s in ``modules`` run on."""
    return list(dict.fromkeys(kjt_dist._pg for kjt_dist in _kjt_all_to_alls(modules)))


def fuse_kjt_splits(
    modules: Sequence[AnyShardedModule],
    groups: Optional[Mapping[dist.ProcessGroup, dist.ProcessGroup]] = None,
) -> Tuple[KJTDistOverride, ...]:
    """Make every ``KJTAllToAll`` in ``modules`` hand back splits metadata only.

    ``groups`` maps a module's process group to the one its input_dist runs on
    instead (the dedicated groups); a group not in it is used as it is.
    """
    overrides = []
    for kjt_dist in _kjt_all_to_alls(modules):
        if kjt_dist._pg.size() == 1:
            continue  # nothing to exchange: its own forward skips the splits collective
        overrides.append(
            KJTDistOverride(
                dist_module=kjt_dist,
                had_instance_forward="forward" in kjt_dist.__dict__,
                original_forward=kjt_dist.__dict__.get("forward"),
            )
        )
        pg = (groups or {}).get(kjt_dist._pg, kjt_dist._pg)
        splits_only = SplitsOnlyKJTAllToAll(pg, kjt_dist._splits, kjt_dist._stagger)
        splits_only.replaced = overrides[-1]
        object.__setattr__(kjt_dist, "forward", splits_only)
    return tuple(overrides)


def unfuse_left_over(module: AnyShardedModule) -> None:
    """Undo the splits-only overrides a collected pipeline left in ``module``
    (each remembers what it replaced), as :func:`unfuse_kjt_splits` would have."""
    for child in module.modules():
        for input_dist in getattr(child, "_input_dists", None) or []:
            kjt_dist = getattr(input_dist, "_dist", None)
            if not isinstance(kjt_dist, KJTAllToAll):
                continue
            while isinstance(kjt_dist.__dict__.get("forward"), SplitsOnlyKJTAllToAll):
                unfuse_kjt_splits([kjt_dist.__dict__["forward"].replaced])


def unfuse_kjt_splits(overrides: Sequence[KJTDistOverride]) -> None:
    """Undo :func:`fuse_kjt_splits` exactly."""
    for override in overrides:
        if override.had_instance_forward:
            object.__setattr__(override.dist_module, "forward", override.original_forward)
        else:
            override.dist_module.__dict__.pop("forward", None)


class SplitsFusion:
    """The splits-only overrides a pipeline installs on its modules, and the
    process groups their input_dist runs on (``input_dist_group``).

    The dedicated groups are resolved at the first :meth:`fuse` after a
    rewrite, a collective every rank reaches at the same ``progress()`` (see
    :func:`~trec_pipelines.core.input_dist_group.dedicated_groups`), and reused
    when the same rewrite is fused again (``attach()`` after ``detach()``),
    which then issues no collective, unless they were released meanwhile
    (:func:`~trec_pipelines.core.input_dist_group.release_input_dist_groups`,
    the exit).  :meth:`new_rewrite` forgets them.
    """

    def __init__(self, input_dist_group: InputDistGroup) -> None:
        self.input_dist_group: InputDistGroup = input_dist_group
        # The dedicated groups held weakly (see SplitsOnlyKJTAllToAll).
        self._groups: Optional[Dict[dist.ProcessGroup, GroupRef]] = None
        self.overrides: Tuple[KJTDistOverride, ...] = ()
        self.fused = False

    def fuse(self, modules: Sequence[AnyShardedModule]) -> None:
        """Install the overrides on ``modules`` (whose input_dists exist by now)."""
        if self.input_dist_group == "dedicated" and (
            self._groups is None or len(self.groups) < len(self._groups)
        ):
            # The first fuse of a rewrite, or one after its groups were released.
            found = dedicated_groups(kjt_process_groups(modules))
            self._groups = {pg: weakref.ref(group) for pg, group in found.items()}
        self.overrides = fuse_kjt_splits(modules, self.groups)
        self.fused = True

    def unfuse(self) -> None:
        """Give every ``KJTAllToAll`` its own forward back."""
        unfuse_kjt_splits(self.overrides)
        self.overrides = ()
        self.fused = False

    def new_rewrite(self) -> None:
        """The next :meth:`fuse` is of another rewrite: resolve its groups again."""
        self._groups = None

    @property
    def groups(self) -> Dict[dist.ProcessGroup, dist.ProcessGroup]:
        """Each module group -> the group its input_dist runs on, where they differ."""
        live = {pg: ref() for pg, ref in (self._groups or {}).items()}
        return {pg: g for pg, g in live.items() if g is not None and lifetime.is_owned(g)}


def start_input_dist(
    rewrite: Optional[RewriteResult],
    batch: Any,
    context: TrainPipelineContext,
    agreement: Optional[AgreementChannel] = None,
) -> None:
    """Launch the splits phase of the ``input_dist`` of every module ``rewrite``
    pipelined (None: the model was not rewritten, nothing to launch) for ``batch``.

    Writes ``module_contexts``, ``input_dist_splits_requests`` and
    ``fused_splits_awaitables`` (and, through the postprocs the arguments are read
    from, ``postproc_fwd_results``).  With ``agreement``, the splits exchange
    carries the oldest pull it has not agreed yet (see
    :mod:`trec_pipelines.sparse.carried_agreement`).
    """
    pipelined = rewrite.pipelined if rewrite is not None else ()
    # The postprocs cache their output in the context they hold: this batch's
    # for the stage, the forward's again after it.
    postprocs = rewrite.postprocs if rewrite is not None else ()
    with use_context_for_postprocs(postprocs, context) if postprocs else contextlib.nullcontext():
        for entry in pipelined:
            args, kwargs = entry.call_args.build_args_kwargs(batch)
            _start_module_input_dist(entry.name, entry.module, args, kwargs, context)
    # With free_features_storage_early, a module lists the batch KJTs it has
    # finished with; every module has permuted its features by now.  Storage
    # the loader's batch still owns (no copy was made) is only forgotten.
    for module_ctx in context.module_contexts.values():
        releasable = getattr(module_ctx, "early_releasable_inputs", None)
        if releasable:
            if not context.features_shared_with_loader:
                for kjt in releasable:
                    kjt.clear_storage()
            releasable.clear()
    _fuse_splits(context, agreement)


def _start_module_input_dist(
    name: str,
    module: AnyShardedModule,
    args: Sequence[Any],
    kwargs: Dict[str, Any],
    context: TrainPipelineContext,
) -> None:
    """Start ``module``'s ``input_dist`` on its call arguments, as ``name`` in ``context``."""
    # torchrec annotates a list; the arguments a forward got are a tuple, and both work.
    call_args, call_kwargs = module.preprocess_input(cast(List[Any], args), kwargs)
    module_ctx = module.create_context()
    context.module_contexts[name] = module_ctx
    context.input_dist_splits_requests[name] = module.input_dist(
        module_ctx, *call_args, **call_kwargs
    )


def _fuse_splits(
    context: TrainPipelineContext, agreement: Optional[AgreementChannel] = None
) -> None:
    names_per_pg: Dict[dist.ProcessGroup, List[str]] = defaultdict(list)
    for name, request in context.input_dist_splits_requests.items():
        # The group of its splits all-to-all (None: not one of torchrec's KJT input dists).
        metas = (
            getattr(request, "awaitables", ())
            if isinstance(request, KJTListSplitsAwaitable)
            else ()
        )
        pg = next((a.pg for a in metas if isinstance(a, KJTSplitsAllToAllMeta)), None)
        if pg is None:
            # Nothing to fuse (a one-rank group, or not a KJT input dist, as a
            # custom sharded module's): waited on its own.
            context.fused_splits_awaitables.append(([name], _Single(request)))
        else:
            names_per_pg[pg].append(name)
    carrier = None
    if agreement is not None and agreement.carried:
        # The channel's own group spans the world (agreement_group): its rank
        # count is the world size, without asking the default group each step.
        world = len(agreement.ranks)
        carrier = next((pg for pg in names_per_pg if pg.size() == world), None)
        if carrier is None:
            agreement.missed()  # the same on every rank: the same modules, groups
    for pg, names in names_per_pg.items():
        requests = [cast(Any, context.input_dist_splits_requests[n]) for n in names]
        contexts = [context.module_contexts[n] for n in names]
        fused: Awaitable[Any]
        if pg is carrier:
            assert agreement is not None
            fused = CarryingFusedSplits(requests, contexts, pg, agreement)
        else:
            fused = FusedKJTListSplitsAwaitable(requests=requests, contexts=contexts, pg=pg)
        context.fused_splits_awaitables.append((names, fused))


class _Single(Awaitable[List[Any]]):
    """Presents one splits awaitable with the fused awaitable's list result."""

    def __init__(self, request: Awaitable[Any]) -> None:
        super().__init__()
        self._request = request

    def _wait_impl(self) -> List[Any]:
        return [self._request.wait()]


def wait_input_dist(context: TrainPipelineContext) -> None:
    """Finish the splits phase, which launches the tensors phase.

    Reads ``fused_splits_awaitables``; writes ``input_dist_tensors_requests``.
    """
    for names, awaitable in context.fused_splits_awaitables:
        for name, request in zip(names, awaitable.wait(), strict=True):
            context.input_dist_tensors_requests[name] = request
    context.input_dist_splits_requests.clear()
    context.fused_splits_awaitables.clear()


def run_input_dist(
    module: AnyShardedModule, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Tuple[Any, Any]:
    """One module's whole ``input_dist`` on the arguments it was called with, now,
    on the current stream: ``(module_ctx, distributed input)``.

    For a forward that must run again after the pipelined input was used up (a
    retried batch); it issues the collectives the pipeline would have, through the
    same splits-only path, so the result is the pipelined one bit for bit.
    """
    name = "module"
    context = TrainPipelineContext()
    _start_module_input_dist(name, module, args, kwargs, context)
    _fuse_splits(context)
    wait_input_dist(context)
    return context.module_contexts[name], context.input_dist_tensors_requests[name].wait()


def release_input_dist_inputs(context: TrainPipelineContext) -> None:
    """Free the input storage of in-flight tensors all-to-alls (``clear_data_dist_inputs``)."""
    for request in context.input_dist_tensors_requests.values():
        if isinstance(request, KJTListAwaitable):
            for awaitable in request.awaitables:
                if isinstance(awaitable, KJTAllToAllTensorsAwaitable):
                    awaitable.clear_inputs()
