"""Taking a model over from another pipeline left attached to it.

A train pipeline and an eval pipeline often share one model, and the eval
pipeline is left attached when its data ends: its forward wrappers stay on
the sharded modules.  Whichever pipeline runs next calls :func:`take_model_over`
first: every other pipeline whose wrappers it finds is detached (it gives back
exactly what it replaced) and told who took the model, so it takes the model
back the same way at its own next ``progress()``.  A wrapper whose pipeline
was collected without ``detach()`` is undone from what it recorded it replaced.

The SparseDist family rewrites the model itself after the take-over; Base and
PT2, which run the model's own forward, only need the wrappers gone (else a
module's input_dist would wait for a batch no pipeline started).
"""

from __future__ import annotations

import logging
from typing import Dict, Optional

import torch

from trec_pipelines._types import AnyShardedModule
from trec_pipelines.model.rewrite import note_wrapper_change, sharded_modules
from trec_pipelines.sparse.forwards import BaseForward
from trec_pipelines.sparse.input_dist import unfuse_left_over

logger: logging.Logger = logging.getLogger(__name__)


def strip_orphan(module: AnyShardedModule) -> None:
    """Undo what a collected pipeline left on ``module``: its forward wrapper(s)
    and its splits-only input_dist overrides."""
    while True:
        forward = module.__dict__.get("forward")
        if not isinstance(forward, BaseForward) or forward.owner is not None:
            break
        assert forward.replaced is not None, "wrappers are tagged when installed"
        had_instance_forward, original = forward.replaced
        note_wrapper_change()
        if had_instance_forward:
            module.forward = original  # type: ignore[method-assign]
        else:
            module.__dict__.pop("forward", None)
    unfuse_left_over(module)


def take_model_over(
    pipeline: object, model: torch.nn.Module, sharded: Optional[Dict[str, AnyShardedModule]]
) -> Dict[str, AnyShardedModule]:
    """Detach every pipeline but ``pipeline`` whose wrappers are on ``model``.

    ``sharded`` is the model's sharded modules found by an earlier call (None:
    find them now); returns them, for the next call.
    """
    if sharded is None:
        sharded = sharded_modules(model)
    for name, module in sharded.items():
        forward = module.__dict__.get("forward")
        if not isinstance(forward, BaseForward) or forward.owner is pipeline:
            continue
        other = forward.owner
        if other is None:
            logger.warning(
                "%s: sharded module '%s' still carried the forward wrapper of a %s "
                "that was dropped without detach(); restored its own forward",
                type(pipeline).__name__,
                name,
                forward.owner_name,
            )
            strip_orphan(module)
            continue
        logger.warning(
            "%s: the model is still attached to a %s (its forward wrappers are on "
            "'%s'); detaching it and taking the model over. Call detach() on a "
            "pipeline when you are done with it to avoid this.",
            type(pipeline).__name__,
            type(other).__name__,
            name,
        )
        other.detach()
        other._taken_over_by = type(pipeline).__name__
    return sharded
