"""The batch walker: the KJTs a batch holds, found without recording where.

It stands on the ground floor so that the per-batch checks and copies of every
part can call it; :func:`trec_pipelines.model.rewrite.kjt_fields` is the walker
that also records each KJT's path.
"""

from __future__ import annotations

from typing import Any, List

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def kjts_in(batch: Any) -> List[KeyedJaggedTensor]:
    """The KJTs :func:`~trec_pipelines.model.rewrite.kjt_fields` finds in ``batch``, in the same order, without
    their paths: what the per-batch checks need, at a fraction of the cost."""
    return _collect_kjts(batch, [], 0)


def _collect_kjts(
    value: Any, found: List[KeyedJaggedTensor], depth: int
) -> List[KeyedJaggedTensor]:
    # Leaves (tensors, KJTs) are handled in the loop, so a flat batch costs one call.
    if isinstance(value, KeyedJaggedTensor):
        found.append(value)
        return found
    if isinstance(value, dict):
        items: Any = (item for key, item in value.items() if isinstance(key, (str, int)))
    elif isinstance(value, (list, tuple)):
        items = value
    elif hasattr(value, "__dict__") and not isinstance(value, torch.Tensor):
        items = vars(value).values()
    else:
        return found
    for item in items:
        if isinstance(item, KeyedJaggedTensor):
            found.append(item)
        elif depth < 3 and not isinstance(item, _LEAVES):
            _collect_kjts(item, found, depth + 1)
    return found


# What holds no KJT: skipped without a call (a batch's tensors, flags and counts).
_LEAVES = (torch.Tensor, bool, int, float, str, bytes, type(None))
