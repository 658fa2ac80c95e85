"""The verbs every timeline is built from: check, walk, copy and wait for a batch.

Each pipeline's ``progress()`` is a sequence of these calls (and of the sparse
ops in :mod:`trec_pipelines.sparse`); the streams they run on are passed in
explicitly.  Nothing here keeps state of its own (the one flag,
``_warned_shared_features``, lives on the pipeline).  The batch walker,
:func:`kjts_in`, stands here on the ground floor so that the per-batch checks
and copies of every part can call it; :func:`trec_pipelines.model.rewrite.kjt_fields`
is the walker that also records each KJT's path.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Multistreamable, Pipelineable

from trec_pipelines.core.streams import hand_off, on_stream

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
        if isinstance(item, KeyedJaggedTensor):
            found.append(item)
        elif depth < 3 and not isinstance(item, _LEAVES):
            kjts_in(item, found, depth + 1)
    return found


def check_batch(batch: Any) -> None:
    """Raise a ``TypeError`` naming the fix when ``batch`` can't be pipelined."""
    if isinstance(batch, (torch.Tensor, Pipelineable)):
        return
    raise TypeError(
        f"the data iterator yielded a {type(batch).__name__}, which is neither a "
        "torch.Tensor nor a torchrec.streamable.Pipelineable. Wrap the batch in a "
        "class that implements Pipelineable (to(device, non_blocking) and "
        "record_stream(stream)), for example a dataclass of tensors and "
        "KeyedJaggedTensors."
    )


def shares_kjt_storage(host: Any, device: Any) -> bool:
    """True when a ``KeyedJaggedTensor`` of ``device`` (a batch's device copy)
    still uses the storage of one of ``host``'s (the batch as the loader gave it).

    That is the case when the batch was already on the device (any batch on
    CPU, a loader that yields device tensors): the "copy" is the loader's own
    tensors, which ``free_features_storage_early`` must not free.
    """
    owned = {kjt.values().untyped_storage().data_ptr() for kjt in kjts_in(host)}
    return any(kjt.values().untyped_storage().data_ptr() in owned for kjt in kjts_in(device))


def note_shared_features(pipeline: Any, host: Any, batch: Any, context: Any) -> None:
    """Mark a batch whose "copy" kept the loader's storage (it was on the device
    already), which ``free_features_storage_early`` must not free; called only
    with that option on."""
    if shares_kjt_storage(host, batch):
        context.features_shared_with_loader = True
        warn_shared_features(pipeline)


def warn_shared_features(pipeline: Any) -> None:
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


def copy_to_device(
    batch: Any,
    device: torch.device,
    stream: Optional[torch.Stream],
    inplace: bool = False,
    blocking: bool = False,
) -> Any:
    """Host-to-device copy of ``batch`` issued on ``stream``.

    With ``inplace`` the batch allocates its device memory on the current stream
    and copies on ``stream`` itself (``data_copy_stream``), so the consumer
    needs no ``record_stream``.  ``blocking`` waits for the copy to finish.
    """
    check_batch(batch)
    if blocking:
        return batch.to(device=device, non_blocking=False)
    if inplace and stream is not None:
        return batch.to(device=device, non_blocking=True, data_copy_stream=stream)
    with on_stream(stream):
        return batch.to(device=device, non_blocking=True)


def wait_for_batch(batch: Any, producer: Optional[torch.Stream], record: bool = True) -> None:
    """Make the current stream wait for ``batch``, produced on ``producer``."""
    if producer is None or batch is None:
        return
    if record:
        if not isinstance(batch, (torch.Tensor, Multistreamable)):
            raise TypeError(
                f"{type(batch).__name__} must implement Multistreamable.record_stream "
                "to cross streams"
            )
        hand_off(batch, producer)
    else:
        hand_off(None, producer)
