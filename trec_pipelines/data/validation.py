"""Checks on each host batch's ``KeyedJaggedTensor``\\ s, before anything trains.

A KJT whose lengths do not add up to its values trains silently (the
all-to-all sends whatever the lengths say) and skews every rank it reaches.
:func:`batch_problem` finds the first inconsistency of a host batch with a
handful of vectorised tensor ops per KJT, no per-element Python:

* ``values``, ``lengths`` and ``offsets`` have integer dtypes;
* no length is negative, and offsets never decrease and start at 0;
* the lengths of each key add up to that key's values: in total to
  ``values.numel()``, and per key to ``length_per_key`` when the KJT carries it;
* offsets agree with lengths when both are set, and end at ``values.numel()``;
* ``weights``, when present, has one entry per value;
* (fixed stride) there are ``stride`` lengths per key.

The pipelines run it in :class:`~trec_pipelines.data.source.BatchSource` as each
batch is pulled from the iterator (``validate_batches=True``, the default).

It runs on every batch, so the common case is kept cheap: a host KJT with
lengths is checked on Python lists (small batches) or NumPy views of its
tensors (large ones), with no torch dispatch.  Only a KJT that fails that
check, or one it doesn't cover (offsets only, variable stride, device
tensors), takes the torch path, which also finds the key to name.

The KJTs of a batch are found by :func:`kjts_in`, which the check below
shares: :func:`shares_kjt_storage` tells a device "copy" that kept the
loader's own storage (a batch already on the device), which
``free_features_storage_early`` must not free.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, List, Optional, Protocol

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from trec_pipelines.model.rewrite import kjt_fields

logger: logging.Logger = logging.getLogger(__name__)


# What holds no KJT: skipped without a call (a batch's tensors, flags and counts).
_LEAVES = (torch.Tensor, bool, int, float, str, bytes, type(None))


def kjts_in(
    value: Any, found: Optional[List[KeyedJaggedTensor]] = None, depth: int = 0
) -> List[KeyedJaggedTensor]:
    """The KJTs :func:`~trec_pipelines.model.rewrite.kjt_fields` finds in batch ``value``,
    in the same order, without their paths: what the per-batch checks need, at a
    fraction of the cost (``found`` and ``depth``: the walk's list and level so far)."""
    found = [] if found is None else found
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
        # Leaves first: a KJT is none of them, and telling a tensor from a KJT
        # costs an ABC check (KJT's metaclass) that the leaves' check does not.
        if isinstance(item, _LEAVES):
            continue
        if isinstance(item, KeyedJaggedTensor):
            found.append(item)
        elif depth < 3:
            kjts_in(item, found, depth + 1)
    return found


def _not_integer(tensor: Optional[torch.Tensor]) -> bool:
    return tensor is not None and (
        tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool
    )


def _key_at(keys: List[str], per_key: torch.Tensor, position: int) -> str:
    """The key whose lengths hold flat position ``position`` (``per_key``: lengths per key)."""
    ends = torch.cumsum(per_key, 0)
    return keys[min(int(torch.searchsorted(ends, position, right=True)), len(keys) - 1)]


_INTEGER_DTYPES = frozenset({torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64})


# Below this many lengths, Python lists beat NumPy: inside a training loop a
# NumPy reduction costs ~10 us (cold caches), ``tolist()`` plus ``min``/``sum``
# on 64 lengths ~8 us in all; above it, NumPy's per-element speed wins.
_SMALL = 2048


def _running_sum_matches(offsets: torch.Tensor, lengths: torch.Tensor) -> bool:
    """``offsets`` is 0 followed by the running sum of ``lengths``."""
    if offsets.numel() != lengths.numel() + 1:
        return False
    if lengths.numel() <= _SMALL:
        return offsets.tolist() == [0, *itertools.accumulate(lengths.tolist())]
    running = offsets.numpy()
    return bool(running[0] == 0) and np.array_equal(np.diff(running), lengths.numpy())


def _looks_consistent(kjt: KeyedJaggedTensor) -> bool:
    """True when ``kjt`` certainly passes :func:`kjt_problem`; False means "ask it".

    Covers the usual host batch: fixed stride, lengths set (offsets too or
    not), integer dtypes, plain CPU tensors.
    """
    values = kjt.values()
    lengths = kjt.lengths_or_none()
    offsets = kjt.offsets_or_none()
    if (
        lengths is None
        or values.dtype not in _INTEGER_DTYPES
        or lengths.dtype not in _INTEGER_DTYPES
    ):
        return False
    if offsets is not None and offsets.dtype not in _INTEGER_DTYPES:
        return False
    weights = kjt.weights_or_none()
    n = values.numel()
    if weights is not None and weights.numel() != n:
        return False
    keys = kjt.keys()
    if not keys:
        return True
    if kjt.variable_stride_per_key() or type(lengths) is not torch.Tensor or not lengths.is_cpu:
        return False
    if lengths.numel() != len(keys) * kjt.stride():
        return False
    # With no negative length and the right total, the lengths split the values
    # among the keys; per-key sums are only needed to compare a cached length_per_key.
    cached = kjt.length_per_key_or_none()
    rows = len(keys) if cached is not None else 0
    if lengths.numel() <= _SMALL:
        flat = lengths.tolist()
        if min(flat, default=0) < 0 or sum(flat) != n:
            return False
        width = len(flat) // rows if rows else 0
        per_key = [sum(flat[r * width : (r + 1) * width]) for r in range(rows)]
    else:
        array = lengths.numpy()
        if int(array.min()) < 0 or int(array.sum()) != n:
            return False
        per_key = array.reshape(rows, -1).sum(axis=1).tolist() if rows else []
    if cached is not None and list(cached) != per_key:
        return False
    if offsets is not None and not (
        type(offsets) is torch.Tensor and offsets.is_cpu and _running_sum_matches(offsets, lengths)
    ):
        return False
    return True


def kjt_problem(kjt: KeyedJaggedTensor) -> Optional[str]:
    """What is inconsistent in ``kjt``, naming the key, or None."""
    keys = kjt.keys()
    values = kjt.values()
    lengths = kjt.lengths_or_none()
    offsets = kjt.offsets_or_none()
    for name, tensor in (("values", values), ("lengths", lengths), ("offsets", offsets)):
        if _not_integer(tensor):
            return f"{name} has dtype {tensor.dtype}; ids, lengths and offsets must be integers"  # type: ignore[union-attr]
    n = values.numel()
    weights = kjt.weights_or_none()
    if weights is not None and weights.numel() != n:
        return (
            f"weights has {weights.numel()} entries but values has {n}; give one weight per value"
        )
    if not keys:
        return None
    if offsets is not None:
        if offsets.numel() == 0 or int(offsets[0]) != 0:
            return "offsets must start at 0"
        steps = torch.diff(offsets)
        if lengths is not None and (
            steps.shape != lengths.shape or not torch.equal(steps, lengths.to(steps.dtype))
        ):
            return "offsets are not the running sum of lengths"
        if lengths is None:
            lengths = steps  # offsets[-1] == n is then the total check below
    assert lengths is not None, "a KeyedJaggedTensor has lengths or offsets"
    if kjt.variable_stride_per_key():
        counts = kjt.stride_per_key()
        if sum(counts) != lengths.numel():
            return f"{lengths.numel()} lengths for strides {counts} (sum {sum(counts)})"
        per_key = (
            torch.stack([part.sum() for part in lengths.split(counts)])
            if counts
            else lengths.new_zeros(0)
        )
        per_key_count = torch.tensor(counts)
    else:
        stride = kjt.stride()
        if lengths.numel() != len(keys) * stride:
            return (
                f"{lengths.numel()} lengths for {len(keys)} keys x stride {stride}; "
                "give one length per key and sample"
            )
        per_key = lengths.view(len(keys), stride).sum(1) if stride else lengths.new_zeros(len(keys))
        per_key_count = torch.full((len(keys),), stride)
    if lengths.numel() and int(lengths.min()) < 0:
        first = int(torch.nonzero(lengths < 0)[0])
        return f"key '{_key_at(keys, per_key_count, first)}' has a negative length"
    cached = kjt.length_per_key_or_none()
    if cached is not None:
        if len(cached) != len(keys):
            return (
                f"length_per_key has {len(cached)} entries for {len(keys)} keys; "
                "give one per key, or leave it out"
            )
        for key, said, counted in zip(keys, cached, per_key.tolist(), strict=True):
            if said != counted:
                return f"key '{key}': length_per_key says {said} values but its lengths add up to {counted}"
    total = int(per_key.sum())
    if total > n:
        return (
            f"key '{_key_at(keys, per_key, n)}': the lengths add up to {total} values but "
            f"values has only {n} ({total - n} missing)"
        )
    if total < n:
        return (
            f"key '{keys[-1]}' (the last): the lengths add up to {total} values but values "
            f"has {n} ({n - total} extra, covered by no key)"
        )
    return None


def batch_problem(batch: Any) -> Optional[str]:
    """The first inconsistency of any KJT in ``batch`` (where it is, and what), or None."""
    if all(_looks_consistent(kjt) for kjt in kjts_in(batch)):
        return None
    if isinstance(batch, KeyedJaggedTensor):
        found = [("", batch)]
    elif isinstance(batch, torch.Tensor):
        return None
    else:
        found = [(str(path), kjt) for path, kjt in kjt_fields(batch)]
    for path, kjt in found:
        problem = kjt_problem(kjt)
        if problem is not None:
            where = f"KeyedJaggedTensor {path}" if path else "KeyedJaggedTensor"
            return f"{where}: {problem}"
    return None


# -------------------------------------- a device copy that kept the loader's storage


def shares_kjt_storage(host: Any, device: Any) -> bool:
    """True when a ``KeyedJaggedTensor`` of ``device`` (a batch's device copy)
    still uses the storage of one of ``host``'s (the batch as the loader gave it).

    That is the case when the batch was already on the device (any batch on
    CPU, a loader that yields device tensors): the "copy" is the loader's own
    tensors, which ``free_features_storage_early`` must not free.
    """
    owned = {kjt.values().untyped_storage().data_ptr() for kjt in kjts_in(host)}
    return any(kjt.values().untyped_storage().data_ptr() in owned for kjt in kjts_in(device))


class WarnsOfSharedFeatures(Protocol):
    """What :func:`warn_shared_features` uses of a pipeline: its device, and the
    flag that it has warned, which it sets."""

    _warned_shared_features: bool

    @property
    def _device(self) -> torch.device: ...


def note_shared_features(
    pipeline: WarnsOfSharedFeatures, host: Any, batch: Any, context: Any
) -> None:
    """Mark a batch whose "copy" kept the loader's storage (it was on the device
    already), which ``free_features_storage_early`` must not free; called only
    with that option on."""
    if shares_kjt_storage(host, batch):
        context.features_shared_with_loader = True
        warn_shared_features(pipeline)


def warn_shared_features(pipeline: WarnsOfSharedFeatures) -> None:
    """Log, once per pipeline, that ``free_features_storage_early`` has nothing to free."""
    if not pipeline._warned_shared_features:
        pipeline._warned_shared_features = True
        logger.warning(
            "%s: free_features_storage_early has nothing to free on this batch: it "
            "was on %s already, so its KeyedJaggedTensors are the loader's own "
            "tensors (freeing them would destroy the data, e.g. for the next epoch)",
            type(pipeline).__name__,
            pipeline._device,
        )
