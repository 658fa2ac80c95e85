"""TrainPipelinePT2: no overlap; the model is compiled with ``torch.compile``."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Iterator,
    Optional,
)

import torch
from torchrec.distributed.train_pipeline import In, Out, TrainPipeline
from torchrec.distributed.train_pipeline.types import PipelineState
from torchrec.pt2.utils import default_pipeline_input_transformer
from typing_extensions import Unpack

from trec_pipelines.assembly.options import TrainBatchOptions, takes_options
from trec_pipelines.assembly.pipeline import PipelineCore
from trec_pipelines.core.checks import check_forward_output
from trec_pipelines.core.step_guard import guarded_step
from trec_pipelines.core.streams import copy_to_device
from trec_pipelines.core.subclass_hooks import never_called
from trec_pipelines.model.compiler_settings import HeldSettings
from trec_pipelines.observe import recorder as rec

logger: logging.Logger = logging.getLogger(__name__)


@dataclass
class TorchCompileConfig:
    """How :class:`TrainPipelinePT2` compiles the model.

    Attributes:
        fullgraph: fail on graph breaks instead of splitting the graph.
        dynamic: dynamic shapes (None lets dynamo decide from what it sees).
        backend: the ``torch.compile`` backend ("inductor", "aot_eager", ...).
        compile_on_iter: the ``progress()`` call (from 0) that compiles; the
            calls before it run eagerly, which keeps them easy to profile.
    """

    fullgraph: bool = False
    dynamic: Optional[bool] = None
    backend: str = "inductor"
    compile_on_iter: int = 3


# Dynamo settings a torchrec model needs to compile: KJT lengths become
# unbacked symbolic ints, and torchrec's modules must be traced, not skipped.
_DYNAMO_SETTINGS: Dict[str, Any] = {
    "capture_scalar_outputs": True,
    "capture_dynamic_output_shape_ops": True,
    "force_unspec_int_unbacked_size_like_on_torchrec_kjt": True,
    "skip_torchrec": False,
}


def _held_dynamo_settings() -> HeldSettings:
    return HeldSettings(
        [
            (torch._dynamo.config, k, v)
            for k, v in _DYNAMO_SETTINGS.items()
            if hasattr(torch._dynamo.config, k)
        ]
    )


def dynamo_settings() -> ContextManager[None]:
    """The torchrec dynamo settings, applied for the duration of a ``with``.

    Unlike torchrec 1.8.0, which sets them globally for good, the pipeline only
    holds them while its compiled model runs; other code sees the user's config.
    """
    return _held_dynamo_settings().held()


@takes_options(TrainBatchOptions)
class TrainPipelinePT2(PipelineCore, TrainPipeline[In, Out]):
    """One batch in flight, one stream; the model is compiled on ``compile_on_iter``.

    ==========  =======  =========================================================
    stream      slot     work
    ==========  =======  =========================================================
    default     ``cur``  load, H2D (blocking), input transform, zero_grad,
                         forward, backward, step
    ==========  =======  =========================================================

    ``cur`` is the only batch: each ``progress()`` loads, copies and trains it.
    Nothing overlaps; the speed-up comes from the compiler.

    The H2D copy is blocking, so the compiled graph always sees a complete
    batch.  ``input_transformer`` runs on the device batch, right before the
    model, so shape hints it adds reach the object dynamo traces.  The dynamo
    settings the compiled model needs are held only while it runs; the rest of
    the program sees its own configuration.  The end of the data raises
    ``StopIteration``, and calling ``progress()`` again starts a new epoch.  A
    step that raises is rolled back and the next call retries its batch
    (:meth:`skip_failed_batch` drops one that fails every time).

    Differences from torchrec: :ref:`the migration guide <migrating-pt2>` (docs/guides/migrating.md).

    Example::

        pipeline = TrainPipelinePT2(
            model, optimizer, torch.device("cuda"),
            compile_configs=TorchCompileConfig(compile_on_iter=3),
        )
        pipeline.progress(it)  # one batch a call, until StopIteration

    Args:
        compile_configs: A ``TorchCompileConfig``: when (``compile_on_iter``) and how to
            ``torch.compile`` the model; ``None``: its defaults.
        pre_compile_fn: Called with the model right before it is compiled; ``None``: nothing.
        post_compile_fn: Called with the model right after it is compiled; ``None``: nothing.
        input_transformer: Applied to each device batch right before the model; ``None``: torchrec's
            ``default_pipeline_input_transformer``.

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
    """

    # Each step moves _state through IDLE, CALL_FWD and CALL_BWD, as torchrec's.
    # torchrec's PT2 inlines its pull, copy, wait and backward: the Base hooks it
    # inherits are never called there, so an override would change nothing.
    _traits = PipelineCore._traits.updated(
        hooks={
            hook: never_called("TrainPipelinePT2", "progress(dataloader_iter)")
            for hook in ("_next_batch", "_connect", "_copy_batch_to_gpu", "_wait_for_batch")
        }
        | {
            "_backward": never_called(
                "TrainPipelinePT2",
                "nothing: pass grad_scaler= (and autocast_dtype=) for mixed precision",
            ),
        },
        tracks_state=True,
        pulls_through_next_batch=False,
    )

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        compile_configs: Optional[TorchCompileConfig] = None,
        pre_compile_fn: Optional[Callable[[torch.nn.Module], None]] = None,
        post_compile_fn: Optional[Callable[[torch.nn.Module], None]] = None,
        input_transformer: Optional[Callable[[Any], Any]] = None,
        **options: Unpack[TrainBatchOptions],
    ) -> None:
        super().__init__()
        self._init_core(model, optimizer, device, options)
        self._compile_configs = compile_configs or TorchCompileConfig()
        self._pre_compile_fn = pre_compile_fn
        self._post_compile_fn = post_compile_fn
        self._input_transformer = input_transformer or default_pipeline_input_transformer
        self._iter = 0
        self._dynamo_settings = _held_dynamo_settings()
        self._compiled = False
        self._cur_batch: Optional[Any] = None
        self._said_eager_start = False

    def _compile(self) -> None:
        config = self._compile_configs
        if self._pre_compile_fn is not None:
            self._pre_compile_fn(self._model)
        # fbgemm's sparse ops need their fake (meta) kernels registered to trace.
        torch.ops.import_module("fbgemm_gpu.sparse_ops")
        self._model.compile(
            fullgraph=config.fullgraph, dynamic=config.dynamic, backend=config.backend
        )
        if self._post_compile_fn is not None:
            self._post_compile_fn(self._model)
        self._compiled = True

    def _start_step(self, dataloader_iter: Iterator[Any]) -> None:
        super()._start_step(dataloader_iter)
        self._say_eager_start()

    def _say_eager_start(self) -> None:
        """One INFO line, at the first step, when the steps before ``compile_on_iter`` run
        eagerly (torchrec's default: 3): a run that short is never compiled, and the
        compile's time falls in the step that compiles, which a short run's timing shows."""
        if self._said_eager_start:
            return
        self._said_eager_start = True
        at = self._compile_configs.compile_on_iter
        if self._compiled or self._iter >= at:
            return
        default = ", torchrec's default" if at == TorchCompileConfig.compile_on_iter else ""
        logger.info(
            "%s: the first %d batches run eagerly; the model compiles at batch %d "
            "(compile_configs.compile_on_iter=%d%s), and that batch takes the compile's time; "
            "TorchCompileConfig(compile_on_iter=0) compiles at the first",
            type(self).__name__,
            at,
            at,
            at,
            default,
        )

    def _compiled_region(self) -> ContextManager[None]:
        return self._dynamo_settings.held() if self._compiled else contextlib.nullcontext()

    @guarded_step
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one step on the next batch of ``dataloader_iter``; return its output.

        What every ``progress()`` does: :class:`~trec_pipelines.PipelineOptions`.
        """
        self._enter_phase(PipelineState.IDLE)
        self._start_step(dataloader_iter)  # take-over, iterator switch, host batch
        host_batch = self._source.next(dataloader_iter)
        if host_batch is None:
            self._source.end_epoch()
            raise StopIteration
        i = self._source.last_index
        self._cur_batch = None  # the previous batch is trained: free it before this copy
        with self._recording.span(rec.H2D, i):  # blocking copy on the default stream
            batch = copy_to_device(host_batch, self._device, None, blocking=True)
        self._cur_batch = batch = self._input_transformer(batch)
        training = self._model.training
        if training:
            with self._recording.span(rec.ZERO_GRAD, i):
                self._optimizer.zero_grad()
        if self._iter == self._compile_configs.compile_on_iter:
            self._compile()
        with self._compiled_region():
            self._enter_phase(PipelineState.CALL_FWD)
            with self._recording.span(rec.FORWARD, i), self._precision.autocast():
                losses, output = check_forward_output(self._model(batch), type(self).__name__)
            self._iter += 1
            if training:
                self._enter_phase(PipelineState.CALL_BWD)
                with self._recording.span(rec.BACKWARD, i):
                    # A plain sum: PT2 models may return a scalar loss.
                    self._precision.backward(torch.sum(losses))
        if training:
            with self._recording.span(rec.OPTIMIZER_STEP, i):
                self._precision.step(self._optimizer)
        return output

    def _reset_data_iter(self) -> None:
        """Forget the epoch's batch (torchrec's hook, honoured: ``reset()`` calls it)."""
        self._cur_batch = None

    def reset(self) -> None:
        super().reset()
        self._reset_data_iter()

    def _set_aside(self) -> None:
        self._cur_batch = None  # trained already: nothing of it is in flight
