"""Soak: 5,000 steps of SparseDist and SemiSync on a small model, RSS sampled.

Run with ``make soak`` (2 gloo ranks).  Passes when, after warm-up, resident
memory grows by less than 1% and no pipeline ever holds more batches than
its documented depth.  Not part of CI: it takes a few minutes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Any, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import trec_pipelines as tp  # noqa: E402
from tests.distributed.dlrm import DLRM, make_batches, make_sharded  # noqa: E402

DEPTH = {"TrainPipelineSparseDist": 3, "TrainPipelineSemiSync": 4}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def soak(name: str, steps: int, warmup: int, sample_every: int) -> Dict[str, Any]:
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=0)
    kwargs = {"start_batch": 10} if name == "TrainPipelineSemiSync" else {}
    pipeline = getattr(tp, name)(dmp, optimizer, torch.device("cpu"), **kwargs)
    # A fixed pool of batches, cycled, so the data itself adds no memory.
    batches = make_batches(64, seed=3)
    it = iter(itertools.islice(itertools.cycle(batches), steps))
    max_in_flight = 0
    enqueue = pipeline.enqueue_batch

    def counting_enqueue(dataloader_iter: Any) -> bool:
        nonlocal max_in_flight
        loaded = enqueue(dataloader_iter)
        max_in_flight = max(max_in_flight, len(pipeline.batches))
        return loaded

    pipeline.enqueue_batch = counting_enqueue  # type: ignore[method-assign]
    samples: List[int] = []
    done = 0
    while True:
        try:
            pipeline.progress(it)
        except StopIteration:
            break
        done += 1
        if done % sample_every == 0:
            samples.append(rss_bytes())
    after_warmup = samples[warmup // sample_every - 1]
    growth = (samples[-1] - after_warmup) / after_warmup
    return {
        "pipeline": name,
        "steps": done,
        "rss_after_warmup_mib": after_warmup / 2**20,
        "rss_end_mib": samples[-1] / 2**20,
        "rss_peak_mib": max(samples[warmup // sample_every - 1 :]) / 2**20,
        "growth_after_warmup": growth,
        "max_in_flight": max_in_flight,
        "documented_depth": DEPTH[name],
        "ok": done == steps and growth < 0.01 and max_in_flight <= DEPTH[name],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--sample-every", type=int, default=100)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    results = [soak(name, args.steps, args.warmup, args.sample_every) for name in DEPTH]
    if dist.get_rank() == 0:
        print(json.dumps(results, indent=2))
    dist.destroy_process_group()
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
