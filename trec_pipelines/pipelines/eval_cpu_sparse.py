"""EvalPipelineCPUSparse: embeddings looked up on the host, the dense forward on the device."""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, Iterator, Optional, Tuple, cast

import torch
from torchrec.distributed.train_pipeline import In, Out
from torchrec.sparse.jagged_tensor import KeyedTensor
from typing_extensions import Unpack

from trec_pipelines._types import AnyShardedModule
from trec_pipelines.assembly.options import EvalHostOptions, takes_options
from trec_pipelines.core import lifetime
from trec_pipelines.core.step_guard import guarded_step
from trec_pipelines.core.streams import (
    StreamSet,
    copy_to_device,
    current_stream,
    make_streams,
    on_stream,
    record_event,
    record_stream_tree,
    wait_for_batch,
    wait_stream,
)
from trec_pipelines.core.subclass_hooks import ASYNC_SUBMIT_OFF, Refused
from trec_pipelines.data.padding import first_real_output, unwrap
from trec_pipelines.model.args import CallArgs
from trec_pipelines.model.context import CPUEmbeddingTrainPipelineContext, TrainPipelineContext
from trec_pipelines.observe import recorder as rec
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist
from trec_pipelines.sparse.forwards import BaseForward, CPUEmbeddingPipelinedForward
from trec_pipelines.sparse.input_dist import start_input_dist, wait_input_dist

logger: logging.Logger = logging.getLogger(__name__)

# The name of the thread that runs the host stage with multi_thread=True.
SPARSE_THREAD = "trec_pipelines-cpu_sparse"


