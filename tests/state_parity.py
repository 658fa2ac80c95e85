"""torchrec's pipeline attributes, per class, for the state-parity tests.

Shared by the unit tier (every attribute torchrec's ``__init__`` sets is
honoured by ours or listed below as not applicable) and the distributed tier
(the honoured ones read as torchrec's at the same points of an epoch).
"""

from __future__ import annotations

import ast
import collections
import enum
import inspect
import textwrap
from typing import Any, Dict, Iterator, List, Optional

import torch

# Attributes of torchrec's pipelines that ours does not offer, and why.  Every
# other attribute torchrec's __init__ sets must read on ours as on torchrec's.
NOT_APPLICABLE: Dict[str, str] = {
    "_batch_i": "torchrec's deprecated version-0 slot, only set by the version-0 API, "
    "which ours refuses (`_fill_pipeline`, `_copy_batch_to_gpu`)",
    "_batch_ip1": "as `_batch_i`: torchrec's deprecated version-0 slot",
    "_batch_ip2": "as `_batch_i`: torchrec's deprecated version-0 slot",
    "_context": "torchrec's deprecated version-0 context (`version=0`), only used by the "
    "version-0 API; each batch's context is in `contexts`",
    "_original_forwards": "the shape of torchrec's rewrite is its own; "
    "`rewrite_result` lists what ours replaced, and `detach()` restores it",
    "_original_kjt_dist_forwards": "as `_original_forwards`: the shape of torchrec's rewrite",
    "_stream_context": "torchrec's stream-context factory (`torch.cuda.stream` even on CPU); "
    "ours enters streams through `trec_pipelines.core.streams.on_stream`",
    "_inplace_copy_batch_size_logged": "a flag of torchrec's logging",
    "_inplace_copy_executor": "torchrec's thread pool for `async_inplace_copy` (1.9.2); ours "
    "issues that copy on a worker of its own (torchrec's `_setup_async_inplace_copy` and "
    "`_submit_inplace_copy` are refused)",
}

PT2_REASON = (
    "set by the constructor of torchrec's Base, which its PT2 inherits; PT2's step never "
    "reads or changes it"
)

# Attributes not applicable in one class only: class name -> attribute -> why.
NOT_APPLICABLE_IN: Dict[str, Dict[str, str]] = {
    "TrainPipelinePT2": {
        "_batch_count": PT2_REASON,
        "_connected": PT2_REASON,
        "_enable_inplace_copy_batch": PT2_REASON,
        "_memcpy_stream": PT2_REASON + " (its copy is blocking, on the default stream)",
    },
    "StagedTrainPipeline": {
        "_num_steps": "a counter torchrec's Staged only prints in its debug log lines",
        "_stage_outputs": "torchrec's per-stage output list has another shape in ours "
        "(slots with host copies and indices); its `_run_stage` and `_advance` are refused",
    },
    "TrainPipelineSparseDistT": {
        "_copy_executor": "torchrec's thread pool for the copies; ours issues them on a "
        "worker of its own",
    },
    "TrainPipelineSparseDistOptStash": {
        "_await_restore": "torchrec's handles of the stash and restore in flight; ours "
        "keeps them in a stashing object of its own, which also survives a failed step",
        "_restore_future": "as `_await_restore`: torchrec's handle of the restore in flight",
        "_stash_future": "as `_await_restore`: torchrec's handle of the stash in flight",
    },
    "TrainPipelineSparseDistEmbStash": {
        "_stash_hook_handle": "torchrec's handle of its forward pre-hook; ours hooks the "
        "stash sites once, after the first rewrite (`_hook_sites()`)",
    },
    "TrainPipelinePrefetchEMS": {
        "_stash_hook_handle": "torchrec's handle of its forward pre-hook; ours hooks the "
        "stash sites once, after the first rewrite (`_hook_sites()`)",
    },
    "TrainPipelinePEC": {
        "_input_dist_event": "an event of torchrec's PEC plumbing (refused, see the hook "
        "table); ours orders the deferred gradient with events of its own",
        "_overlap_dist_event": "as `_input_dist_event`: an event of torchrec's PEC plumbing",
    },
    "EvalPipelineCPUSparse": {
        "_pinned_buffers": "torchrec's one pinned buffer per module; ours keeps two per "
        "module, each written again only once the copy that read it has finished",
    },
    "EvalPipelineSparseDist": {
        "_batch_loader": "torchrec's loading thread (a `DataLoadingThread`); ours loads "
        "through a loader of its own, on a thread or inline",
        "_dataloader_iter": "torchrec's Eval pulls on its loading thread and never sets it "
        "(None throughout); ours reads the epoch's iterator, as the other classes",
        "_dataloader_exhausted": "torchrec's Eval never sets it (False throughout); ours "
        "reads the end of the data, as the other classes",
    },
}

