"""The stage probe: one step of the plain loop cut into its stages, each timed on its own.

Its stage times (H2D, input dist, forward + backward + optimizer) feed the
schedule bound (:mod:`benchmarks.measuring.schedule_bound`); the pieces of the
training stage (lookup, output all-to-all, forward, backward, optimizer step,
embedding update) feed the dependency bound
(:mod:`benchmarks.measuring.dependency_bound`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Set

import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedTensor

from benchmarks.contenders.build import DEVICE, Contender
from benchmarks.contenders.variants import TRAIN
from benchmarks.settings import netns
from trec_pipelines.core.all_reduce_wait import AllReduceWait, all_reduce_wait
from trec_pipelines.testing.dlrm import Batch


@dataclass
class StageTimes:
    """One rank's epoch of the stage probe: each stage summed over the steps, stages timed alone.

    Wall seconds of the three stages; the CPU seconds this process spent in
    each (every thread: the training thread, gloo's workers, and the kernel's
    loopback copies charged to it); the CPU seconds of the training thread
    alone in the input dist (work no other thread can take off it); and,
    over an emulated link, the bytes the link carried in the input dist and
    in fwd+bwd+opt (both ranks' traffic: one counter for the namespace).

    The training stage's pieces, wall seconds on the training thread:
    ``lookup`` (the sharded embedding module's compute), ``out_a2a`` (its
    output dist, issued and waited), ``forward`` (the model's forward, those
    two included), ``backward``, ``opt`` (zero_grad and step), which add up to
    ``compute``; and ``emb_update``, the lookup's backward with its fused
    optimizer run again on its own (same batch, same gradients) after the
    step, as it can't be timed inside autograd's backward.  None in results
    from before the probe measured them, and ``emb_update`` None when the
    lookup's output had no gradient to replay.

    The backward's own pieces, from a second forward and backward of the same
    batch run apart after the step (:class:`_DenseReplay`), as SemiSync runs
    them: ``dense_bwd``, the backward with the lookup's output detached and
    DDP's all-reduce not waited; ``allreduce``, from its first bucket's issue
    to its last bucket's end, waited alone; ``allreduce_from``, the fraction of
    the dense backward run when its first bucket was issued (a fraction
    summed over the steps, not seconds); ``grad_from``, likewise the fraction
    run when the embeddings' gradient reached the lookup's output (from there
    the gradient all-to-all could start); ``emb_backward``, the lookup's
    backward (the gradient all-to-all and the fused update) after it.  None
    where the model has no ``DistributedDataParallel`` the probe can hook.
    """

    h2d: float = 0.0
    input_dist: float = 0.0
    compute: float = 0.0  # forward + backward + optimizer, input dist excluded
    cpu_h2d: float = 0.0
    cpu_input_dist: float = 0.0
    cpu_compute: float = 0.0
    thread_input_dist: float = 0.0
    link_bytes_input_dist: Optional[float] = None
    link_bytes_compute: Optional[float] = None
    lookup: Optional[float] = None
    out_a2a: Optional[float] = None
    forward: Optional[float] = None
    backward: Optional[float] = None
    opt: Optional[float] = None
    emb_update: Optional[float] = None
    dense_bwd: Optional[float] = None
    allreduce: Optional[float] = None
    allreduce_from: Optional[float] = None
    grad_from: Optional[float] = None
    emb_backward: Optional[float] = None

    def add(self, key: str, seconds: Optional[float]) -> None:
        """Add ``seconds`` to the piece ``key``; one step without it (None) leaves it None."""
        if seconds is None or key in self._unmeasured:
            self._unmeasured.add(key)
            setattr(self, key, None)
        else:
            setattr(self, key, (getattr(self, key) or 0.0) + seconds)

    def __post_init__(self) -> None:
        self._unmeasured: Set[str] = set()

    def as_dict(self) -> Dict[str, float]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def combine_stage_times(ranks: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """One epoch's stage record from every rank's :meth:`StageTimes.as_dict`.

    Wall and training-thread times take the slowest rank (a stage ends when
    its last rank does); process CPU seconds add up over ranks, as the ranks
    share the machine's cores; link bytes take the largest reading (every rank
    reads the same namespace counter).
    """
    if not ranks or not ranks[0]:
        return {}
    out: Dict[str, float] = {}
    for key in ranks[0]:
        values = [r[key] for r in ranks if key in r]
        out[key] = sum(values) if key.startswith("cpu_") else max(values)
    return out


class StageProbe(Contender):
    """Times TrainPipelineSparseDist's three stages separately, with no overlap.

    Per batch: the host-to-device copy; the sparse input dist (splits and
    tensors all-to-alls, waited to completion); then zero_grad, forward,
    backward and step with the embedding module handed the already
    distributed input, so that stage excludes the input dist.  A barrier
    before and after each stage keeps one rank's lag out of the next stage's
    time and lets the link counter be read when a stage's traffic is done
    (the bytes of one barrier, read across the copy, which sends nothing, are
    subtracted).  The training stage is timed in pieces as well (:class:`StageTimes`).
    What the times bound is :mod:`benchmarks.measuring.schedule_bound` and
    :mod:`benchmarks.measuring.dependency_bound`.
    """

    def __init__(self) -> None:
        super().__init__("probe:stages", "stages", "probe", TRAIN)
        self.last = StageTimes()
        self._replay: Optional[_DenseReplay] = None

    def _build(self) -> None:
        self._replay = _DenseReplay.on(self.model)

    def _run_epoch(self, batches: Sequence[Batch]) -> int:
        model, optimizer, pg = self.model, self.optimizer, self.pg
        assert model is not None and optimizer is not None
        ebc = model.module.ebc
        link = netns.loopback_tx_bytes if netns.qdisc_in_effect() is not None else None
        times = StageTimes()
        link_input = link_compute = 0.0
        for host_batch in batches:
            dist.barrier(group=pg)
            b0 = link() if link else 0
            t0, c0 = time.perf_counter(), time.process_time()
            batch = host_batch.to(DEVICE, non_blocking=True)
            t1, c1 = time.perf_counter(), time.process_time()
            dist.barrier(group=pg)
            b1 = link() if link else 0
            t2, c2, h2 = time.perf_counter(), time.process_time(), time.thread_time()
            ctx = ebc.create_context()
            dist_input = ebc.input_dist(ctx, batch.sparse).wait().wait()
            t3, c3, h3 = time.perf_counter(), time.process_time(), time.thread_time()
            dist.barrier(group=pg)
            b2 = link() if link else 0
            t4, c4 = time.perf_counter(), time.process_time()
            split = _SplitForward(ebc, ctx, dist_input)
            ebc.forward = split
            try:
                optimizer.zero_grad()
                f0 = _now()
                losses, _ = model(batch)
                f1 = _now()
                torch.sum(losses, dim=0).backward()
                f2 = _now()
                optimizer.step()
            finally:
                del ebc.forward  # back to the class's forward
            t5, c5 = _now(), time.process_time()
            if link:
                dist.barrier(group=pg)
                barrier = b1 - b0  # the copy sends nothing: this is one barrier's traffic
                link_input += max(b2 - b1 - barrier, 0)
                link_compute += max(link() - b2 - barrier, 0)
            times.h2d += t1 - t0
            times.input_dist += t3 - t2
            times.compute += t5 - t4
            times.cpu_h2d += c1 - c0
            times.cpu_input_dist += c3 - c2
            times.cpu_compute += c5 - c4
            times.thread_input_dist += h3 - h2
            for key, seconds in (
                ("lookup", split.lookup),
                ("out_a2a", split.out_a2a),
                ("forward", f1 - f0),
                ("backward", f2 - f1),
                ("opt", (f0 - t4) + (t5 - f2)),
                ("emb_update", split.emb_update()),  # after the step's timed pieces
            ):
                times.add(key, seconds)
            pieces = self._replay_dense(batch, ctx, dist_input)
            for key in _DenseReplay.KEYS:
                times.add(key, None if pieces is None else pieces[key])
        if link:
            times.link_bytes_input_dist, times.link_bytes_compute = link_input, link_compute
        self.last = times
        return len(batches)

    def _replay_dense(self, batch: Batch, ctx: Any, dist_input: Any) -> Optional[Dict[str, float]]:
        """The step's backward again, in pieces (:class:`_DenseReplay`); its gradients dropped."""
        replay, model, optimizer = self._replay, self.model, self.optimizer
        if replay is None or model is None or optimizer is None:
            return None
        ebc = model.module.ebc
        split = _SplitForward(ebc, ctx, dist_input, detach=True)
        ebc.forward = split
        try:
            optimizer.zero_grad()
            losses, _ = model(batch)
        finally:
            del ebc.forward
        pieces = replay.backward(torch.sum(losses, dim=0), split)
        optimizer.zero_grad()
        return pieces


