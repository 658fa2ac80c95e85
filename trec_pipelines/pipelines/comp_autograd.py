"""TrainPipelineSparseDistCompAutograd: SparseDist whose backward compiled autograd compiles."""

from __future__ import annotations

import contextlib
import logging
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Iterator,
    Optional,
    Tuple,
    Type,
    Union,
)

import torch
import torch._functorch.config
import torch._inductor.config
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed import comm_ops
from torchrec.distributed.train_pipeline import In, Out
from typing_extensions import Unpack

from trec_pipelines.assembly.options import SparseDistTrainOptions, takes_options
from trec_pipelines.core.step_guard import guarded_step
from trec_pipelines.core.subclass_hooks import ASYNC_SUBMIT_OFF, never_called
from trec_pipelines.model.compiler_settings import HeldSettings
from trec_pipelines.model.context import TrainPipelineContext
from trec_pipelines.observe import recorder as rec
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist

logger: logging.Logger = logging.getLogger(__name__)

# The compiler settings upstream sets for compiled autograd, per config module:
# reorder the compiled backward so collectives overlap compute, keep views
# recomputable and don't CSE the graph; trace nn modules inline.
_SETTINGS: Tuple[Tuple[Any, Dict[str, Any]], ...] = (
    (torch._dynamo.config, {"inline_inbuilt_nn_modules": True, "skip_fsdp_hooks": False}),
    (torch._functorch.config, {"recompute_views": True, "cse": False}),
    (
        torch._inductor.config,
        {
            "reorder_for_compute_comm_overlap": True,
            "reorder_for_compute_comm_overlap_passes": [
                "sink_waits",
                "raise_comms",
                "reorder_compute_for_overlap",
            ],
        },
    ),
)


def _live(config: Any, name: str) -> bool:
    # Settings this PyTorch lacks (skip_fsdp_hooks) or keeps only as deprecated
    # no-ops (inline_inbuilt_nn_modules in 2.13, always on) are left alone:
    # touching a deprecated one only warns.
    entry = getattr(config, "_config", {}).get(name)
    return entry is not None and not getattr(entry, "deprecated", False)


def _held_settings() -> HeldSettings:
    return HeldSettings(
        [
            (config, name, value)
            for config, settings in _SETTINGS
            for name, value in settings.items()
            if _live(config, name)
        ]
    )


def compiled_autograd_settings() -> ContextManager[None]:
    """Hold the compiler settings of :class:`TrainPipelineSparseDistCompAutograd` for a ``with``.

    On exit every setting is back to what it was.
    """
    return _held_settings().held()


def touched_settings() -> Dict[str, Any]:
    """``"module.name" -> current value`` of every setting the pipeline holds (for checks)."""
    return _held_settings().current()


# [Note: DDP's reducer under compiled autograd]
# DDP picks its gradient reducer when it is built: the C++ Reducer (default)
# hooks every parameter's AccumulateGrad node with C++ hooks that compiled
# autograd refuses to capture; with optimize_ddp="python_reducer" DDP instead
# registers post-accumulate-grad hooks in Python that divide the gradient by
# the world size and all-reduce it with functional collectives, which compiled
# autograd traces into the backward graph.  A model built the usual way has the
# C++ one, so the pipeline switches each such DDP to the Python hooks: it
# removes the C++ Reducer's autograd hooks (DDP's own _remove_autograd_hooks),
# marks the DDP as using the Python reducer (its forward then skips the C++
# Reducer's per-iteration bookkeeping) and registers the Python hooks (DDP's
# own _register_accum_grad_hook).  Same arithmetic, so training is unchanged;
# the switch is kept for the model's life (the C++ hooks cannot be put back)
# and works in eager backward too.  Global state DDP's constructor would set in
# that mode is not touched, except that dynamo must inline DDP's module to
# trace those hooks: that trace rule is held only around the compiled region.
_DDP_MODULE = "torch.nn.parallel.distributed"


def _unsupported_by_python_reducer(ddp: DistributedDataParallel) -> Optional[str]:
    if getattr(ddp, "_comm_hooks", None):
        return "it has a communication hook registered on its C++ reducer"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "it uses DDP mixed precision"
    if getattr(ddp, "_delay_all_reduce_params", None):
        return "it delays the all-reduce of some parameters"
    if getattr(getattr(ddp, "_bucket_config", None), "per_bucket_bytes_caps", ()):
        return "it has per-bucket size limits (bucket_cap_mb_list)"
    return None


