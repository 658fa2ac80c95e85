"""Gradient accumulation around any training pipeline.

:class:`GradientAccumulationWrapper` makes ``num_steps`` consecutive
``progress()`` calls share one optimizer step: the pipeline's optimizer is
swapped for an :class:`AccumulatingOptimizer` that lets ``zero_grad()`` and
``step()`` through only at accumulation boundaries, and the data-parallel
all-reduce is skipped (``no_sync()``) on the calls that end no window.

For call ``k`` (0-based, counted by the wrapper):

* ``optimizer.step()`` runs when ``(k + 1) % num_steps == 0``;
* ``optimizer.zero_grad()`` runs on the first call, and on the first call after
  a step that ran;
* gradients are all-reduced when ``k == 0``, ``k < num_warmup_steps``,
  ``(k + 1) % num_steps == 0`` or ``is_last_batch``; otherwise the pipeline's
  ``progress()`` runs under every DDP module's ``no_sync()``;
* at the end of the data, the pipeline's ``StopIteration`` first steps on an
  unfinished window, all-reduced first if it was accumulated under ``no_sync()``.

The first call always synchronises: DDP with ``static_graph=True`` must see an
all-reduce in its first backward.  Skipping the all-reduce loses nothing: on
the synchronising call DDP averages the gradients each rank accumulated
locally, which is the average of every call's gradients up to rounding.

Unlike torchrec 1.8.0 / 1.9.2, whose wrapper steps on the rank's local
gradients when the data ends inside a window (so data-parallel replicas stop
agreeing), the final partial window is all-reduced first: each DDP module's
parameter gradients are divided by its world size and summed across it, as DDP
itself does on a synchronising call.

Embedding tables with an optimizer fused into the backward (TBE) keep updating
every call: accumulation applies to what the wrapped optimizer steps.

Example::

    config = GradientAccumulationConfig(num_steps=4)
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    accumulating = GradientAccumulationWrapper(pipeline, optimizer, model, config)
    while True:
        try:
            accumulating.progress(it)
        except StopIteration:
            break
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, ContextManager, Generic, Iterator, List, Optional, Set

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.train_pipeline import In, Out, TrainPipeline

logger: logging.Logger = logging.getLogger(__name__)


@dataclass
class GradientAccumulationConfig:
    """How many ``progress()`` calls share an optimizer step.

    Attributes:
        is_enabled: accumulate at all; turned on by ``num_steps > 1``.
        num_steps: calls per optimizer step (at least 1).
        num_warmup_steps: the first calls, which all-reduce gradients on every
            call even inside a window (at least 1).
    """

    is_enabled: bool = False
    num_steps: int = 1
    num_warmup_steps: int = 1

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(
                f"GradientAccumulationConfig: num_steps={self.num_steps}; it counts "
                "progress() calls per optimizer step, pass 1 or more"
            )
        if self.num_warmup_steps < 1:
            raise ValueError(
                f"GradientAccumulationConfig: num_warmup_steps={self.num_warmup_steps}; "
                "the first call must all-reduce (DDP static_graph needs it), pass 1 or more"
            )
        if self.num_steps > 1:
            self.is_enabled = True


class AccumulatingOptimizer:
    """Stands in for the pipeline's optimizer and lets calls through at boundaries.

    ``step()`` reaches the real optimizer on the last call of a window;
    ``zero_grad()`` on the first call after a step that did.  Everything else
    (``param_groups``, ``state_dict`` ...) is the real optimizer's.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, config: GradientAccumulationConfig
    ) -> None:
        self._optimizer = optimizer
        self._config = config
        self._current_step = 0
        # Set once a real step ran: the next zero_grad() clears the window.
        self._needs_zero_grad = True

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The real optimizer."""
        return self._optimizer

    @property
    def current_step(self) -> int:
        """``progress()`` calls completed."""
        return self._current_step

    def ends_window(self) -> bool:
        """Whether the current call is the last of a window."""
        return (self._current_step + 1) % self._config.num_steps == 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._needs_zero_grad:
            self._optimizer.zero_grad(set_to_none=set_to_none)
            self._needs_zero_grad = False

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.ends_window():
            self._optimizer.step(*args, **kwargs)
            self._needs_zero_grad = True

    def flush(self) -> bool:
        """Step on the gradients of an unfinished window; False if there is none."""
        if self._current_step % self._config.num_steps == 0:
            return False
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._needs_zero_grad = False
        return True

    def advance_step(self) -> None:
        self._current_step += 1

    def set_step(self, step: int) -> None:
        if step < 0:
            raise ValueError(f"set_step({step}): the step count cannot be negative")
        self._current_step = step

    def reset(self) -> None:
        self._current_step = 0
        self._needs_zero_grad = True

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this class lacks.
        return getattr(self._optimizer, name)


def data_parallel_modules(model: torch.nn.Module) -> List[Any]:
    """The modules whose ``no_sync()`` must be entered to skip every all-reduce.

    The root of the model (the module a ``DistributedModelParallel`` wraps, or
    the model) if it has ``no_sync``, whatever its type, and every
    ``DistributedDataParallel`` below it (e.g. one a sharded module keeps for its
    data-parallel tables).
    """
    found: List[Any] = []
    root: Any = model
    wrapped = getattr(model, "_dmp_wrapped_module", None)
    if isinstance(wrapped, torch.nn.Module):
        root = wrapped
    elif wrapped is not None and hasattr(wrapped, "no_sync"):
        found.append(wrapped)
    if hasattr(root, "no_sync"):
        found.append(root)
    if isinstance(root, torch.nn.Module):
        found += [
            m for m in root.modules() if m is not root and isinstance(m, DistributedDataParallel)
        ]
    return found


def all_reduce_gradients(ddp_modules: List[Any]) -> None:
    """Average the gradients of every ``DistributedDataParallel`` in ``ddp_modules``
    over its process group, each parameter once, skipping the ones DDP ignores."""
    seen = set()
    for module in ddp_modules:
        if not isinstance(module, DistributedDataParallel):
            continue
        ignored: Set[str] = getattr(module, "parameters_to_ignore", set())
        world_size = dist.get_world_size(module.process_group)
        for name, param in module.module.named_parameters():
            if name in ignored or id(param) in seen or param.grad is None:
                continue
            seen.add(id(param))
            param.grad.div_(world_size)
            dist.all_reduce(param.grad, group=module.process_group)


class GradientAccumulationWrapper(Generic[In, Out]):
    """Adds gradient accumulation to a training pipeline (see the module docstring).

    Args:
        pipeline: any pipeline whose optimizer is held as ``_optimizer`` (all of
            ours that train); it is swapped for an :class:`AccumulatingOptimizer`
            when accumulation is enabled.
        optimizer: the optimizer the pipeline was built with.
        model: the model (a ``DistributedModelParallel`` or DDP), for ``no_sync()``.
        config: the accumulation settings; disabled, every call goes straight
            to the pipeline.

    Attributes the wrapper lacks are read from the pipeline.
    """

    def __init__(
        self,
        pipeline: TrainPipeline[In, Out],
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        config: GradientAccumulationConfig,
    ) -> None:
        self._pipeline = pipeline
        self._model = model
        self._config = config
        self._accumulating = AccumulatingOptimizer(optimizer, config)
        self._ddp_modules: Optional[List[Any]] = None  # found on first use
        # A call since the last all-reduce ran under no_sync(): the gradients
        # of the window so far are this rank's alone.
        self._unsynced = False
        if config.is_enabled:
            if hasattr(pipeline, "_optimizer"):
                pipeline._optimizer = self._accumulating
            else:
                logger.warning(
                    "GradientAccumulationWrapper: %s holds no optimizer (_optimizer); "
                    "the all-reduce is still skipped inside windows, but zero_grad() "
                    "and step() are the caller's to time",
                    type(pipeline).__name__,
                )

    @property
    def optimizer_wrapper(self) -> AccumulatingOptimizer:
        """The optimizer the pipeline now calls."""
        return self._accumulating

    @property
    def current_step(self) -> int:
        """``progress()`` calls completed since the start or the last :meth:`reset`."""
        return self._accumulating.current_step

    def set_step(self, step: int) -> None:
        """Resume the step count at ``step`` (e.g. after loading a checkpoint)."""
        self._accumulating.set_step(step)

    def _syncs(self, is_last_batch: bool) -> bool:
        step = self.current_step
        return (
            is_last_batch
            or step == 0
            or step < self._config.num_warmup_steps
            or self._accumulating.ends_window()
        )

    def _data_parallel(self) -> List[Any]:
        if self._ddp_modules is None:
            self._ddp_modules = data_parallel_modules(self._model)
        return self._ddp_modules

    def _no_sync(self) -> ContextManager[Any]:
        stack = contextlib.ExitStack()
        for module in self._data_parallel():
            stack.enter_context(module.no_sync())
        return stack

    def _flush(self) -> None:
        """Step on an unfinished window, all-reduced first if it is still local."""
        if self._accumulating.current_step % self._config.num_steps == 0:
            return
        if self._unsynced:
            all_reduce_gradients(self._data_parallel())
            self._unsynced = False
        self._accumulating.flush()

    def progress(self, dataloader_iter: Iterator[In], is_last_batch: Optional[bool] = None) -> Out:
        """One ``pipeline.progress()``, inside ``no_sync()`` unless the call synchronises.

        ``is_last_batch=True`` synchronises and steps on the window so far.  At
        the end of the data the pipeline's ``StopIteration`` steps on an
        unfinished window before it reaches the caller.
        """
        if not self._config.is_enabled:
            return self._pipeline.progress(dataloader_iter)
        last = bool(is_last_batch)
        syncs = self._syncs(last)
        try:
            with contextlib.nullcontext() if syncs else self._no_sync():
                output = self._pipeline.progress(dataloader_iter)
        except StopIteration:
            # Nothing was trained by this call: the window holds current_step calls.
            self._flush()
            raise
        # DDP's all-reduce on a synchronising call covers what no_sync() left local.
        self._unsynced = not syncs
        self._accumulating.advance_step()
        if last:
            self._flush()
        return output

    def reset(self) -> None:
        """Restart the count and reset the pipeline."""
        self._accumulating.reset()
        self._unsynced = False
        reset = getattr(self._pipeline, "reset", None)
        if reset is not None:
            reset()

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper lacks, e.g. a pipeline's own methods.
        if name.startswith("__") or name in ("_pipeline", "_accumulating"):
            raise AttributeError(name)
        return getattr(self._pipeline, name)
