"""How :class:`~trec_pipelines.pipelines.sparse_dist.TrainPipelineSparseDist` rewrites
its model: the forward and postproc wrappers it installs, torchrec's rewrite
hooks (``_pipeline_model``, ``_init_pipelined_modules``), which batch's
context the wrappers read, and ``detach()`` / ``attach()``.

:class:`SparseDistRewrite` is a base of that class only; it holds no state of
its own (the rewrite's result lives in the core's ``PipelinedModel``).
"""

from __future__ import annotations

from typing import Any, Callable, Deque, List, Optional, Tuple, Type, cast

import torch

from trec_pipelines._types import AnyShardedModule
from trec_pipelines.assembly.options import PipelineOptions
from trec_pipelines.assembly.pipelined_model import PipelinedModel
from trec_pipelines.core.streams import StreamSet
from trec_pipelines.model.args import CallArgs
from trec_pipelines.model.context import TrainPipelineContext
from trec_pipelines.model.postproc import PipelinedPostproc
from trec_pipelines.model.rewrite import RewriteResult
from trec_pipelines.sparse.forwards import BaseForward, PipelinedForward
from trec_pipelines.sparse.input_dist import SplitsFusion


class SparseDistRewrite:
    """The model-rewrite half of :class:`~trec_pipelines.pipelines.sparse_dist.TrainPipelineSparseDist`.

    The attributes below are set by that class's constructor (and its core's).
    """

    _options: PipelineOptions
    _pipelined: PipelinedModel
    _streams: StreamSet
    _clear_data_dist_inputs: bool
    _free_features_storage_early: bool
    _pipeline_postproc: bool
    _after_first_rewrite: List[Callable[[], None]]
    _context_type: Type[TrainPipelineContext]
    contexts: Deque[TrainPipelineContext]
    batches: Deque[Optional[Any]]
    _model: torch.nn.Module
    _model_fwd: Callable[..., Any]
    _custom_model_fwd: Optional[Callable[..., Any]]

    def start_sparse_data_dist(self, batch: Optional[Any], context: TrainPipelineContext) -> None:
        """Start ``batch``'s input_dist (the pipeline's verb)."""
        raise NotImplementedError

    @property
    def _rewrite(self) -> Optional[RewriteResult]:
        return self._pipelined.result

    @property
    def _fusion(self) -> SplitsFusion:
        return self._pipelined.fusion

    @property
    def _model_attached(self) -> bool:
        return self._pipelined.attached

    @property
    def _pipelined_modules(self) -> List[AnyShardedModule]:
        return self._pipelined.modules

    @property
    def _pipelined_postprocs(self) -> List[PipelinedPostproc]:
        """The postproc wrappers installed by the rewrite (``pipeline_postproc=True``)."""
        return self._pipelined.postprocs

    def _make_postproc(
        self, fqn: str, module: torch.nn.Module, call_args: CallArgs
    ) -> PipelinedPostproc:
        # Runs where input_dist runs (data_dist; Lite: the default stream) and
        # is read on the stream current in the forward (default_stream None).
        return PipelinedPostproc(
            module, fqn, call_args, self._current_context(), None, self._streams.data_dist
        )

    def _make_forward(
        self, name: str, call_args: CallArgs, module: AnyShardedModule
    ) -> BaseForward[Any]:
        return PipelinedForward(
            name,
            call_args,
            module,
            self._current_context(),
            self._streams.data_dist,
            wait_on_current_stream=self._clear_data_dist_inputs,
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
        module's wrapper comes from :meth:`_make_forward`.
        """
        result = self._rewrite_checked(batch)
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
        if self._rewrite is None:
            self._pipeline_model(batch, context, pipelined_forward)
        else:
            self._set_module_context(context)
            self.start_sparse_data_dist(batch, context)

    def _rewrite_checked(self, batch: Any) -> RewriteResult:
        """Rewrite the model and apply the ``on_unpipelined`` policy."""
        return self._pipelined.rewrite(
            batch,
            self._make_forward,
            self._options["rewrite_strategy"],
            self._options["on_unpipelined"],
            make_postproc=self._make_postproc if self._pipeline_postproc else None,
        )

    def _input_dist_modules(self) -> List[Tuple[str, AnyShardedModule, CallArgs]]:
        # No rewrite: a subclass's _init_pipelined_modules (or _pipeline_model) did
        # not call ours.  Then, as on torchrec, no module is pipelined and each runs
        # its own input_dist inside the forward.
        result = self._pipelined.result
        if result is None:
            return []
        return [(p.name, p.module, p.call_args) for p in result.pipelined]

    def _current_context(self) -> TrainPipelineContext:
        return self.contexts[0] if self.contexts else self._context_type()

    def _set_module_context(self, context: TrainPipelineContext) -> None:
        """Point the forward wrappers and postprocs at the batch whose forward runs next."""
        result = self._pipelined.result
        if result is None:
            return
        for pipelined in result.pipelined:
            cast(BaseForward[Any], pipelined.module.forward).set_context(context)
        for postproc in result.postprocs:
            postproc.set_context(context)

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
        if model is not None and model is not self._model:
            self.detach()
            self._model = model
            self._model_fwd = self._custom_model_fwd or model
            self._pipelined.replace_model(model)  # a new model is traced on the next batch
        if self._model_attached:
            return
        if self._rewrite is None:
            self._pipelined.attached = True
            if self.contexts:
                self._pipeline_model_without_input_dist(self.batches[0])
            return
        self._pipelined.reattach(self._make_forward)
        self._fusion.fuse(self._pipelined.modules)
        if self.contexts:
            self._set_module_context(self.contexts[0])

    def _pipeline_model_without_input_dist(self, batch: Any) -> None:
        self._rewrite_checked(batch)
        self._pipelined.fuse_new()
        self._set_module_context(self.contexts[0])


__all__ = ["SparseDistRewrite"]