def use_python_reducer(model: torch.nn.Module, pipeline: str) -> int:
    """Switch every C++-reducer DDP in ``model`` to DDP's Python reducer hooks;
    return how many were switched (see [Note: DDP's reducer under compiled autograd])."""
    switched = 0
    for name, module in model.named_modules():
        if not isinstance(module, DistributedDataParallel) or getattr(
            module, "_use_python_reducer", False
        ):
            continue
        reason = _unsupported_by_python_reducer(module)
        if reason is not None:
            raise RuntimeError(
                f"{pipeline}: '{name or type(module).__name__}' is a DistributedDataParallel "
                f"with the C++ reducer, which compiled autograd cannot run, and {reason}, so "
                "it cannot be switched to the Python reducer. Build the model (DMP included) "
                'inside `with torch._dynamo.config.patch(optimize_ddp="python_reducer"):` '
                "without that option, or use TrainPipelineSparseDist."
            )
        module._remove_autograd_hooks()
        module._use_python_reducer = True
        module._register_accum_grad_hook()
        switched += 1
        logger.info("%s: DDP '%s' now reduces gradients with the Python reducer", pipeline, name)
    return switched


@contextlib.contextmanager
def _inline_ddp_for_dynamo() -> Iterator[None]:
    rules = torch._dynamo.trace_rules
    added = _DDP_MODULE not in rules.LEGACY_MOD_INLINELIST
    if added:
        rules.LEGACY_MOD_INLINELIST.add(_DDP_MODULE)
        rules.get_legacy_mod_inlinelist.cache_clear()
    try:
        yield
    finally:
        if added:
            rules.LEGACY_MOD_INLINELIST.discard(_DDP_MODULE)
            rules.get_legacy_mod_inlinelist.cache_clear()


@contextlib.contextmanager
def sync_collectives() -> Iterator[None]:
    """torchrec's collectives run synchronously (waited where issued) inside the ``with``.

    Compiled autograd traces the backward of a synchronous all-to-all; the
    asynchronous one hides its wait in an awaitable it cannot see.  Unlike
    ``torchrec_use_sync_collectives`` the flag is restored on an exception too.
    """
    previous = comm_ops.USE_SYNC_COLLECTIVES
    comm_ops.set_use_sync_collectives(True)
    try:
        yield
    finally:
        comm_ops.set_use_sync_collectives(previous)


