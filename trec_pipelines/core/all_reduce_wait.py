"""DDP's gradient all-reduce, waited where the gradients are read rather than at the end of the backward.

[Note: the all-reduce waited before the step]
``DistributedDataParallel`` all-reduces each bucket of dense gradients as the
backward fills it, and waits for every bucket at the end of the backward:
``loss.backward()`` returns once the last all-reduce is done.  SemiSync runs
more work after its dense backward, the embedding backward (the gradient
all-to-all and the fused table update), which needs nothing from the
all-reduce; with DDP's wait it starts only once the all-reduce is over.

:class:`AllReduceWait` registers a communication hook on the model's DDP.
Outside :meth:`AllReduceWait.deferring` the hook is DDP's own arithmetic with
DDP's wait: the bucket divided by the group's size, summed over the group,
returned as a future DDP waits for.  Inside it, the hook issues the same
all-reduce on the same bucket and tells DDP the bucket is done; the backward
returns without waiting, and the pipeline calls :meth:`AllReduceWait.wait`
before anything reads a dense gradient (a stash, a scaler, the optimizer
step).  DDP's buckets are the gradients (``gradient_as_bucket_view=True``,
as torchrec's ``DistributedModelParallel`` builds it), so the in-place
all-reduce leaves the averaged gradients where the optimizer reads them, bit
for bit the values DDP's own wait gives.

It is installed on a ``DistributedDataParallel`` (the model, or the one a
``DistributedModelParallel`` wraps) with ``gradient_as_bucket_view=True``,
DDP's C++ reducer, no communication hook or mixed precision of its own, and
a power-of-two number of ranks above one (where DDP's two ways of averaging, a
product with ``1/size`` and a division by ``size``, give the same bits; one
rank has no all-reduce worth waiting later for), and only
where the pipeline's class does not override a hook that runs between the
backward and the wait (SemiSync's ``embedding_backward``).
Anywhere else :func:`all_reduce_wait` returns a stand-in that defers nothing,
and DDP waits as usual.  One hook serves every pipeline built on the model
(DDP takes one).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator, List, Optional, Union

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.nn.parallel import DistributedDataParallel

from trec_pipelines.core.subclass_hooks import overrides_outside

logger: logging.Logger = logging.getLogger(__name__)

# The hook a DDP already carries, so a second pipeline on the model reuses it.
_ATTRIBUTE = "_trec_pipelines_all_reduce_wait"


def _data_parallel_root(model: torch.nn.Module) -> Optional[DistributedDataParallel]:
    wrapped = getattr(model, "_dmp_wrapped_module", model)
    return wrapped if isinstance(wrapped, DistributedDataParallel) else None


def _why_not(ddp: DistributedDataParallel) -> Optional[str]:
    if not getattr(ddp, "gradient_as_bucket_view", False):
        return "its gradients are not views of its buckets (gradient_as_bucket_view=False)"
    if getattr(ddp, "_comm_hooks", None):
        return "it has a communication hook of its own"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "it runs its own mixed precision"
    if getattr(ddp, "_use_python_reducer", False):
        return "it runs the Python reducer"
    size = dist.get_world_size(ddp.process_group)
    if size == 1:
        return "its group has one rank: its all-reduce waits for no one"
    if size & (size - 1):
        # DDP scales a gradient it copies into a bucket by 1/size and one
        # already in its bucket by a division: the same value only when size
        # is a power of two (both are then exact), and the hook cannot tell
        # which DDP would have done.
        return f"its group has {size} ranks, not a power of two"
    return None


class AllReduceWait:
    """DDP's all-reduce, issued by the backward and, inside :meth:`deferring`, waited by :meth:`wait`."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self._group: Any = ddp.process_group
        self._size = dist.get_world_size(self._group)
        self._works: List[Any] = []
        self._deferring = False
        # When the first bucket of the last deferred backward was issued
        # (time.perf_counter()); the benchmarks' stage probe reads it.
        self.first_issued: Optional[float] = None
        ddp.register_comm_hook(None, self._all_reduce)

    def _all_reduce(self, _state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        buffer.div_(self._size)
        work = dist.all_reduce(buffer, group=self._group, async_op=True)
        if not self._deferring:
            reduced: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda _: buffer)
            return reduced
        if not self._works:
            self.first_issued = time.perf_counter()
        self._works.append(work)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    # DDP checks a hook's annotations against the objects themselves, which
    # this module's postponed annotations would give as strings.
    _all_reduce.__annotations__ = {
        "bucket": GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """A backward run inside returns without waiting for its all-reduce."""
        # A step that failed after its backward left its all-reduce in
        # flight: it writes the buffers this backward is about to fill.
        self.wait()
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def wait(self) -> None:
        """Wait for every all-reduce the backward left in flight (the dense gradients are then averaged)."""
        works, self._works = self._works, []
        for work in works:
            work.wait()


class NoAllReduceWait:
    """Where DDP keeps its own wait: defers nothing, waits for nothing."""

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        yield

    def wait(self) -> None:
        pass


def _ddps_own_wait(pipeline: type, reason: str) -> NoAllReduceWait:
    logger.info(
        "%s: the dense gradients' all-reduce is waited at the end of the backward "
        "(DDP's own wait): %s",
        pipeline.__name__,
        reason,
    )
    return NoAllReduceWait()


def all_reduce_wait(
    model: torch.nn.Module, pipeline: type, *deferred_past: str
) -> Union[AllReduceWait, NoAllReduceWait]:
    """The hook on ``model``'s DDP (installed at the first call), or a stand-in where DDP's own wait stays.

    ``deferred_past``: the pipeline's hooks that run between the backward and
    the wait; a subclass's own version of one might read the gradients, so
    DDP keeps its wait under it.
    """
    ddp = _data_parallel_root(model)
    if ddp is None or not dist.is_initialized():
        return NoAllReduceWait()
    overridden = [hook for hook in deferred_past if overrides_outside(pipeline, hook)]
    if overridden:
        return _ddps_own_wait(pipeline, f"the subclass's own {', '.join(overridden)} may read them")
    installed = getattr(ddp, _ATTRIBUTE, None)
    if isinstance(installed, AllReduceWait):
        return installed
    reason = _why_not(ddp)
    if reason is not None:
        return _ddps_own_wait(pipeline, reason)
    hook = AllReduceWait(ddp)
    setattr(ddp, _ATTRIBUTE, hook)
    return hook


__all__ = ["AllReduceWait", "NoAllReduceWait", "all_reduce_wait"]
