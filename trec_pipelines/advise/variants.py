"""Which pipeline variants ``advise`` can time on a model, and how each is built and driven.

A *variant* here is a training pipeline class of the package, or a user's
own class with the same constructor ``(model, optimizer, device, **kwargs)``,
trained through ``progress(it)`` until ``StopIteration``.
``StagedTrainPipeline`` is timed as the bench runs it: two stages (the copy
to the device, then ``SparseDataDistUtil``'s input dist), the loop doing
zero_grad, forward, backward and step on each batch it returns.  Whether a
variant applies is decided from the model alone, before anything is timed:

* eval pipelines never train (no backward, no optimizer step);
* compiled variants (PT2, CompAutograd) compile the model, which takes
  minutes and changes what is timed: only with ``include_compiled``;
* Prefetch needs a table whose lookup prefetches into a cache (compute
  kernel ``fused_uvm_caching`` or ``key_value``); elsewhere its prefetch
  does nothing and it is SparseDist with one more stream;
* torchrec's experimental pipelines (``trec_pipelines.experimental_pipelines``)
  are listed, not timed, unless named in ``variants``: their schedules are
  for particular setups (a device to stash memory on, an optimizer step in
  the backward, ...), not general advice;
* PEC needs PEC modules (``ShardedPECEmbeddingCollection``), and torchrec
  >= 1.9 to pipeline them.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import (
    Any,
    ContextManager,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
    cast,
)

import torch
from torch import nn
from torchrec.distributed.types import ShardedModule, ShardingPlan

import trec_pipelines.experimental_pipelines as experimental_pipelines
from trec_pipelines.pipelines.base import TrainPipelineBase
from trec_pipelines.pipelines.comp_autograd import TrainPipelineSparseDistCompAutograd
from trec_pipelines.pipelines.eval_fused_sparse_dist import EvalPipelineFusedSparseDist
from trec_pipelines.pipelines.eval_sparse_dist import EvalPipelineSparseDist
from trec_pipelines.pipelines.fused_sparse_dist import TrainPipelineFusedSparseDist
from trec_pipelines.pipelines.pec import TrainPipelinePEC
from trec_pipelines.pipelines.prefetch import PrefetchTrainPipelineSparseDist
from trec_pipelines.pipelines.pt2 import TrainPipelinePT2
from trec_pipelines.pipelines.semi_sync import TrainPipelineSemiSync
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist
from trec_pipelines.pipelines.sparse_dist_lite import TrainPipelineSparseDistLite
from trec_pipelines.pipelines.staged import StagedTrainPipeline

# Timed by default, in this order (the plain loop comes first in every round).
TRAIN_VARIANTS: Tuple[type, ...] = (
    TrainPipelineBase,
    TrainPipelineSparseDist,
    TrainPipelineSparseDistLite,
    TrainPipelineFusedSparseDist,
    TrainPipelineSemiSync,
    PrefetchTrainPipelineSparseDist,
    TrainPipelinePEC,
    StagedTrainPipeline,
    TrainPipelinePT2,
    TrainPipelineSparseDistCompAutograd,
)
# torchrec's experimental classes, ours: timed only when named in ``variants``.
EXPERIMENTAL: Tuple[type, ...] = tuple(
    getattr(experimental_pipelines, name) for name in experimental_pipelines.__all__
)
# Listed in the advice with the reason they are not timed.
OTHER_VARIANTS: Tuple[type, ...] = (
    EvalPipelineSparseDist,
    EvalPipelineFusedSparseDist,
    *EXPERIMENTAL,
)
COMPILED: Tuple[type, ...] = (TrainPipelinePT2, TrainPipelineSparseDistCompAutograd)

# Constructor arguments advise gives a variant (as the bench does): SemiSync's
# default start_batch (900) would keep it synchronous through any short run.
DEFAULT_KWARGS: Dict[type, Dict[str, Any]] = {TrainPipelineSemiSync: {"start_batch": 0}}

# Compute kernels whose lookups read through a cache that prefetch() fills.
PREFETCH_KERNELS = frozenset({"fused_uvm_caching", "key_value"})

VariantSpec = Union[str, type]


@dataclass(frozen=True)
class Variant:
    """One pipeline class as advise times it.

    Attributes:
        name: the class name (the key of every result).
        cls: the class, built as ``cls(model, optimizer, device, **kwargs)``.
        kwargs: constructor arguments advise adds (``DEFAULT_KWARGS``).
    """

    name: str
    cls: type
    kwargs: Dict[str, Any] = field(default_factory=dict)

    @property
    def compiled(self) -> bool:
        return issubclass(self.cls, COMPILED)

    @property
    def staged(self) -> bool:
        """Driven as StagedTrainPipeline: it returns batches and the loop trains them."""
        return issubclass(self.cls, StagedTrainPipeline)

    def build_context(self) -> ContextManager[Any]:
        """What ``build()`` runs under for this variant.

        Compiled autograd can't run DDP's C++ reducer, and DDP picks its
        reducer when the model is built, so CompAutograd's model is built
        with the Python one.
        """
        if issubclass(self.cls, TrainPipelineSparseDistCompAutograd):
            return cast(
                ContextManager[Any], torch._dynamo.config.patch(optimize_ddp="python_reducer")
            )
        return contextlib.nullcontext()


def _known() -> Dict[str, type]:
    return {cls.__name__: cls for cls in TRAIN_VARIANTS + OTHER_VARIANTS}


def resolve(variants: Optional[Sequence[VariantSpec]]) -> List[Variant]:
    """The variants asked for: class names of the package, or pipeline classes.

    ``None``: every variant of the package (compiled and not applicable ones
    are filtered later, with a reason each).
    """
    known = _known()
    if variants is None:
        return [
            Variant(cls.__name__, cls, dict(DEFAULT_KWARGS.get(cls, {})))
            for cls in TRAIN_VARIANTS + OTHER_VARIANTS
        ]
    out: List[Variant] = []
    for spec in variants:
        if isinstance(spec, str):
            if spec not in known:
                raise ValueError(
                    f"advise: variants={spec!r} is not a pipeline of trec_pipelines; "
                    f"use one of {', '.join(sorted(known))}, or pass a pipeline class"
                )
            cls = known[spec]
        elif inspect.isclass(spec):
            cls = spec
        else:
            raise TypeError(
                f"advise: variants must hold class names or pipeline classes, got {spec!r}"
            )
        if any(v.name == cls.__name__ for v in out):
            raise ValueError(f"advise: variant {cls.__name__} is listed twice")
        kwargs = next((dict(v) for base, v in DEFAULT_KWARGS.items() if issubclass(cls, base)), {})
        out.append(Variant(cls.__name__, cls, kwargs))
    return out


def sharding_plans(model: nn.Module) -> List[ShardingPlan]:
    """The sharding plans of every DistributedModelParallel in ``model`` (itself included)."""
    plans: List[ShardingPlan] = []
    for module in model.modules():
        plan = getattr(module, "plan", None)
        if isinstance(plan, ShardingPlan):
            plans.append(plan)
    return plans


def compute_kernels(model: nn.Module) -> List[str]:
    """Every table's compute kernel, from the model's sharding plans."""
    kernels: List[str] = []
    for plan in sharding_plans(model):
        for module_plan in plan.plan.values():
            for sharding in getattr(module_plan, "values", lambda: ())():
                kernel = getattr(sharding, "compute_kernel", None)
                if kernel is not None:
                    kernels.append(str(kernel))
    return kernels


def _pec_problem(model: nn.Module, pipeline: str) -> Optional[str]:
    """Why PEC has nothing to do on ``model``, or can't on this torchrec (None: it applies)."""
    from trec_pipelines.sparse.pec_ops import check_pec_supported, is_pec

    modules = [
        (name, m) for name, m in model.named_modules() if isinstance(m, ShardedModule) and is_pec(m)
    ]
    if not modules:
        return "no PEC module: the model has no ShardedPECEmbeddingCollection, so PEC has nothing of its own to do"
    try:
        check_pec_supported(modules, pipeline)
    except RuntimeError as exc:  # the torchrec installed has the old PEC API
        return f"its PEC modules need a newer torchrec: {exc}"
    return None


