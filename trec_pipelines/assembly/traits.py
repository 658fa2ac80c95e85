"""What a pipeline class is, declared once per class: :class:`Traits`.

[Note: a pipeline's traits]
The shared core (:class:`~trec_pipelines.assembly.pipeline.PipelineCore`)
asks a few questions of every pipeline: does it need an optimizer, does its
splits exchange carry the ranks' agreement, does it move ``_state`` as
torchrec's class does, how many batches does it hold, which of torchrec's
hooks does it not honour.  Each answer is a field of one frozen
:class:`Traits`, held by the class as ``_traits``; a variant declares its own
as its base's with the answers that differ (:meth:`Traits.updated`), so a
reader finds every answer of a class in one place and the class carries one
private name for all of them, not one per question.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Type

from trec_pipelines.assembly.resume import ResumeHooks
from trec_pipelines.core.subclass_hooks import Decision


@dataclass(frozen=True)
class Traits:
    """The answers the core asks a pipeline class for (see [Note: a pipeline's traits])."""

    # Variants that only run forwards (Eval) take optimizer=None.
    requires_optimizer: bool = True
    # Variants whose steps start the pipelined input_dist, whose splits
    # exchange carries the ranks' agreement on each pull (see
    # [Note: agreeing on each batch]); the others agree by an all-reduce.
    carries_agreement: bool = False
    # Whether each host batch is pulled through _next_batch (torchrec's hook);
    # False where torchrec's class never calls it (it is then uncalled).
    pulls_through_next_batch: bool = True
    # Whether each host batch is pulled where the copy stage asks for it, not
    # ahead: a user's _next_batch override then sees torchrec's state (see
    # [Note: a user's _next_batch pulls at torchrec's moment]).  Set per class
    # by PipelineCore.__init_subclass__, never declared.
    pulls_when_copied: bool = False
    # Whether each step moves _state through IDLE, CALL_FWD and CALL_BWD, as the
    # torchrec class of the same name does (the others leave it IDLE).
    tracks_state: bool = False
    # Whether a subclass's own progress() runs inside the step guard.
    guards_user_progress: bool = True
    # The most batches in flight right after a step's copy: what a call may
    # pull (0: the class keeps no such count).  Public: a subclass outside
    # this package declares it with the class keyword ``depth``
    # (PipelineCore.__init_subclass__).
    depth: int = 0
    # The stream role input_dist is recorded on (Lite: the default stream).
    input_dist_role: str = "data_dist"
    # Whether a batch's input_dist starts in an earlier step than its forward
    # (not in Lite): then it may run on a dedicated group (input_dist_group).
    input_dist_ahead: bool = True
    # Whether attach() of a new model mid-epoch rewrites it at once, for the
    # batches in flight (not in Lite: none of them has started its input_dist,
    # and the next progress() rewrites it as it starts one).
    rewrite_on_attach: bool = True
    # Each of torchrec's hooks the class does not honour, uncalled or refused
    # (see [Note: subclass hooks]); a variant's own decisions win over its base's.
    hooks: Mapping[str, Decision] = field(default_factory=dict)
    # What a checkpoint asks of the pipeline, made for each state_dict() and
    # load_state_dict() call: a variant that keeps more names a subclass.
    resume: Type[ResumeHooks] = ResumeHooks

    def updated(self, hooks: Optional[Mapping[str, Decision]] = None, **answers: Any) -> Traits:
        """These traits with ``answers`` changed and ``hooks`` decided on top of these."""
        merged = {**self.hooks, **(hooks or {})}
        return dataclasses.replace(self, hooks=merged, **answers)


__all__ = ["Traits"]
