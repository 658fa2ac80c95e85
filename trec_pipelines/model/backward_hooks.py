"""Work injected into the backward pass, at a named module.

``pipeline.register_backward_hook(site, work)`` runs ``work(pipeline)`` each
step when the backward reaches ``site``.  Two ways to get there:

* ``InjectionTargetType.ACTIVATION`` (default): a forward hook on the module
  asks ``site.tensor_finder`` for one tensor of that step's forward and hooks
  its gradient.  With :class:`OutputDistTensorFinder` on an embedding
  collection that tensor is the token of the output all-to-all (the
  ``dummy_tensor`` of its ``Request``): its gradient is ready once the
  backward all-to-all has been launched and before it is waited on, so the
  work overlaps that communication.
* ``InjectionTargetType.PARAM_GRAD``: a post-accumulate-grad hook on one
  parameter of the module (chosen by ``site.hook_position``), called once that
  parameter's gradient is complete.

The site types are ours, and torchrec's (``backward_injection.InjectionSite``
and friends) are accepted too: a site is read by its attributes ``fqn``,
``tensor_finder``, ``target_type`` (compared by value) and ``hook_position``.

Example::

    pipeline.register_backward_hook(
        InjectionSite("ebc", OutputDistTensorFinder(ShardingType.TABLE_WISE)),
        lambda p: stats.append(p),  # runs during ebc's backward all-to-all
    )
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Iterator,
    List,
    Optional,
    Protocol,
    Tuple,
    TypeVar,
    runtime_checkable,
)

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.utils.hooks import RemovableHandle
from torchrec.distributed.comm_ops import Request
from torchrec.distributed.types import NoWait, ShardingType
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from trec_pipelines.model.rewrite import unwrap

logger: logging.Logger = logging.getLogger(__name__)


class InjectionTargetType(enum.Enum):
    """How a site's hook is attached (see the module docstring)."""

    PARAM_GRAD = "param_grad"
    ACTIVATION = "activation"


@runtime_checkable
class GradTensorFinder(Protocol):
    """``(args, kwargs, output)`` of one forward of the module -> the tensor to hook, or None."""

    def __call__(
        self, module_input: Any, module_kwargs_input: Any, module_output: Any
    ) -> Optional[torch.Tensor]: ...