def _now() -> float:
    """``time.perf_counter()`` once the device's queued work is done (on a GPU, kernels run
    after their launch returns: a piece's time is its work's, not its launches')."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return time.perf_counter()


class _SplitForward:
    """A forward for the sharded embedding module that skips the input dist (its result is
    already here) and times the two halves of the rest: the lookup (``compute``) and the
    output dist (issued and waited).

    For the bench's module (no memory stashing, no trackers) this is the work of its own
    ``compute_and_output_dist``, done in two calls of the module's public methods.  It keeps
    the gradients that reach the lookup's output, so that the lookup's backward (the
    embedding update, fused with the optimizer) can be timed again on its own.
    """

    def __init__(self, ebc: nn.Module, ctx: Any, dist_input: Any, detach: bool = False) -> None:
        self.ebc, self.ctx, self.dist_input = ebc, ctx, dist_input
        self.lookup = self.out_a2a = 0.0
        self.outputs = 0
        self.grads: Dict[int, torch.Tensor] = {}
        # detach: the output dist's values, and the leaf the dense part reads in their place.
        self.detach = detach
        self.sent: Optional[torch.Tensor] = None
        self.leaf: Optional[torch.Tensor] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = _now()
        embs = self.ebc.compute(self.ctx, self.dist_input)
        t1 = _now()
        out = self.ebc.output_dist(self.ctx, embs).wait()
        self.lookup, self.out_a2a = t1 - t0, _now() - t1
        if self.detach:
            self.sent = out.values()
            self.leaf = self.sent.detach().requires_grad_()
            return KeyedTensor(out.keys(), out.length_per_key(), self.leaf)
        self.outputs = len(embs)
        for k, emb in enumerate(embs):
            if emb.requires_grad:
                emb.register_hook(partial(self._keep, k))
        return out

    def _keep(self, k: int, grad: torch.Tensor) -> None:
        self.grads[k] = grad

    def emb_update(self) -> Optional[float]:
        """Seconds of the lookup's backward alone: a second lookup of the same input (not
        timed), then its backward with the step's gradients, which runs the fused optimizer
        again (the probe's tables drift by one more update; nothing reads them but the probe).
        None when the step's backward left no gradient at the lookup's output.
        """
        if not self.outputs or len(self.grads) != self.outputs:
            return None
        embs: List[torch.Tensor] = list(self.ebc.compute(self.ctx, self.dist_input))
        start = _now()
        torch.autograd.backward(embs, [self.grads[k] for k in range(len(embs))])
        return _now() - start


class _DenseReplay:
    """Times the backward's pieces apart: the dense backward, DDP's all-reduce, the lookup's backward.

    SemiSync's all-reduce hook on the model's ``DistributedDataParallel``
    (:mod:`trec_pipelines.core.all_reduce_wait`): inside :meth:`backward` DDP
    is told each bucket is done at once, so the backward returns without
    waiting, and the all-reduce is then waited on its own; outside, DDP waits
    as usual, with its own arithmetic.
    """

    KEYS = ("dense_bwd", "allreduce", "allreduce_from", "grad_from", "emb_backward")

    def __init__(self, hook: AllReduceWait) -> None:
        self._hook = hook

    @classmethod
    def on(cls, model: Optional[nn.Module]) -> Optional[_DenseReplay]:
        """The replay for ``model``'s DDP, or None where the hook can't go on it."""
        if model is None:
            return None
        hook = all_reduce_wait(model, StageProbe)
        return cls(hook) if isinstance(hook, AllReduceWait) else None

    def backward(self, loss: torch.Tensor, split: _SplitForward) -> Optional[Dict[str, float]]:
        """Seconds of each piece of ``loss``'s backward (``allreduce_from`` a fraction), or
        None when the dense part left no gradient at the detached lookup output."""
        hook = self._hook
        hook.first_issued = None
        leaf, sent = split.leaf, split.sent
        grad_ready: List[float] = []
        if leaf is not None:
            # A leaf's hook runs when autograd hands it its gradient: as soon as the
            # interaction's backward made it (autograd runs leaves' accumulation first).
            leaf.register_hook(lambda grad: grad_ready.append(time.perf_counter()))
        with hook.deferring():
            start = _now()
            loss.backward()
            dense_end = _now()
        first = hook.first_issued
        hook.wait()
        reduced = _now()
        if leaf is None or sent is None or leaf.grad is None or first is None or not grad_ready:
            return None
        torch.autograd.backward([sent], [leaf.grad])
        emb_end = _now()
        dense = dense_end - start
        return {
            "dense_bwd": dense,
            "allreduce": reduced - first,
            "allreduce_from": (first - start) / dense if dense > 0 else 1.0,
            "grad_from": (grad_ready[0] - start) / dense if dense > 0 else 1.0,
            "emb_backward": emb_end - reduced,
        }
