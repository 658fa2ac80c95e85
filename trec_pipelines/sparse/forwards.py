"""The wrappers that replace a pipelined ``ShardedModule.forward``.

Once a model is rewritten, calling a sharded module no longer runs its
``input_dist``: the pipeline already started it for this batch and left the
result in the batch's context.  Each wrapper picks that result up, hands it
from the side stream it was made on to the current stream, and finishes the
module's work.

=============================  ==========================================  ======================
wrapper                        takes from the context                      then runs
=============================  ==========================================  ======================
``PipelinedForward``           ``input_dist_tensors_requests`` (waits)     ``compute_and_output_dist``
``PrefetchPipelinedForward``   ``module_input_post_prefetch`` (ready)      ``compute_and_output_dist``
``EmbeddingPipelinedForward``  ``embedding_a2a_requests`` (lookup done)    detaches the embeddings
``InSyncEmbeddingPipelinedForward``  ``embedding_a2a_requests``            nothing more
``PECPipelinedForward``        a PEC module: ``pec_ol_awaitables`` and     merges the two lookups
                               ``pec_nol_awaitables``; others as InSync
=============================  ==========================================  ======================

A pipelined module runs once per batch: its input for the batch is consumed by
the first call, and a second call in the same forward raises with the fix.

A pipeline whose caller runs the model's forward (``SparseDataDistUtil``) counts
the forward calls in :attr:`BaseForward.attempt`; a call in a later forward than
the one that used the batch's input up (the caller retries a batch whose forward
raised) runs the module's ``input_dist`` again on the arguments it was given
(:func:`~trec_pipelines.sparse.input_dist.run_input_dist`).  So does every call while
:attr:`BaseForward.direct` is set (the batch's forward already finished: the
context has moved on to the next batch).
"""

from __future__ import annotations

import weakref
from typing import (
    Any,
    Dict,
    Generic,
    Iterable,
    List,
    Optional,
    Protocol,
    Tuple,
    TypeVar,
    Union,
    runtime_checkable,
)

import torch
from torchrec.distributed.pec_embedding import ShardedPECEmbeddingCollection
from torchrec.distributed.types import Awaitable, LazyNoWait
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

from trec_pipelines._types import AnyShardedModule
from trec_pipelines.core.streams import (
    current_stream,
    hand_off,
    on_stream,
    record_stream,
    record_stream_held,
    wait_event,
)
from trec_pipelines.model.args import CallArgs
from trec_pipelines.model.context import (
    CPUEmbeddingTrainPipelineContext,
    EmbeddingTrainPipelineContext,
    PECTrainPipelineContext,
    PrefetchTrainPipelineContext,
    TrainPipelineContext,
)
from trec_pipelines.sparse.input_dist import run_input_dist

C = TypeVar("C", bound=TrainPipelineContext)


@runtime_checkable
class WrapperOwner(Protocol):
    """What a wrapper knows of the pipeline that installed it: another pipeline
    taking the model over detaches it and leaves its own class name in
    ``_taken_over_by`` (see :mod:`trec_pipelines.sparse.takeover`)."""

    _taken_over_by: Optional[str]

    def detach(self) -> torch.nn.Module: ...