# Attributes honoured until the data ends, and why they differ after it.
UNTIL_THE_END: Dict[str, str] = {
    "_next_index": "torchrec's also counts the contexts it makes for batches that never "
    "come (one per copy attempted after the end: 2 or 3); ours counts batches",
}


def not_applicable(name: str) -> Dict[str, str]:
    """Every attribute not applicable in class ``name``, with why."""
    return {**NOT_APPLICABLE, **NOT_APPLICABLE_IN.get(name, {})}


def init_attributes(cls: type) -> List[str]:
    """Every ``self.<name>`` the ``__init__`` of ``cls`` and of its bases assigns
    (read from their source), sorted."""
    found = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if klass is object or init is None:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(init))
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            else:
                continue
            for target in targets:
                for part in ast.walk(target):
                    if (
                        isinstance(part, ast.Attribute)
                        and isinstance(part.value, ast.Name)
                        and part.value.id == "self"
                    ):
                        found.add(part.attr)
    return sorted(found)


def describe(
    value: Any,
    batches: List[Any],
    known: Dict[int, str],
) -> Any:
    """A value as the state comparison sees it.

    A batch by its index in ``batches`` (by content: ours and torchrec's hold
    device copies), a context by its batch's index, ``known`` objects
    (iterator, model, optimizer) by identity and name, a deque or list by its
    items, a stream (None on CPU) as it is, an enum by its name, anything else
    plain by value and the rest by type.
    """
    if id(value) in known:
        return known[id(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, torch.device):
        return str(value)
    dense = getattr(value, "dense", None)
    if isinstance(dense, torch.Tensor):
        for index, batch in enumerate(batches):
            if dense.shape == batch.dense.shape and torch.equal(dense.cpu(), batch.dense):
                return f"batch {index}"
        return "batch ?"
    if hasattr(value, "module_contexts"):
        return f"context {getattr(value, 'index', None)}"
    if isinstance(value, (collections.deque, list, tuple)):
        return [describe(item, batches, known) for item in value]
    if isinstance(value, torch.nn.Module):
        return f"module {type(value).__name__}"
    if isinstance(value, type):
        return f"class {value.__name__}"
    if hasattr(value, "__next__"):
        return "another iterator"
    return f"a {type(value).__name__}"


def known_objects(**named: Any) -> Dict[int, str]:
    """``known`` for :func:`describe`: each object by identity, under its name."""
    return {id(value): name for name, value in named.items() if value is not None}


def snapshot(
    pipeline: Any,
    names: List[str],
    batches: List[Any],
    known: Dict[int, str],
) -> Dict[str, Any]:
    """``describe`` of each attribute in ``names`` on ``pipeline`` ("missing" if absent)."""
    missing = object()
    out: Dict[str, Any] = {}
    for name in names:
        value = getattr(pipeline, name, missing)
        out[name] = "missing" if value is missing else describe(value, batches, known)
    return out


def every_attribute(pipeline: Any) -> List[str]:
    """The instance attributes of torchrec's ``pipeline`` (``vars()``), sorted."""
    return sorted(vars(pipeline))


def run_to(pipeline: Any, it: Iterator[Any], steps: Optional[int]) -> int:
    """Call ``progress(it)`` ``steps`` times (None: until StopIteration); how many ran."""
    done = 0
    while steps is None or done < steps:
        try:
            pipeline.progress(it)
        except StopIteration:
            break
        done += 1
    return done
