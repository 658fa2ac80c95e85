"""The model a pipeline works on: its rewrite, its wrappers, its take-over.

[Note: who owns a pipelined model]
A pipeline that pipelines the model's sharded modules (the SparseDist family,
and :class:`~trec_pipelines.SparseDataDistUtil` for a staged pipeline)
replaces each module's ``forward`` with a wrapper of its own.  Everything
about those wrappers lives in one :class:`PipelinedModel` per pipeline:

* the first rewrite (:meth:`PipelinedModel.rewrite`), with the
  ``on_unpipelined`` policy applied and every wrapper *claimed*: tagged with
  the pipeline that installed it and with what it replaced;
* the splits-only input_dist fusion and its dedicated group;
* :meth:`~PipelinedModel.detach` and :meth:`~PipelinedModel.reattach`, which
  give the modules their own forwards back and swap the same wrappers in again;
* the take-over (:meth:`~PipelinedModel.take_over`): before a pipeline runs,
  every other pipeline whose claimed wrappers are on the model is detached and
  told which pipeline took the model, so it takes the model back the same way
  at its own next step.

Pipelines that run the model's own forward (Base, PT2) hold one too: they
never rewrite, and only take the model over.  So any two pipelines can
alternate on one model, whatever their kind, and a wrapper can always be
traced back to the pipeline that installed it.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from trec_pipelines._types import AnyShardedModule
from trec_pipelines.core.checks import unsharded_model_note
from trec_pipelines.core.input_dist_group import InputDistGroup
from trec_pipelines.model.args import CallArgs
from trec_pipelines.model.postproc import PipelinedPostproc
from trec_pipelines.model.rewrite import (
    RewriteResult,
    Strategy,
    WrapperChanges,
    note_wrapper_change,
    reapply_rewrite,
    restore_model,
    rewrite_model,
)
from trec_pipelines.sparse.forwards import BaseForward, WrapperOwner
from trec_pipelines.sparse.input_dist import SplitsFusion
from trec_pipelines.sparse.takeover import take_model_over

logger: logging.Logger = logging.getLogger(__name__)

MakeForward = Callable[[str, CallArgs, AnyShardedModule], BaseForward[Any]]
MakePostproc = Callable[[str, torch.nn.Module, CallArgs], PipelinedPostproc]


class PipelinedModel:
    """One pipeline's hold on its model (see [Note: who owns a pipelined model]).

    ``owner`` is the pipeline: wrappers are claimed in its name, and a
    take-over by another pipeline calls its ``detach()`` and sets its
    ``_taken_over_by``.  It is held weakly, so a pipeline dropped without
    ``detach()`` is collected at once and its wrappers become orphans that the
    next take-over undoes.
    """

    def __init__(
        self,
        owner: object,
        model: torch.nn.Module,
        input_dist_group: InputDistGroup = "shared",
    ) -> None:
        self._owner = weakref.ref(owner)
        # Its wrappers become orphans when it is collected: the next take-over looks.
        weakref.finalize(owner, note_wrapper_change).atexit = False
        self.owner_name = type(owner).__name__
        self.model = model
        self.result: Optional[RewriteResult] = None
        # False after detach(): the modules run their own forwards.
        self.attached = True
        # The model's sharded modules, found once: each take-over looks at their forwards.
        self._sharded: Optional[Dict[str, AnyShardedModule]] = None
        # The wrapper-change count (``changes.count``) when the modules were last
        # looked at: a step's start calls take_over() only when it differs.
        self.looked_at = -1
        # The process's count of wrapper changes, read live (a class, not a copy).
        self.changes = WrapperChanges
        self.fusion = SplitsFusion(input_dist_group)

    @property
    def owner(self) -> object:
        owner = self._owner()
        assert owner is not None, "a pipeline's model outlives it only without this hold"
        return owner

    @property
    def modules(self) -> List[AnyShardedModule]:
        return [] if self.result is None else self.result.modules

    @property
    def postprocs(self) -> List[PipelinedPostproc]:
        return [] if self.result is None else list(self.result.postprocs)

    def input_dist_modules(self) -> List[Tuple[str, AnyShardedModule, CallArgs]]:
        """``(name, module, call_args)`` of each module whose input_dist the pipeline runs.

        Empty without a rewrite: a subclass's ``_init_pipelined_modules`` (or
        ``_pipeline_model``) did not call ours.  Then, as on torchrec, no module
        is pipelined and each runs its own input_dist inside the forward.
        """
        if self.result is None:
            return []
        return [(p.name, p.module, p.call_args) for p in self.result.pipelined]

    def take_over(self) -> None:
        """Detach every other pipeline whose wrappers are on the model.

        A step's start calls it only when some wrapper was put on or taken off
        since it last looked (anywhere in the process: :attr:`looked_at` differs
        from ``WrapperChanges.count``), so a steady state costs one comparison.
        """
        self._sharded = take_model_over(self.owner, self.model, self._sharded)
        self.looked_at = WrapperChanges.count

    def rewrite(
        self,
        batch: Any,
        make_forward: MakeForward,
        strategy: Strategy,
        on_unpipelined: str,
        make_postproc: Optional[MakePostproc] = None,
    ) -> RewriteResult:
        """Rewrite the model for ``batch``'s fields and claim the wrappers."""
        self.take_over()
        result = rewrite_model(
            self.model, batch, make_forward, strategy, make_postproc=make_postproc
        )
        self._claim(result)
        if result.not_pipelined and on_unpipelined == "raise":
            restore_model(result)
            raise RuntimeError(
                "some sharded modules cannot be pipelined (on_unpipelined='raise'):\n"
                + result.report()
                + "\nFeed each one a batch field directly (no transformation in the "
                "forward), or pass on_unpipelined='warn' to train them unpipelined."
            )
        if not result.pipelined and not result.not_pipelined:
            logger.warning("%s", unsharded_model_note(self.model, self.owner_name))
        self.result = result
        self.attached = True
        return result

    def fuse_new(self) -> None:
        """Fuse the splits exchange of a fresh rewrite (its input_dists exist only
        after their first call)."""
        self.fusion.new_rewrite()
        self.fusion.fuse(self.modules)

    def detach(self) -> None:
        """Give the modules (and postprocs) their own forwards back."""
        if self.result is not None and self.attached:
            if self.fusion.fused:
                self.fusion.unfuse()
            restore_model(self.result)
        self.attached = False
        self.looked_at = -1  # the next step's start takes the model back

    def reattach(self, make_forward: MakeForward) -> None:
        """Swap the same wrappers in again after :meth:`detach`, taking the model
        over from any pipeline that holds it now.  The caller fuses the splits
        exchange again when its modules' input_dists are due (:attr:`fusion`)."""
        assert self.result is not None, "reattach() follows a rewrite"
        self.take_over()
        self.result = reapply_rewrite(self.result, make_forward)
        self._claim(self.result)
        self.attached = True

    def replace_model(self, model: torch.nn.Module) -> None:
        """Hold a new model: the next batch rewrites it."""
        self.detach()
        self.model = model
        self.result = None
        self._sharded = None

    def _claim(self, result: RewriteResult) -> None:
        """Tag ``result``'s wrappers with their pipeline and what they replaced."""
        owner = self.owner
        # Only a pipeline that can give the model back (detach()) rewrites it.
        assert isinstance(owner, WrapperOwner), f"{self.owner_name} rewrites without detach()"
        for module, had_instance_forward, original, _ in result._saved:
            forward = module.__dict__.get("forward")
            if isinstance(forward, BaseForward):
                forward.claim(owner)
                forward.replaced = (had_instance_forward, original)