class BaseForward(Generic[C]):
    """State shared by every wrapper: which module, its argument recipe, its context."""

    def __init__(
        self,
        name: str,
        args: CallArgs,
        module: AnyShardedModule,
        context: C,
        stream: Optional[torch.Stream] = None,
    ) -> None:
        self._name = name
        self._args = args
        self._module = module
        self._context = context
        self._stream = stream
        # The context whose input this wrapper consumed last: a second call on
        # the same context is the "called twice in one forward" mistake.
        self._consumed: Optional[C] = None
        # Set by the owning pipeline before each model forward (see the module
        # docstring); pipelines that never set them keep the once-per-batch rule.
        self.attempt = 0
        self.direct = False
        self._consumed_in = 0  # the attempt that consumed ``_consumed``
        # The pipeline that installed this wrapper (see claim()).
        self._owner: Optional[weakref.ReferenceType[WrapperOwner]] = None
        self.owner_name = "pipeline"
        # (had an instance forward, that forward): what this wrapper replaced on
        # the module, so it can be undone after its pipeline is gone.
        self.replaced: Optional[Tuple[bool, Any]] = None

    def claim(self, pipeline: WrapperOwner) -> None:
        """Record ``pipeline`` as the one that installed this wrapper, so another
        pipeline finding it on the model knows whom to take the model from."""
        self._owner = weakref.ref(pipeline)
        self.owner_name = type(pipeline).__name__

    @property
    def owner(self) -> Optional[WrapperOwner]:
        """The pipeline that installed this wrapper, or None if it was collected."""
        return self._owner() if self._owner is not None else None

    @property
    def name(self) -> str:
        return self._name

    @property
    def args(self) -> CallArgs:
        return self._args

    @property
    def module(self) -> AnyShardedModule:
        return self._module

    def set_context(self, context: C) -> None:
        self._context = context

    def get_context(self) -> C:
        return self._context

    def _input(self, store: Dict[str, Any]) -> Optional[Any]:
        """This module's entry, popped from ``store``; None when this call must redo
        the module's input_dist (:attr:`direct`, or the batch's input was used up by
        an earlier, failed forward); raises, saying why, when it is missing."""
        if self._name in store and not self.direct:
            self._consumed, self._consumed_in = self._context, self.attempt
            return store.pop(self._name)
        if self.direct or (self._consumed is self._context and self._consumed_in != self.attempt):
            return None
        return self._take(store)  # raises: called twice, or outside progress()

    def _take(self, store: Dict[str, Any]) -> Any:
        """Pop this module's entry from ``store`` or explain why it is missing."""
        if self._name in store:
            self._consumed, self._consumed_in = self._context, self.attempt
            return store.pop(self._name)
        if self._consumed is self._context:
            raise RuntimeError(
                f"sharded module '{self._name}' was called twice in one forward "
                f"(batch {self._context.index}). A pipelined module runs once per "
                "batch; call it once and reuse its output, or give the second use "
                "its own module."
            )
        raise RuntimeError(
            f"sharded module '{self._name}' has no pipelined input for batch "
            f"{self._context.index}: the model was called outside pipeline.progress(). "
            "Call pipeline.detach() before using the model directly, and "
            "pipeline.attach() to resume (with StagedTrainPipeline: the "
            "SparseDataDistUtil's detach(); its next progress() pipelines the "
            "model again)."
        )

    def _forward_again(self, input: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Awaitable[Any]:
        """The module's own forward on this call's arguments: input_dist, then the rest."""
        module_ctx, data = run_input_dist(self._module, input, kwargs)
        output: Awaitable[Any] = self._module.compute_and_output_dist(module_ctx, data)
        return output


class PipelinedForward(BaseForward[TrainPipelineContext]):
    """Waits for the batch's ``input_dist`` and runs ``compute_and_output_dist``."""

    def __init__(
        self,
        name: str,
        args: CallArgs,
        module: AnyShardedModule,
        context: TrainPipelineContext,
        stream: Optional[torch.Stream] = None,
        *,
        wait_on_current_stream: bool = False,
    ) -> None:
        super().__init__(name, args, module, context, stream)
        # clear_data_dist_inputs frees the inputs early; the wait then stays on
        # the current stream.
        self._wait_stream = None if wait_on_current_stream else stream

    def __call__(self, *input: Any, **kwargs: Any) -> Awaitable[Any]:
        request = self._input(self._context.input_dist_tensors_requests)
        if request is None:
            return self._forward_again(input, kwargs)
        with on_stream(self._wait_stream):
            data = request.wait()
        module_ctx = self._context.module_contexts.pop(self._name)
        hand_off(data, self._stream)
        hand_off(module_ctx, self._stream)
        output: Awaitable[Any] = self._module.compute_and_output_dist(module_ctx, data)
        return output


class PrefetchPipelinedForward(BaseForward[PrefetchTrainPipelineContext]):
    """Runs ``compute_and_output_dist`` on input the prefetch stage made ready.

    ``prefetch_stream`` is the stream the prefetch ran on (torchrec's name).
    """

    def __init__(
        self,
        name: str,
        args: CallArgs,
        module: AnyShardedModule,
        context: PrefetchTrainPipelineContext,
        prefetch_stream: Optional[torch.Stream] = None,
    ) -> None:
        super().__init__(name, args, module, context, prefetch_stream)

    def __call__(self, *input: Any, **kwargs: Any) -> Awaitable[Any]:
        data = self._input(self._context.module_input_post_prefetch)
        if data is None:
            return self._forward_again(input, kwargs)
        module_ctx = self._context.module_contexts_post_prefetch.pop(self._name)
        hand_off(data, self._stream)
        hand_off(module_ctx, self._stream)
        output: Awaitable[Any] = self._module.compute_and_output_dist(module_ctx, data)
        return output


EmbeddingOutput = Union[Dict[str, JaggedTensor], KeyedTensor]


class EmbeddingPipelinedForward(BaseForward[EmbeddingTrainPipelineContext]):
    """Returns the lookup the pipeline already ran, with the embeddings detached.

    The dense backward then stops at the detached leaves; the pipeline sends
    their gradients into the embeddings later (``embedding_backward``).
    """

    def __call__(self, *input: Any, **kwargs: Any) -> Any:
        awaitable = self._input(self._context.embedding_a2a_requests)
        if awaitable is None:
            # The lookup ran ahead and cannot be replayed: look up afresh.
            return self._forward_again(input, kwargs)
        module_ctx = self._context.module_contexts.pop(self._name)
        # Wait for this batch's lookup only (see [Note: lookup ordering on streams]).
        consumer = current_stream(_device_of(self._stream))
        wait_event(consumer, self._context.embedding_lookup_event)
        record_stream(module_ctx, consumer)
        # The wait below reads the output all-to-all's buffers, allocated on the
        # lookup stream, on this one and drops them: record them while reachable
        # (torchrec does not, and the lookup stream could reuse them too soon).
        if consumer != self._stream:
            record_stream_held(awaitable, consumer)
        if isinstance(awaitable, Iterable):
            # Managed-collision modules return (embeddings, remapped ids).
            embeddings_awaitable, remapped_awaitable = awaitable
            embeddings = embeddings_awaitable.wait()
            remapped = remapped_awaitable.wait()
            self.detach_embeddings(embeddings, consumer)
            return (LazyNoWait(embeddings), LazyNoWait(remapped))
        embeddings = awaitable.wait()
        self.detach_embeddings(embeddings, consumer)
        return LazyNoWait(embeddings)

    def detach_embeddings(
        self, embeddings: EmbeddingOutput, cur_stream: Optional[torch.Stream]
    ) -> None:
        """Hand the lookup output to ``cur_stream`` (the forward's) and cut it from
        autograd, keeping both sides in the context for ``embedding_backward``."""
        record_output(embeddings, cur_stream)
        originals: List[torch.Tensor] = []
        leaves: List[torch.Tensor] = []
        # A resumed batch's dense part sees the values its lookup had before the
        # checkpoint; the backward still goes into this lookup's outputs.
        restored = self._context.restored_embeddings.pop(self._name, None)
        seen = _Restored(self._name, restored)
        if isinstance(embeddings, KeyedTensor):
            original = embeddings.values()
            leaf = _detached_leaf(seen.values(0, original))
            embeddings._values = leaf
            originals.append(original)
            leaves.append(leaf)
            # One concatenated tensor answers for all the keys.
            features: List[Union[str, List[str]]] = [list(embeddings.keys())]
        else:
            features = []
            for position, (key, jt) in enumerate(embeddings.items()):
                original = jt.values()
                leaf = _detached_leaf(seen.values(position, original))
                jt._values = leaf
                originals.append(original)
                leaves.append(leaf)
                features.append(key)
        self._context.embedding_tensors.append(originals)
        self._context.embedding_features.append(features)
        self._context.detached_embedding_tensors.append(leaves)


class CPUEmbeddingPipelinedForward(EmbeddingPipelinedForward):
    """EvalPipelineCPUSparse's wrapper: the embeddings its copy stage put on the device.

    The lookup ran on the host before the forward and its output was copied to
    the dense forward's device; the wrapper hands that copy over.
    """

    def __call__(self, *input: Any, **kwargs: Any) -> Any:
        context = self._context
        assert isinstance(context, CPUEmbeddingTrainPipelineContext)
        if self._name not in context.gpu_embedding_outputs:
            raise RuntimeError(
                f"sharded module '{self._name}' has no embeddings for batch "
                f"{context.index}: EvalPipelineCPUSparse looks them up and copies them "
                "before the forward, so call the model through pipeline.progress() only, "
                "once per batch"
            )
        return LazyNoWait(context.gpu_embedding_outputs.pop(self._name))


class InSyncEmbeddingPipelinedForward(EmbeddingPipelinedForward):
    """Returns the lookup the pipeline already ran, still attached to autograd."""

    def detach_embeddings(
        self, embeddings: EmbeddingOutput, cur_stream: Optional[torch.Stream]
    ) -> None:
        # Nothing is detached, but the output was allocated on the lookup stream
        # and the forward and backward read it on this one.
        record_output(embeddings, cur_stream)


class PECPipelinedForward(InSyncEmbeddingPipelinedForward):
    """Returns the lookup the PEC pipeline already ran, attached to autograd.

    A PEC module (``ShardedPECEmbeddingCollection``) was looked up in two
    partitions, the ids the previous batch also had (overlapped, looked up this
    step with fresh weights) and the others (looked up one step ahead); the
    wrapper merges them back into the module's output, and the module's
    backward then splits the gradient the same way.  Any other module is an
    :class:`InSyncEmbeddingPipelinedForward`.
    """

    def __call__(self, *input: Any, **kwargs: Any) -> Any:
        if not isinstance(self._module, ShardedPECEmbeddingCollection):
            return super().__call__(*input, **kwargs)
        context = self._context
        assert isinstance(context, PECTrainPipelineContext)
        overlapped = self._take(context.pec_ol_awaitables)
        not_overlapped = context.pec_nol_awaitables.pop(self._name)
        forward_ctxs = context.pec_forward_ctxs.pop(self._name)
        # Still needed after the forward: by the OL gradient and the NOL deferral.
        backward_ctxs = context.pec_backward_ctxs[self._name]
        module: Any = self._module  # see pec_ops.PECModules
        return module.merge_partitioned_embeddings(
            context.module_contexts[self._name],
            overlapped,
            not_overlapped,
            forward_ctxs,
            backward_ctxs,
        )


def record_output(embeddings: EmbeddingOutput, consumer: Optional[torch.Stream]) -> None:
    """``record_stream`` a lookup output on ``consumer``: a KeyedTensor (EBC) or a
    dict of JaggedTensors (EC), which has no ``record_stream`` of its own."""
    if isinstance(embeddings, KeyedTensor):
        record_stream(embeddings, consumer)
    else:
        for jt in embeddings.values():
            record_stream(jt, consumer)


class _Restored:
    """The values a resumed batch's lookup had, for one module (or none)."""

    def __init__(self, name: str, values: Optional[List[torch.Tensor]]) -> None:
        self._name, self._values = name, values

    def values(self, position: int, looked_up: torch.Tensor) -> torch.Tensor:
        """What the dense part sees at ``position``: the restored values, else ``looked_up``."""
        if self._values is None:
            return looked_up
        restored = self._values[position]
        if restored.shape != looked_up.shape or restored.dtype != looked_up.dtype:
            raise ValueError(
                f"module {self._name!r}: the checkpoint's looked-up embeddings have shape "
                f"{tuple(restored.shape)} ({restored.dtype}) where this batch's lookup gives "
                f"{tuple(looked_up.shape)} ({looked_up.dtype}): the pipeline state was "
                "saved with another model or sharding"
            )
        return restored.to(looked_up.device)


def _detached_leaf(tensor: torch.Tensor) -> torch.Tensor:
    leaf = tensor.detach().requires_grad_()
    leaf.retain_grad()
    return leaf


def _device_of(stream: Optional[torch.Stream]) -> torch.device:
    return stream.device if stream is not None else torch.device("cpu")
