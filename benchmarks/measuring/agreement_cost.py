"""What the ranks' agreement on each pulled batch costs a SparseDist step.

Run under torchrun on 2 ranks (``make bench-agreement``).  The test DLRM
(trec_pipelines/testing/dlrm.py), table-wise, trains the same batches four ways, in
paired rounds (each round runs all four back to back, in a rotating order):

* ``none``: no agreement (``sync_exhaustion=False``);
* ``all-reduce``: each pull's code all-reduced on a gloo group of its own,
  started a pull ahead (what Base, PT2 and Staged do);
* ``carried`` (SparseDist's default): each pull's code carried by the step's
  own splits all-to-all;
* ``blocking`` (``agree_ahead=False``): each pull agreed as it is made, with a
  blocking all-reduce, and no host batch pulled ahead for it.

It prints the median step time of each and the median over rounds of the
difference to ``none``, per batch size.  See [Note: agreeing on each batch].
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

import trec_pipelines
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import DLRM, make_batches, make_sharded

DEVICE = devices.device()
SETTINGS = ("none", "all-reduce", "carried", "blocking")


def _epoch(setting: str, batches: List[Any]) -> float:
    """Seconds per step of one epoch over ``batches`` (after one warm-up step)."""
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=0)
    pipeline = trec_pipelines.TrainPipelineSparseDist(
        dmp, optimizer, DEVICE, sync_exhaustion=setting != "none", agree_ahead=setting != "blocking"
    )
    if setting == "all-reduce":
        assert pipeline._agreement is not None
        pipeline._agreement.no_carrier()
    it = iter(batches)
    pipeline.progress(it)
    dist.barrier()
    start, steps = time.perf_counter(), 0
    while True:
        try:
            pipeline.progress(it)
        except StopIteration:
            break
        steps += 1
    dist.barrier()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 4096])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    devices.bind()
    dist.init_process_group(devices.backend())
    torch.set_num_threads(1)
    for batch_size in args.batch_sizes:
        batches = make_batches(args.steps + 1, seed=3, batch_size=batch_size)
        times: Dict[str, List[float]] = {s: [] for s in SETTINGS}
        for round_index in range(args.rounds):
            turn = round_index % len(SETTINGS)
            order = SETTINGS[turn:] + SETTINGS[:turn]
            for setting in order:
                times[setting].append(_epoch(setting, batches))
        if dist.get_rank() == 0:
            base = statistics.median(times["none"]) * 1e3
            print(f"batch {batch_size}/rank, {args.steps} steps, {args.rounds} paired rounds:")
            for setting in SETTINGS:
                step = statistics.median(times[setting]) * 1e3
                extra = statistics.median(
                    (t - n) * 1e3 for t, n in zip(times[setting], times["none"], strict=True)
                )
                print(
                    f"  {setting:8s} {step:7.3f} ms/step  {extra:+.3f} ms vs none ({extra / base:+.1%})"
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
