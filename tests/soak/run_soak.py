"""Soak: 5,000 steps of SparseDist and SemiSync on a small model, RSS and the ledger sampled.

Run with ``make soak`` (2 gloo ranks).  Passes when, after warm-up:

* resident memory grows by less than 1%;
* what the pipeline holds is flat: measured after every step
  (:func:`trec_pipelines.observe.memory.footprint`), the largest bytes and storage
  count of the last ``--window`` steps equal those of the first window after
  warm-up (the batches cycle through a fixed pool much shorter than a window,
  so both windows see every combination of in-flight batches);
* no pipeline ever holds more batches than its documented depth, counted by
  ``enqueue_batch`` and by the per-action memory ledger of a recorded stretch
  at the end, whose peak and steady state are reported.

Not part of CI: it takes a few minutes.
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
from trec_pipelines.observe.memory import footprint, owned_storages  # noqa: E402
from trec_pipelines.testing.dlrm import DLRM, make_batches, make_sharded  # noqa: E402

DEPTH = {"TrainPipelineSparseDist": 3, "TrainPipelineSemiSync": 4}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def soak(
    name: str, steps: int, warmup: int, sample_every: int, window: int, recorded: int
) -> Dict[str, Any]:
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
    skip = owned_storages(dmp, optimizer)
    samples: List[int] = []
    held: List[int] = []  # bytes the pipeline holds after each step
    storages: List[int] = []
    ledger: Any = None
    done = 0
    while True:
        if done == steps - recorded:
            # The last steps with the per-action ledger on (its samples grow with the run).
            pipeline.enable_schedule_recording(memory=True)
        try:
            pipeline.progress(it)
        except StopIteration:
            break
        done += 1
        measured = footprint(pipeline, skip)
        held.append(measured.total)
        storages.append(measured.storages)
        if done % sample_every == 0:
            samples.append(rss_bytes())
    if pipeline.memory_samples:
        ledger = pipeline.memory_ledger()
        pipeline.disable_schedule_recording()
    after_warmup = samples[warmup // sample_every - 1]
    growth = (samples[-1] - after_warmup) / after_warmup
    # Both windows end before the drain (the last steps hold fewer batches).
    end = len(held) - DEPTH[name]
    first, last = slice(warmup, warmup + window), slice(end - window, end)
    held_flat = max(held[first]) == max(held[last]) and max(storages[first]) == max(storages[last])
    return {
        "pipeline": name,
        "steps": done,
        "rss_after_warmup_mib": after_warmup / 2**20,
        "rss_end_mib": samples[-1] / 2**20,
        "rss_peak_mib": max(samples[warmup // sample_every - 1 :]) / 2**20,
        "growth_after_warmup": growth,
        "max_in_flight": max_in_flight,
        "documented_depth": DEPTH[name],
        "held_first_window_peak_mib": max(held[first]) / 2**20,
        "held_last_window_peak_mib": max(held[last]) / 2**20,
        "held_storages_first_last": [max(storages[first]), max(storages[last])],
        "held_flat": held_flat,
        "ledger_peak_mib": None if ledger is None else ledger.peak_bytes / 2**20,
        "ledger_steady_mib": None if ledger is None else ledger.steady_bytes / 2**20,
        "ledger_peak_at": None if ledger is None else ledger.peak_at,
        "ledger_max_batches": None if ledger is None else ledger.max_batches,
        "ok": done == steps
        and growth < 0.01
        and max_in_flight <= DEPTH[name]
        and held_flat
        and ledger is not None
        and ledger.max_batches <= DEPTH[name],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument(
        "--window", type=int, default=500, help="steps compared at both ends for a flat ledger"
    )
    parser.add_argument(
        "--recorded", type=int, default=20, help="last steps run with the per-action ledger on"
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    results = [
        soak(name, args.steps, args.warmup, args.sample_every, args.window, args.recorded)
        for name in DEPTH
    ]
    if dist.get_rank() == 0:
        print(json.dumps(results, indent=2))
    dist.destroy_process_group()
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