def _first_requiring_grad(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    if isinstance(value, (KeyedJaggedTensor, JaggedTensor)):
        # Their only differentiable part is the optional weights.
        weights = value.weights_or_none()
        return weights if weights is not None and weights.requires_grad else None
    items = (
        value.values()
        if isinstance(value, dict)
        else value
        if isinstance(value, (list, tuple))
        else ()
    )
    for item in items:
        found = _first_requiring_grad(item)
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class FirstGradTensorFinder:
    """The first tensor that requires grad in the module's output (or input,
    with ``use_input=True``; then keyword inputs are searched too), looking
    into lists, tuples, dicts and the weights of (Keyed)JaggedTensors."""

    use_input: bool = False

    def __call__(
        self, module_input: Any, module_kwargs_input: Any, module_output: Any
    ) -> Optional[torch.Tensor]:
        if not self.use_input:
            return _first_requiring_grad(module_output)
        found = _first_requiring_grad(module_input)
        return found if found is not None else _first_requiring_grad(module_kwargs_input)


@dataclass(frozen=True)
class OutputDistTensorFinder:
    """The output all-to-all token of a pipelined EBC/EC's shards of one sharding type.

    A pipelined module's forward returns the awaitable of its output dist, one
    part per sharding type.  This picks the part of ``sharding_type`` and
    returns its request's ``dummy_tensor``, or None when that part has no
    request (its output dist is not a collective).  Raises when the output is
    not such an awaitable (the module is not pipelined, or a pipeline whose
    lookup runs outside the forward: Fused, SemiSync) or has no part of that
    sharding type.
    """

    sharding_type: ShardingType = ShardingType.TABLE_WISE

    def __call__(
        self, module_input: Any, module_kwargs_input: Any, module_output: Any
    ) -> Optional[torch.Tensor]:
        output = (
            module_output[0] if isinstance(module_output, tuple) else module_output
        )  # managed collision
        parts = _output_dist_parts(output)
        if parts is None:
            raise RuntimeError(
                f"OutputDistTensorFinder: the module returned a {type(output).__name__}, not "
                "the awaitable of a pipelined embedding collection's output dist. Hook a "
                "sharded EBC/EC that the pipeline pipelines (see pipeline.rewrite_result), "
                "or use InjectionTargetType.PARAM_GRAD / FirstGradTensorFinder."
            )
        wanted = ShardingType(self.sharding_type)
        for awaitable, sharding in parts:
            if ShardingType(sharding) != wanted:
                continue
            if isinstance(awaitable, NoWait):  # data_parallel: no collective to hook
                return None
            request = getattr(awaitable, "_tensor_awaitable", None)
            return request.dummy_tensor if isinstance(request, Request) else None
        raise RuntimeError(
            f"OutputDistTensorFinder: no {wanted.value} shards in this module's output "
            f"(it has {[str(s) for _, s in parts]}); pick one of those sharding types"
        )


def _output_dist_parts(output: Any) -> Optional[List[Tuple[Any, Any]]]:
    """(awaitable, sharding type) per sharding of an EBC/EC output awaitable, else None."""
    shardings = getattr(output, "_sharding_types", None)
    # EBC (and variable-batch EBC) awaitables call their parts _awaitables, EC ones _awaitables_per_sharding.
    awaitables = getattr(output, "_awaitables", getattr(output, "_awaitables_per_sharding", None))
    if shardings is None or awaitables is None:
        return None
    return list(zip(awaitables, shardings, strict=True))


@dataclass(frozen=True)
class InjectionSite:
    """Where to inject backward work.

    Attributes:
        fqn: the module's name in the user's model (without the
            ``DistributedModelParallel`` / DDP prefixes), e.g. ``"sparse.ebc"``.
        tensor_finder: picks the tensor to hook each forward (``ACTIVATION`` only).
        target_type: ``ACTIVATION`` (default) or ``PARAM_GRAD``.
        hook_position: ``PARAM_GRAD`` only: which parameter, as a fraction of
            the module's parameter list (0.0 the first, 1.0 the last); if that
            one cannot take the hook, the nearest one that can.
    """

    fqn: str
    tensor_finder: GradTensorFinder
    target_type: InjectionTargetType = InjectionTargetType.ACTIVATION
    hook_position: float = 1.0


class Site(Protocol):
    """A site as this module reads it: ours (:class:`InjectionSite`) or torchrec's
    (``backward_injection.InjectionSite``).  ``target_type`` and ``hook_position``
    are read when the site has them (torchrec's older sites do not)."""

    @property
    def fqn(self) -> str: ...

    @property
    def tensor_finder(self) -> GradTensorFinder: ...


def _target_type(site: Site) -> InjectionTargetType:
    raw = getattr(site, "target_type", InjectionTargetType.ACTIVATION)
    try:
        return InjectionTargetType(getattr(raw, "value", raw))
    except ValueError:
        raise ValueError(
            f"register_backward_hook: unknown target_type {raw!r}; use "
            f"{[t.value for t in InjectionTargetType]}"
        ) from None


def register_backward_hook(
    site: Site, model: nn.Module, hook_fn: Callable[[torch.Tensor], None]
) -> RemovableHandle:
    """Attach ``hook_fn(grad)`` at ``site`` in ``model`` (DMP/DDP wrappers are looked through).

    Returns a handle whose ``remove()`` detaches it.  Raises ``ValueError``
    when ``site.fqn`` names no module or (``PARAM_GRAD``) the module has no
    parameter whose gradient hook can fire.
    """
    inner = unwrap(model)
    try:
        target = inner.get_submodule(site.fqn)
    except AttributeError:
        raise ValueError(
            f"register_backward_hook: no module {site.fqn!r} in the model; names are "
            f"relative to the user's model, e.g. {[n for n, _ in inner.named_children()][:5]}"
        ) from None
    kind = _target_type(site)
    if kind is InjectionTargetType.PARAM_GRAD:
        return _hook_parameter(site, target, hook_fn)
    return _hook_activation(site, target, hook_fn)


def _can_take_hook(param: torch.Tensor) -> bool:
    # Sharded embedding tables are updated inside fbgemm's fused backward,
    # which never calls post-accumulate-grad hooks: their ShardedTensors,
    # TBE slices (not leaves) and the placeholders of tables held by other
    # ranks (marked with their in-backward optimizer) are skipped.
    return (
        param.is_leaf
        and param.requires_grad
        and type(param).__name__ != "ShardedTensor"
        and not hasattr(param, "_in_backward_optimizers")
    )


def _nearest_first(start: int, n: int) -> Iterator[int]:
    """``start, start+1, start-1, start+2, ...`` within ``[0, n)``."""
    for offset in range(n):
        for index in (start,) if offset == 0 else (start + offset, start - offset):
            if 0 <= index < n:
                yield index


def _hook_parameter(
    site: Site, target: nn.Module, hook_fn: Callable[[torch.Tensor], None]
) -> RemovableHandle:
    params = list(target.named_parameters())
    if not params:
        raise ValueError(
            f"register_backward_hook: module {site.fqn!r} has no parameters; use ACTIVATION"
        )
    position = min(max(float(getattr(site, "hook_position", 1.0)), 0.0), 1.0)
    wanted = min(int(position * len(params)), len(params) - 1)
    chosen = next(
        (i for i in _nearest_first(wanted, len(params)) if _can_take_hook(params[i][1])), None
    )
    if chosen is None:
        raise ValueError(
            f"register_backward_hook: no parameter of {site.fqn!r} can take a gradient hook "
            f"({len(params)} parameters, none a dense leaf that requires grad); hook a dense "
            "module, or use ACTIVATION with OutputDistTensorFinder for embeddings"
        )
    name, param = params[chosen]
    logger.info(
        "register_backward_hook: %s.%s (parameter %d of %d)", site.fqn, name, chosen, len(params)
    )

    def after_accumulate(p: torch.Tensor) -> None:
        assert p.grad is not None, "post-accumulate-grad hook without a gradient"
        hook_fn(p.grad)

    handle: RemovableHandle = param.register_post_accumulate_grad_hook(after_accumulate)
    return handle


def _hook_activation(
    site: Site, target: nn.Module, hook_fn: Callable[[torch.Tensor], None]
) -> RemovableHandle:
    finder = site.tensor_finder

    def after_forward(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return  # no backward will come (eval under no_grad)
        tensor = finder(args, kwargs, output)
        if tensor is None:
            raise RuntimeError(
                f"register_backward_hook: the tensor finder found nothing to hook in the "
                f"forward of {site.fqn!r}; check the site's sharding type / finder"
            )
        tensor.register_hook(hook_fn)

    return target.register_forward_hook(after_forward, with_kwargs=True)


P = TypeVar("P")


def pipeline_hook(
    site: Site, pipeline: P, work: Callable[[P], None]
) -> Callable[[torch.Tensor], None]:
    """The gradient hook that runs ``work(pipeline)``, labelled for the profiler."""
    label = f"## backward_hook {site.fqn} ##"

    def run(grad: torch.Tensor) -> None:
        with record_function(label):
            work(pipeline)

    return run


__all__ = [
    "FirstGradTensorFinder",
    "GradTensorFinder",
    "InjectionSite",
    "InjectionTargetType",
    "OutputDistTensorFinder",
    "register_backward_hook",
]
