"""TrainPipelineSparseDistCompAutograd: SparseDist whose backward compiled autograd compiles."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, Iterator, Optional, Tuple, Type, Union

import torch
import torch._functorch.config
import torch._inductor.config
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed import comm_ops
from torchrec.distributed.train_pipeline import In, Out

from trec_pipelines import recorder as rec
from trec_pipelines.context import TrainPipelineContext
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist
from trec_pipelines.rewrite import Strategy
from trec_pipelines.stages import backward

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


@contextlib.contextmanager
def compiled_autograd_settings() -> Iterator[None]:
    """Hold the compiler settings of :class:`TrainPipelineSparseDistCompAutograd` for a ``with``.

    On exit every setting is back to what it was.
    """
    with contextlib.ExitStack() as stack:
        for config, settings in _SETTINGS:
            live = {name: _fresh(value) for name, value in settings.items() if _live(config, name)}
            stack.enter_context(config.patch(**live))
        yield


def touched_settings() -> Dict[str, Any]:
    """``"module.name" -> current value`` of every setting the pipeline holds (for checks)."""
    values: Dict[str, Any] = {}
    for config, settings in _SETTINGS:
        for name in settings:
            if _live(config, name):
                values[f"{config.__name__}.{name}"] = _fresh(getattr(config, name))
    return values


def _fresh(value: Any) -> Any:
    # A list setting is copied so that nobody's list is shared or mutated.
    return list(value) if isinstance(value, list) else value


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


class TrainPipelineSparseDistCompAutograd(TrainPipelineSparseDist[In, Out]):
    """Three batches in flight, as :class:`TrainPipelineSparseDist`; the backward is compiled.

    ==========  =======  ===========================================================
    stream      slot     work
    ==========  =======  ===========================================================
    default     ``cur``  zero_grad, wait, forward, backward (compiled autograd), step
    data_dist   ``nxt``  input_dist: splits all-to-all, then tensors all-to-all
    memcpy      ``new``  host-to-device copy
    ==========  =======  ===========================================================

    The forward and the backward run with torchrec's collectives synchronous
    and under ``torch._dynamo.compiled_autograd``, so each backward is
    captured as a graph and compiled with ``torch.compile(**options)``.
    ``options`` is ``model._compiled_autograd_options`` when the model has
    it, else ``backend="inductor", dynamic=True`` and ``fullgraph=True`` (on
    CPU ``fullgraph=False``, see below).  As upstream, the first forward runs
    without compiled autograd and every backward runs with it.  While they
    run, the compiler settings of :func:`compiled_autograd_settings` are held
    (inductor reorders the backward so collectives overlap compute).

    A model wrapped in ``DistributedDataParallel`` (DMP wraps its dense part)
    must have been built with the Python reducer: compiled autograd cannot
    trace the C++ reducer's hooks, and DDP picks its reducer when it is
    built.  Build the model inside
    ``with torch._dynamo.config.patch(optimize_ddp="python_reducer"):``.

    Differences from torchrec 1.8.0, all fixes:

    * The compiler settings are held only around the forward and the backward;
      upstream sets them globally for good in ``__init__``, and turns on
      verbose compiled-autograd logging globally (``torch._logging.set_logs``),
      which this class does not touch.
    * It runs on CPU.  Upstream fails there in the first backward: on the C++
      DDP reducer (what DMP builds by default), and with the Python reducer on
      ``fullgraph=True``, because fbgemm's CPU kernels of the embedding
      backward have no fake (meta) implementation to trace.  On CPU the
      default is ``fullgraph=False``: the embedding backward runs eagerly
      between compiled pieces.  A model with the C++ reducer fails before its
      first backward, with the fix named.
    * The synchronous-collectives flag is restored even when the forward or
      backward raises.
    * Embeddings of a ``DMPCollection`` are synced between replicas after the
      backward, as in :class:`TrainPipelineSparseDist`; upstream skips it here.
    * As :class:`TrainPipelineSparseDist`: a new epoch starts without
      ``reset()``; ``detach()``/``attach()`` keep the in-flight batches.

    Example::

        with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
            model = DistributedModelParallel(module, ...)
        pipeline = TrainPipelineSparseDistCompAutograd(model, optimizer, device)
        while True:
            try:
                pipeline.progress(it)
            except StopIteration:
                break
    """

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
        *,
        rewrite_strategy: Strategy = "auto",
        on_unpipelined: str = "warn",
        sync_exhaustion: bool = False,
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
            rewrite_strategy=rewrite_strategy,
            on_unpipelined=on_unpipelined,
            sync_exhaustion=sync_exhaustion,
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
        # False until the first forward, which runs without compiled autograd.
        self.initialized = False
        self._reducer_checked = False

    def get_compiled_autograd_ctx(self) -> ContextManager[None]:
        """Compiled autograd plus the compiler settings; nothing on the very first call."""
        if not self.initialized:
            self.initialized = True
            return contextlib.nullcontext()
        return self._compiled_region()

    @contextlib.contextmanager
    def _compiled_region(self) -> Iterator[None]:
        with compiled_autograd_settings():
            with torch._dynamo.compiled_autograd._enable(self._compiler):
                yield

    def _check_reducer(self) -> None:
        if self._reducer_checked:
            return
        for name, module in self._model.named_modules():
            if isinstance(module, DistributedDataParallel) and not getattr(
                module, "_use_python_reducer", False
            ):
                raise RuntimeError(
                    f"{type(self).__name__}: '{name or type(module).__name__}' is a "
                    "DistributedDataParallel with the C++ reducer, which compiled "
                    "autograd cannot run. DDP chooses its reducer when it is built, so "
                    "build the model (DistributedModelParallel included) inside "
                    "`with torch._dynamo.config.patch(optimize_ddp=\"python_reducer\"):`."
                )
        self._reducer_checked = True

    def _compiled_forward(self) -> Tuple[torch.Tensor, Any]:
        with self.get_compiled_autograd_ctx(), sync_collectives():
            return self._forward()

    def _compiled_backward(self, losses: torch.Tensor) -> None:
        self._check_reducer()
        with self.get_compiled_autograd_ctx(), sync_collectives():
            with self._span(rec.BACKWARD, self.contexts[0].index):
                backward(losses)

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
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
        losses, output = self._compiled_forward()                  # cur, default
        if len(self.batches) >= 2:
            self.wait_sparse_data_dist(self.contexts[1])           # nxt, data_dist
        if training:
            self._compiled_backward(losses)                        # cur, default (compiled)
            self.sync_embeddings(
                self._model, self._dmp_collection_sync_interval_batches, self.contexts[0]
            )
            self._optimizer_step()                                 # cur, default
        self.dequeue_batch()
        return output


__all__ = [
    "TrainPipelineSparseDistCompAutograd",
    "compiled_autograd_settings",
    "sync_collectives",
    "touched_settings",
]
