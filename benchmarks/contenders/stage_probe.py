"""The stage probe: one step of the plain loop cut into its stages, each timed on its own.

Its stage times (input dist, lookup, dense forward and backward, ...) feed the
schedule bound (:mod:`benchmarks.measuring.schedule_bound`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.contenders.build import DEVICE, Contender
from benchmarks.contenders.variants import TRAIN
from benchmarks.settings import netns
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
    subtracted).  What the times bound is :mod:`benchmarks.measuring.schedule_bound`.
    """

    def __init__(self) -> None:
        super().__init__("probe:stages", "stages", "probe", TRAIN)
        self.last = StageTimes()

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
            ebc.forward = _precomputed_forward(ebc, ctx, dist_input)
            try:
                optimizer.zero_grad()
                losses, _ = model(batch)
                torch.sum(losses, dim=0).backward()
                optimizer.step()
            finally:
                del ebc.forward  # back to the class's forward
            t5, c5 = time.perf_counter(), time.process_time()
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
        if link:
            times.link_bytes_input_dist, times.link_bytes_compute = link_input, link_compute
        self.last = times
        return len(batches)


def _precomputed_forward(ebc: nn.Module, ctx: Any, dist_input: Any) -> Callable[..., Any]:
    """A forward for ``ebc`` that skips the input dist: its result is already here."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        return ebc.compute_and_output_dist(ctx, dist_input)

    return forward
