"""How :class:`~trec_pipelines.pipelines.sparse_dist.TrainPipelineSparseDist` rewrites
its model: the forward and postproc wrappers it installs, torchrec's rewrite
hooks (``_pipeline_model``, ``_init_pipelined_modules``; ``_set_module_context``
is :func:`~trec_pipelines.sparse.forwards.set_module_context`), which batch's
context the wrappers read, and ``detach()`` / ``attach()``.

The rewrite's result lives in the pipeline's
:class:`~trec_pipelines.assembly.pipelined_model.PipelinedModel` (``_pipelined``).
The methods and properties torchrec's class has are written here as functions
of the pipeline and assigned, one line each, in the class body (a method has
to live on a class in the pipeline's MRO; assigning it there keeps the MRO
torchrec's plus our core); the steps of ours they share are plain functions.
"""

from __future__ import annotations

from typing import Any, Deque, List, Optional, cast

import torch

from trec_pipelines._types import AnyShardedModule
from trec_pipelines.assembly.pipelined_model import PipelinedModel
from trec_pipelines.model.args import CallArgs
from trec_pipelines.model.context import TrainPipelineContext
from trec_pipelines.model.postproc import PipelinedPostproc
from trec_pipelines.model.rewrite import RewriteResult
from trec_pipelines.sparse.forwards import BaseForward, PipelinedForward

# A TrainPipelineSparseDist (or a subclass of it); not imported, which would be a cycle.
Pipeline = Any


def current_context(pipeline: Pipeline) -> TrainPipelineContext:
    """The context the wrappers read now: the oldest batch's (a new one when none)."""
    contexts: Deque[TrainPipelineContext] = pipeline.contexts
    return contexts[0] if contexts else cast(TrainPipelineContext, pipeline._context_type())


def _make_postproc(
    pipeline: Pipeline, fqn: str, module: torch.nn.Module, call_args: CallArgs
) -> PipelinedPostproc:
    # Runs where input_dist runs (data_dist; Lite: the default stream) and
    # is read on the stream current in the forward (default_stream None).
    return PipelinedPostproc(
        module, fqn, call_args, current_context(pipeline), None, pipeline._streams.data_dist
    )


def make_forward(
    self: Pipeline, name: str, call_args: CallArgs, module: AnyShardedModule
) -> BaseForward[Any]:
    """The forward wrapper of one pipelined module (a variant overrides it for its own)."""
    return PipelinedForward(
        name,
        call_args,
        module,
        current_context(self),
        self._streams.data_dist,
        wait_on_current_stream=self._clear_data_dist_inputs,
    )


def rewrite_checked(pipeline: Pipeline, batch: Any) -> RewriteResult:
    """Rewrite the model for ``batch`` and apply the ``on_unpipelined`` policy."""

    def postproc(fqn: str, module: torch.nn.Module, call_args: CallArgs) -> PipelinedPostproc:
        return _make_postproc(pipeline, fqn, module, call_args)

    pipelined: PipelinedModel = pipeline._pipelined
    return pipelined.rewrite(
        batch,
        pipeline._make_forward,
        pipeline._options["rewrite_strategy"],
        pipeline._options["on_unpipelined"],
        make_postproc=postproc if pipeline._pipeline_postproc else None,
    )


def pipeline_model(
    self: Pipeline,
    batch: Any,
    context: TrainPipelineContext,
    pipelined_forward: Optional[type] = None,
) -> None:
    """Rewrite the model on the first batch, then start that batch's input_dist.

    torchrec's hook, honoured: called once per rewrite (an override that
    calls ``super()`` and then registers hooks registers them once).
    ``pipelined_forward`` is accepted for torchrec's signature; each
    module's wrapper comes from ``_make_forward``.
    """
    result = rewrite_checked(self, batch)
    if self._free_features_storage_early:
        for module in result.modules:
            if hasattr(module, "_free_features_storage_early"):
                cast(Any, module)._free_features_storage_early = True
    self._set_module_context(context)
    self.start_sparse_data_dist(batch, context)
    self._pipelined.fuse_new()  # input_dists exist only after the first input_dist call
    while self._after_first_rewrite:
        self._after_first_rewrite.pop(0)()


def init_pipelined_modules(
    self: Pipeline,
    batch: Any,
    context: TrainPipelineContext,
    pipelined_forward: Optional[type] = None,
) -> None:
    """Start ``batch``'s input_dist, rewriting the model first if not done yet
    (torchrec's hook, honoured: the fill calls it with an epoch's first batch)."""
    if self._pipelined.result is None:
        self._pipeline_model(batch, context, pipelined_forward)
    else:
        self._set_module_context(context)
        self.start_sparse_data_dist(batch, context)


# ------------------------------------------------------- attach / detach


def detach(self: Pipeline) -> torch.nn.Module:
    """Give the model its own forwards back, sharded modules and postprocs;
    in-flight batches are kept, with their input_dist and postproc outputs.

    Call :meth:`attach` (or just :meth:`progress`) to resume.
    """
    self._pipelined.detach()
    return cast(torch.nn.Module, self._model)


def attach(
    self: Pipeline, model: Optional[torch.nn.Module] = None, sparse_dist: bool = True
) -> None:
    """Pipeline the model again after :meth:`detach`, or pipeline a new model.

    The in-flight batches keep the input_dist (and postproc outputs) already
    done for them; the same modules and postprocs are wrapped again.
    """
    pipelined = self._pipelined
    if model is not None and model is not self._model:
        self.detach()
        self._model = model
        self._model_fwd = self._custom_model_fwd or model
        pipelined.replace_model(model)  # a new model is traced on the next batch
    if pipelined.attached:
        return
    if pipelined.result is None:
        pipelined.attached = True
        # Lite's next progress() rewrites the model (no batch in flight has
        # started its input_dist yet): see Traits.rewrite_on_attach.
        if self.contexts and self._traits.rewrite_on_attach:
            rewrite_checked(self, self.batches[0])
            pipelined.fuse_new()
            self._set_module_context(self.contexts[0])
        return
    pipelined.reattach(self._make_forward)
    pipelined.fusion.fuse(pipelined.modules)
    if self.contexts:
        self._set_module_context(self.contexts[0])


def _model_attached(pipeline: Pipeline) -> bool:
    pipelined: PipelinedModel = pipeline._pipelined
    return pipelined.attached


def _pipelined_modules(pipeline: Pipeline) -> List[AnyShardedModule]:
    pipelined: PipelinedModel = pipeline._pipelined
    return pipelined.modules


def _pipelined_postprocs(pipeline: Pipeline) -> List[PipelinedPostproc]:
    pipelined: PipelinedModel = pipeline._pipelined
    return pipelined.postprocs


# torchrec's attributes, read-only here: what the rewrite pipelined.
MODEL_ATTACHED = property(
    _model_attached, doc="False after ``detach()``: the modules run their own forwards."
)
PIPELINED_MODULES = property(_pipelined_modules, doc="The sharded modules the rewrite pipelined.")
PIPELINED_POSTPROCS = property(
    _pipelined_postprocs,
    doc="The postproc wrappers installed by the rewrite (``pipeline_postproc=True``).",
)


__all__ = [
    "MODEL_ATTACHED",
    "PIPELINED_MODULES",
    "PIPELINED_POSTPROCS",
    "attach",
    "current_context",
    "detach",
    "init_pipelined_modules",
    "make_forward",
    "pipeline_model",
    "rewrite_checked",
]