@takes_options(EvalHostOptions)
class EvalPipelineCPUSparse(TrainPipelineSparseDist[In, Out]):
    """Eval with every table on the host (data_parallel) and the dense part on the device.

    ==========  =======  ==========================================================
    where       slot     work
    ==========  =======  ==========================================================
    host        ``nxt``  input dist, lookup and output dist of every pipelined
                         module (no collective for data_parallel tables), the
                         embeddings written to pinned host memory (on a device
                         with streams); on a thread of its own with
                         ``multi_thread``
    memcpy      ``nxt``  the batch and its embeddings copied to the device
    default     ``cur``  the dense forward under ``no_grad``, where each
                         pipelined module returns its copied embeddings
    ==========  =======  ==========================================================

    torchrec's experimental class (``experimental_pipelines``).  Three stages,
    each batch through all of them, ``pipeline_depth`` (1 or 2) batches in
    flight.  With ``pipeline_depth=2`` (default) a call runs ``cur``'s dense
    forward, then issues ``nxt``'s copy, then runs the host stage of the next
    batch, which overlaps the device's work; with 1 the copy follows the host
    stage at once.

    ``progress()`` returns the forward's output (the second item of a
    ``(loss, output)`` pair); ``optimizer`` is accepted and unused.  A pinned
    buffer is written again only once the copy that read it has finished, and
    nothing is pinned on a device without streams (CPU).

    Differences from torchrec: :ref:`the migration guide <migrating-cpu-sparse>` (docs/guides/migrating.md).

    Example::

        model.eval()
        pipeline = EvalPipelineCPUSparse(dmp_model, None, device, pipeline_depth=2)
        it = iter(dataloader)
        predictions = pipeline.progress(it)  # one batch a call, until StopIteration

    Args:
        multi_thread: Run the host stage (input dist, lookup, output dist) on a thread of its own,
            overlapping the device's work.
        pipeline_depth: Batches in flight, 1 or 2 (2: the copy overlaps the next host stage).

    torchrec's parameters the classes share, our keyword-only options and what every ``progress()``
    does: :class:`~trec_pipelines.PipelineOptions`.
    """

    # torchrec's class leaves _state IDLE; input_dist runs in the step that uses it.
    _traits = TrainPipelineSparseDist._traits.updated(
        hooks={
            "_submit_inplace_copy": ASYNC_SUBMIT_OFF,
        }
        | {
            "_get_or_alloc_pinned": Refused(
                "the pinned buffers here are two per module, alternating between batches, each "
                "released by the event of the copy that read it (one buffer per name would be "
                "overwritten while its copy is in flight)",
                "_sparse_forward(batch, context) or copy_data_to_gpu(batch, context)",
            ),
            "_embedding_lookup_and_pin": Refused(
                "the host lookup and the pinning are one stage here",
                "_sparse_forward(batch, context)",
            ),
            "_copy_to_gpu": Refused(
                "the copy stage is one method here", "copy_data_to_gpu(batch, context)"
            ),
            "_inplace_copy_to_gpu": Refused(
                "the copy stage is one method here", "copy_data_to_gpu(batch, context)"
            ),
        },
        tracks_state=False,
        requires_optimizer=False,
        carries_agreement=False,  # its input_dist may run on a thread of its own
        input_dist_role="default",
        input_dist_ahead=False,
    )

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        pipeline_postproc: bool = False,
        enable_inplace_copy_batch: bool = False,
        multi_thread: bool = False,
        pipeline_depth: int = 2,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        **options: Unpack[EvalHostOptions],
    ) -> None:
        if pipeline_depth not in (1, 2):
            raise ValueError(
                f"EvalPipelineCPUSparse: pipeline_depth must be 1 or 2, got {pipeline_depth!r}"
            )
        super().__init__(
            model,
            optimizer,  # type: ignore[arg-type]  # unused: eval only
            device,
            execute_all_batches,
            apply_jit,
            CPUEmbeddingTrainPipelineContext,
            pipeline_postproc,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            # uneven_data is ours, not the training parent's: the options are
            # checked against this class (resolve_options reads type(self)).
            **cast(Any, options),
        )
        self._pipeline_depth = pipeline_depth
        self._multi_thread = multi_thread
        self._traits = self._traits.updated(depth=pipeline_depth)
        self._sparse_executor: Optional[ThreadPoolExecutor] = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=SPARSE_THREAD)
            if multi_thread
            else None
        )
        if self._sparse_executor is not None:
            # Shut down once the pipeline is collected, or at interpreter exit.
            lifetime.own_executor(self._sparse_executor, owner=self)
        self._sparse_future: Optional["Future[Any]"] = None
        # Pinned host buffers, two per module (batches alternate), each with the
        # event recorded after the copy that last read it.
        self._pinned: Dict[Tuple[str, int], torch.Tensor] = {}
        self._pinned_read: Dict[Tuple[str, int], Optional[torch.Event]] = {}

    def _make_streams(self) -> StreamSet:
        return make_streams(self._device, memcpy=True, data_dist=False)

    def _make_forward(
        self, name: str, call_args: CallArgs, module: AnyShardedModule
    ) -> BaseForward[Any]:
        context = cast(CPUEmbeddingTrainPipelineContext, self._current_context())
        return CPUEmbeddingPipelinedForward(name, call_args, module, context)

    def _pipeline_model(
        self,
        batch: Any,
        context: TrainPipelineContext,
        pipelined_forward: Optional[type] = None,
    ) -> None:
        """Rewrite the model on the first batch (its input dist runs in the host stage)."""
        self._rewrite(batch)
        self._set_module_context(context)

    # ------------------------------------------------------------------ stages

    def enqueue_batch(self, dataloader_iter: Iterator[Any]) -> bool:
        """Queue the next host batch with its context; False at the end of the data."""
        host, padding = unwrap(self._source.next(dataloader_iter))
        if host is None:
            return False
        context = self._create_context()
        assert isinstance(context, CPUEmbeddingTrainPipelineContext)
        context.dense_gpu_device = self._device.type
        context.padding = padding
        self.batches.append(host)
        self.contexts.append(context)
        return True

    def _sparse_forward(self, batch: Any, context: CPUEmbeddingTrainPipelineContext) -> Any:
        """Host stage: input dist, lookup and output dist; with depth 1 the copy too."""
        # Recorded on the training thread only (the recorder is not thread-safe).
        on_main = self._sparse_executor is None
        with (
            self._recording.span(rec.EMB_LOOKUP, context.index)
            if on_main
            else contextlib.nullcontext()
        ):
            modules = self._pipelined.input_dist_modules()
            start_input_dist(self._pipelined.result, batch, context)
            wait_input_dist(context)
            for name, module, _ in modules:
                data = context.input_dist_tensors_requests.pop(name).wait()
                embeddings = module.compute_and_output_dist(
                    context.module_contexts[name], data
                ).wait()
                context.embedding_a2a_requests[name] = self._pin(name, context.index, embeddings)
        if self._pipeline_depth == 1:
            return self.copy_data_to_gpu(batch, context)
        return batch

    def _pin(self, name: str, index: Optional[int], embeddings: Any) -> Any:
        """``embeddings`` with their values in a pinned buffer (devices with streams
        only), so the copy to the device can run asynchronously."""
        if self._streams.memcpy is None or not isinstance(embeddings, KeyedTensor):
            return embeddings
        key = (name, _slot(index))
        read = self._pinned_read.pop(key, None)
        if read is not None:
            read.synchronize()  # the copy that last read this buffer is done
        values = embeddings.values()
        buffer = self._pinned.get(key)
        if buffer is None or buffer.shape != values.shape or buffer.dtype != values.dtype:
            buffer = self._pinned[key] = torch.empty_like(values, pin_memory=True)
        buffer.copy_(values)
        return KeyedTensor(
            keys=embeddings.keys(), length_per_key=embeddings.length_per_key(), values=buffer
        )

    def copy_data_to_gpu(self, batch: Any, context: CPUEmbeddingTrainPipelineContext) -> Any:
        """Copy stage, on the memcpy stream: the batch and its embeddings."""
        memcpy = self._streams.memcpy
        with self._recording.span(rec.H2D, context.index, "memcpy"):
            # Memory the default stream freed may be handed to this stream: wait for it.
            wait_stream(memcpy, current_stream(self._device))
            device_batch = copy_to_device(
                batch, self._device, memcpy, inplace=self._enable_inplace_copy_batch
            )
            with on_stream(memcpy):
                for name, embeddings in context.embedding_a2a_requests.items():
                    context.gpu_embedding_outputs[name] = embeddings.to(
                        device=self._device, non_blocking=True
                    )
                done = record_event(memcpy)
            for name in context.embedding_a2a_requests:
                if (name, _slot(context.index)) in self._pinned:
                    self._pinned_read[(name, _slot(context.index))] = done
            context.embedding_a2a_requests.clear()
        return device_batch

    def _dense_forward(self, batch: Any, context: TrainPipelineContext) -> Any:
        """``batch``'s forward on the device, under ``no_grad``, once its copy is done
        (torchrec's hook, honoured: called with ``cur`` each step)."""
        assert isinstance(context, CPUEmbeddingTrainPipelineContext)
        consumer = current_stream(self._device)
        with self._recording.span(rec.WAIT_BATCH, context.index):  # memcpy -> default
            wait_for_batch(batch, self._streams.memcpy, not self._enable_inplace_copy_batch)
            record_stream_tree(context.gpu_embedding_outputs, consumer)
        with self._recording.span(rec.FORWARD, context.index), torch.no_grad():
            output = self._model_fwd(batch)
        return output[1] if isinstance(output, tuple) and len(output) == 2 else output

    def _start_sparse_forward(self) -> None:
        batch, context = self.batches[-1], self.contexts[-1]
        assert isinstance(context, CPUEmbeddingTrainPipelineContext)
        if self._sparse_executor is not None:
            self._sparse_future = self._sparse_executor.submit(self._sparse_forward, batch, context)
        else:
            self.batches[-1] = self._sparse_forward(batch, context)

    def _finish_sparse_forward(self) -> None:
        if self._sparse_future is not None:
            future, self._sparse_future = self._sparse_future, None
            self.batches[-1] = future.result()

    # --------------------------------------------------------------- schedule

    def fill_pipeline(self, dataloader_iter: Iterator[Any]) -> None:
        """An empty pipeline: ``cur`` through the host and copy stages, ``nxt``
        (depth 2) through the host stage."""
        if self.batches:
            return
        if not self.enqueue_batch(dataloader_iter):
            return
        if self._pipelined.result is None:
            self._pipeline_model(self.batches[0], self.contexts[0], self._pipelined_forward_type)
        cur = self.contexts[0]
        assert isinstance(cur, CPUEmbeddingTrainPipelineContext)
        batch = self._sparse_forward(self.batches[0], cur)
        self.batches[0] = batch if self._pipeline_depth == 1 else self.copy_data_to_gpu(batch, cur)
        if self._pipeline_depth == 2 and self.enqueue_batch(dataloader_iter):
            self._start_sparse_forward()
            self._finish_sparse_forward()

    @guarded_step
    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one step on the next batch of ``dataloader_iter``; return its output.

        What every ``progress()`` does: :class:`~trec_pipelines.PipelineOptions`.
        """
        # See [Note: padding uneven eval data] in trec_pipelines.data.padding.
        return first_real_output(lambda: self._evaluate_step(dataloader_iter))

    def _evaluate_step(self, dataloader_iter: Iterator[Any]) -> Tuple[Any, bool]:
        """One step: ``cur``'s output, and whether ``cur`` was a padding batch."""
        # See [Note: a progress() timeline] in trec_pipelines.pipelines.
        # fmt: off
        self._start_step(dataloader_iter)  # fill, pull host batches, stop at end of data
        padding = self.contexts[0].padding
        self._finish_sparse_forward()                              # nxt, host (thread)
        output = self._dense_forward(self.batches[0], self.contexts[0])  # cur, default
        if len(self.batches) > 1 and self._pipeline_depth == 2:
            nxt = self.contexts[1]
            assert isinstance(nxt, CPUEmbeddingTrainPipelineContext)
            self.batches[1] = self.copy_data_to_gpu(self.batches[1], nxt)  # nxt, memcpy
        self.dequeue_batch()
        if self.enqueue_batch(dataloader_iter):
            self._start_sparse_forward()                           # new, host (thread)
        return output, padding

    def reset(self) -> None:
        self._finish_sparse_forward()
        super().reset()


def _slot(index: Optional[int]) -> int:
    """Which of a module's two pinned buffers batch ``index`` uses (they alternate)."""
    return (index or 0) % 2
