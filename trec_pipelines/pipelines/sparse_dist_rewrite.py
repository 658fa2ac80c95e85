"""How :class:`~trec_pipelines.pipelines.sparse_dist.TrainPipelineSparseDist` rewrites
its model: :class:`SparseDistRewrite`, the base it stands on, holds the forward
and postproc wrappers it installs, torchrec's rewrite hooks (``_make_forward``,
``_pipeline_model``, ``_init_pipelined_modules``, ``_set_module_context``) and
attributes (``_model_attached``, ``_pipelined_modules``, ``_pipelined_postprocs``),
which batch's context the wrappers read, and ``detach()`` / ``attach()``.

The rewrite's result lives in the pipeline's
:class:`~trec_pipelines.assembly.pipelined_model.PipelinedModel` (``_pipelined``).
"""

from __future__ import annotations

from typing import Any, Callable, Deque, List, Optional, Tuple, Type, cast

import torch

from trec_pipelines._types import AnyShardedModule
from trec_pipelines.assembly.pipeline import PipelineCore
from trec_pipelines.model.args import CallArgs
from trec_pipelines.model.context import TrainPipelineContext
from trec_pipelines.model.postproc import PipelinedPostproc
from trec_pipelines.model.rewrite import RewriteResult
from trec_pipelines.sparse.forwards import BaseForward, PipelinedForward


class SparseDistRewrite(PipelineCore):
    """The model rewrite of :class:`~trec_pipelines.pipelines.sparse_dist.TrainPipelineSparseDist`
    (and of every class derived from it): its hooks, its attributes and ``detach()`` /
    ``attach()``.  Not a pipeline on its own: what it reads besides the core's parts is
    declared below and set by TrainPipelineSparseDist's constructor."""

    # The batches in flight and their contexts (the oldest first).
    batches: Deque[Optional[Any]]
    contexts: Deque[TrainPipelineContext]
    # torchrec's constructor arguments the rewrite reads.
    _context_type: Type[TrainPipelineContext]
    _pipeline_postproc: bool
    _custom_model_fwd: Optional[Callable[[Optional[Any]], Tuple[torch.Tensor, Any]]]
    _clear_data_dist_inputs: bool
    _free_features_storage_early: bool
    # Set-up a subclass runs once the model is first rewritten.
    _after_first_rewrite: List[Callable[[], None]]
    # TrainPipelineSparseDist.start_sparse_data_dist: the rewrite ends by
    # starting the first batch's input_dist.
    start_sparse_data_dist: Callable[[Optional[Any], TrainPipelineContext], None]

    # ------------------------------------------------------- the wrappers

    def _current_context(self) -> TrainPipelineContext:
        """The context the wrappers read now: the oldest batch's (a new one when none)."""
        return self.contexts[0] if self.contexts else self._context_type()

    def _make_forward(
        self, name: str, call_args: CallArgs, module: AnyShardedModule
    ) -> BaseForward[Any]:
        """The forward wrapper of one pipelined module (a variant overrides it for its own)."""
        return PipelinedForward(
            name,
            call_args,
            module,
            self._current_context(),
            self._streams.data_dist,
            wait_on_current_stream=self._clear_data_dist_inputs,
        )

    def _make_postproc(
        self, fqn: str, module: torch.nn.Module, call_args: CallArgs
    ) -> PipelinedPostproc:
        # Runs where input_dist runs (data_dist; Lite: the default stream) and
        # is read on the stream current in the forward (default_stream None).
        return PipelinedPostproc(
            module, fqn, call_args, self._current_context(), None, self._streams.data_dist
        )

    def _set_module_context(self, context: TrainPipelineContext) -> None:
        """Point the forward wrappers and postprocs of the rewrite at ``context``, the
        batch whose forward runs next (torchrec's hook, honoured)."""
        result = self._pipelined.result
        if result is None:
            return
        for pipelined in result.pipelined:
            cast(BaseForward[Any], pipelined.module.forward).set_context(context)
        for postproc in result.postprocs:
            postproc.set_context(context)

    # ------------------------------------------------------- the rewrite

    def _rewrite(self, batch: Any) -> RewriteResult:
        """Rewrite the model for ``batch`` and apply the ``on_unpipelined`` policy."""
        return self._pipelined.rewrite(
            batch,
            self._make_forward,
            self._options["rewrite_strategy"],
            self._options["on_unpipelined"],
            make_postproc=self._make_postproc if self._pipeline_postproc else None,
        )

    def _pipeline_model(
        self,
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
        result = self._rewrite(batch)
        if self._free_features_storage_early:
            for module in result.modules:
                if hasattr(module, "_free_features_storage_early"):
                    cast(Any, module)._free_features_storage_early = True
        self._set_module_context(context)
        self.start_sparse_data_dist(batch, context)
        self._pipelined.fuse_new()  # input_dists exist only after the first input_dist call
        while self._after_first_rewrite:
            self._after_first_rewrite.pop(0)()

    def _init_pipelined_modules(
        self,
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

    def detach(self) -> torch.nn.Module:
        """Give the model its own forwards back, sharded modules and postprocs;
        in-flight batches are kept, with their input_dist and postproc outputs.

        Call :meth:`attach` (or just :meth:`progress`) to resume.
        """
        self._pipelined.detach()
        return self._model

    def attach(self, model: Optional[torch.nn.Module] = None, sparse_dist: bool = True) -> None:
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
                self._rewrite(self.batches[0])
                pipelined.fuse_new()
                self._set_module_context(self.contexts[0])
            return
        pipelined.reattach(self._make_forward)
        pipelined.fusion.fuse(pipelined.modules)
        if self.contexts:
            self._set_module_context(self.contexts[0])

    # ------------------------------------------------------- torchrec's attributes

    @property
    def _model_attached(self) -> bool:
        """False after ``detach()``: the modules run their own forwards."""
        return self._pipelined.attached

    @property
    def _pipelined_modules(self) -> List[AnyShardedModule]:
        """The sharded modules the rewrite pipelined."""
        return self._pipelined.modules

    @property
    def _pipelined_postprocs(self) -> List[PipelinedPostproc]:
        """The postproc wrappers installed by the rewrite (``pipeline_postproc=True``)."""
        return self._pipelined.postprocs


__all__ = ["SparseDistRewrite"]