@takes_options(SparseDistTrainOptions)
class TrainPipelineSparseDistCompAutograd(TrainPipelineSparseDist[In, Out]):
    """Three batches in flight, as :class:`TrainPipelineSparseDist`; the backward is compiled.

    ==========  =======  ===========================================================
    stream      slot     work
    ==========  =======  ===========================================================
    default     ``cur``  zero_grad, wait, forward, backward (compiled autograd), step
    data_dist   ``nxt``  input_dist: splits all-to-all, then tensors all-to-all
    memcpy      ``new``  host-to-device copy
    ==========  =======  ===========================================================

    The slots are :class:`TrainPipelineSparseDist`'s.  The forward and the
    backward run with torchrec's collectives synchronous and under
    ``torch._dynamo.compiled_autograd``, so each backward is captured as a
    graph and compiled with ``torch.compile(**options)``.

    ``options`` is ``model._compiled_autograd_options`` when the model has it,
    else ``backend="inductor", dynamic=True`` and ``fullgraph=True`` (on CPU
    ``fullgraph=False``: fbgemm's CPU kernels of the embedding backward cannot
    be traced, so they run eagerly between compiled pieces).  As in torchrec,
    the first forward runs without compiled autograd and every backward runs
    with it.  From the forward to the end of the backward the compiler settings
    of :func:`compiled_autograd_settings` are held (inductor reorders the
    backward so collectives overlap compute), and only then; no global dynamo
    setting is changed.  The model is taken as it is built: compiled autograd
    cannot trace the hooks of DDP's C++ reducer (what
    ``DistributedModelParallel`` builds for its dense part by default), so the
    constructor switches each such DDP to DDP's Python reducer, which does the
    same arithmetic (see the note "DDP's reducer under compiled autograd" in the source of
    ``trec_pipelines.pipelines.comp_autograd``); the
    switch stays with the model.  A model built under
    ``torch._dynamo.config.patch(optimize_ddp="python_reducer")`` is used as
    is.  Epochs, failed steps, iterators and our keyword-only options are as in
    :class:`TrainPipelineSparseDist`.

    Backward hooks (:meth:`register_backward_hook`, tensor and module hooks)
    are traced into the captured backward.  A hook that changes Python state,
    such as appending to a list or counting its calls, makes every backward
    compile again (seconds a step, as with torchrec's class); wrap such a hook
    in ``torch.compiler.disable`` and it runs as written, outside the graph.

    Differences from torchrec: :ref:`the migration guide <migrating-comp-autograd>` (docs/guides/migrating.md).

    Example::

        model = DistributedModelParallel(module, ...)
        pipeline = TrainPipelineSparseDistCompAutograd(model, optimizer, device)
        pipeline.progress(it)  # one batch a call, until StopIteration

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
    """

    # torchrec's CompAutograd runs its backward itself, under compiled autograd,
    # and leaves _state IDLE.
    _traits = TrainPipelineSparseDist._traits.updated(
        hooks={
            "_backward": never_called(
                "TrainPipelineSparseDistCompAutograd",
                "nothing: pass grad_scaler= for a scaled backward",
            ),
            "_submit_inplace_copy": ASYNC_SUBMIT_OFF,
        },
        tracks_state=False,
    )

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        context_type: Type[TrainPipelineContext] = TrainPipelineContext,
        pipeline_postproc: bool = False,
        custom_model_fwd: Optional[Callable[[Optional[Any]], Tuple[torch.Tensor, Any]]] = None,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        **options: Unpack[SparseDistTrainOptions],
    ) -> None:
        super().__init__(
            model,
            optimizer,
            device,
            execute_all_batches,
            apply_jit,
            context_type,
            pipeline_postproc,
            custom_model_fwd,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            **options,
        )
        default_options: Dict[str, Union[str, bool]] = {
            "backend": "inductor",
            "dynamic": True,
            "fullgraph": self._device.type != "cpu",
        }
        self.compiled_autograd_options: Dict[str, Union[str, bool]] = getattr(
            model, "_compiled_autograd_options", default_options
        )
        self._compiler = torch.compile(**self.compiled_autograd_options)
        self._settings = _held_settings()
        # False until the first forward, which runs without compiled autograd.
        self.initialized = False
        self.switched_ddp_reducers = use_python_reducer(model, type(self).__name__)

    def get_compiled_autograd_ctx(self) -> ContextManager[None]:
        """Compiled autograd plus the compiler settings; nothing on the very first call."""
        if not self.initialized:
            self.initialized = True
            return contextlib.nullcontext()
        return self._compiled_region()

    def _compiled_region(self) -> ContextManager[None]:
        return torch._dynamo.compiled_autograd._enable(self._compiler)

    @contextlib.contextmanager
    def _compiler_settings(self) -> Iterator[None]:
        # Held once per step, from the forward to the end of the backward.
        with self._settings.held(), _inline_ddp_for_dynamo():
            yield

    def _compiled_forward(self) -> Tuple[torch.Tensor, Any]:
        with self.get_compiled_autograd_ctx(), sync_collectives():
            return self._forward()

    def _compiled_backward(self, losses: torch.Tensor) -> None:
        with self.get_compiled_autograd_ctx(), sync_collectives():
            with self._recording.span(rec.BACKWARD, self.contexts[0].index):
                self._precision.backward(torch.sum(losses, dim=0))

    @guarded_step
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one step on the next batch of ``dataloader_iter``; return its output.

        What every ``progress()`` does: :class:`~trec_pipelines.PipelineOptions`.
        """
        # See [Note: a progress() timeline] in trec_pipelines.pipelines.
        # fmt: off
        self._start_step(dataloader_iter)  # fill, pull host batches, stop at end of data
        training = self._model.training

        if training:
            self._zero_grad()                                      # cur, default
        self._wait_for_batch()                                     # cur, data_dist -> default
        if self._clear_data_dist_inputs:
            self.clear_sparse_data_dist_inputs(self.contexts[0])
        if len(self.batches) >= 2:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])  # nxt, data_dist
        self.enqueue_batch(dataloader_iter)                        # new, memcpy
        with self._compiler_settings():
            losses, output = self._compiled_forward()              # cur, default
            if len(self.batches) >= 2:
                self.wait_sparse_data_dist(self.contexts[1])       # nxt, data_dist
            if training:
                self._compiled_backward(losses)                    # cur, default (compiled)
        if training:
            self.sync_embeddings(
                self._model, self._dmp_collection_sync_interval_batches, self.contexts[0]
            )
            self._optimizer_step()                                 # cur, default
        self.dequeue_batch()
        return output


__all__ = [
    "TrainPipelineSparseDistCompAutograd",
    "use_python_reducer",
    "compiled_autograd_settings",
    "sync_collectives",
    "touched_settings",
]