def not_applicable(
    variant: Variant, model: nn.Module, include_compiled: bool, named: bool = False
) -> Optional[str]:
    """Why ``variant`` is not timed on ``model`` (None: it is); ``named``: the user asked for it by name or class."""
    cls = variant.cls
    if cls in EXPERIMENTAL and not named:
        return (
            "experimental, not timed unless named in variants= (--variants): "
            "one of torchrec's experimental_pipelines"
        )
    if issubclass(cls, (EvalPipelineSparseDist, EvalPipelineFusedSparseDist)):
        return "an eval pipeline: no backward, no optimizer step; advise times training"
    if variant.compiled and not include_compiled:
        return (
            "compiled, not timed unless include_compiled=True (--include-compiled): "
            "torch.compile takes minutes, and it changes what is timed"
        )
    if issubclass(cls, PrefetchTrainPipelineSparseDist):
        kernels = set(compute_kernels(model))
        if not kernels & PREFETCH_KERNELS:
            found = ", ".join(sorted(kernels)) or "none found"
            return (
                "no table has a prefetchable cache: its prefetch would do nothing (compute kernel "
                f"{' or '.join(sorted(PREFETCH_KERNELS))}; this model's: {found})"
            )
    if issubclass(cls, TrainPipelinePEC):
        return _pec_problem(model, variant.name)
    return None


def examples_per_batch(batch: Any) -> Optional[int]:
    """Samples in one rank's batch: the stride of its first KeyedJaggedTensor (None: it has none)."""
    from trec_pipelines.data.validation import kjts_in

    kjts = kjts_in(batch)
    return int(kjts[0].stride()) if kjts else None


def iterable_problem(batches: Any) -> Optional[str]:
    """Why ``batches`` can't be iterated once per epoch (None: it can, as far as one can tell)."""
    if not isinstance(batches, Iterable):
        return f"batches is a {type(batches).__name__}, not an iterable of batches"
    if isinstance(
        batches, Iterator
    ):  # (not iter(batches) is batches: that would start a one-shot iterable)
        return (
            f"batches is an iterator ({type(batches).__name__}): it can be walked once, and advise walks it "
            "several times per build (warm-up, timed and measured epochs); return a list, or an iterable "
            "that restarts on each iter() such as a DataLoader"
        )
    return None


__all__ = [
    "COMPILED",
    "DEFAULT_KWARGS",
    "EXPERIMENTAL",
    "OTHER_VARIANTS",
    "PREFETCH_KERNELS",
    "TRAIN_VARIANTS",
    "Variant",
    "VariantSpec",
    "compute_kernels",
    "examples_per_batch",
    "iterable_problem",
    "not_applicable",
    "resolve",
    "sharding_plans",
]
