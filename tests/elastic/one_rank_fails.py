"""A step raises on one rank only; what the other ranks do about it.

Run under torchrun (any number of ranks).  Rank 0's model raises in its
forward at batch ``--fail-at``; then, by ``--then``:

* ``stay``: rank 0 catches the error and stays alive (a long save, say) without
  retrying: the other ranks are in that step's collectives and must end
  within seconds, naming rank 0 and the batch (status 1), not at the
  process group's timeout;
* ``retry``: rank 0 alone retries: it must raise ``OutOfStepError`` (the others,
  waiting in the failed step, end as above).

With ``--first-step-copy`` rank 0's first step fails instead in its
host-to-device copy, before any collective, and the other ranks begin their
first step only once that failure is published (the pipelines agree on nothing
at a step's start: ``sync_exhaustion=False``), so their watchers start after
it: the step they then enter cannot complete either.

An eval pipeline (``--pipeline EvalPipelineSparseDist``, ``+thread`` loading
on its loader thread, or ``EvalPipelineFusedSparseDist``) runs the model in
eval mode and fails the same way, in its forward.

Every rank writes what happened to ``--out``/rank<r>.json; the model's
process group times out after 120 s, far beyond what the test allows.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import trec_pipelines
from tests.fault_injection import Fault
from trec_pipelines.pipelines.sparse_data_dist_util import SparseDataDistUtil
from trec_pipelines.pipelines.staged import PipelineStage
from trec_pipelines.testing.dlrm import DLRM, Batch, make_batches, make_sharded

_COPY_FAILED = "one_rank_fails/copy_failed"


def _staged(dmp: Any) -> Any:
    """h2d and input_dist stages; the caller's loop trains (see _staged_step)."""
    sdd = SparseDataDistUtil(dmp, data_dist_stream=None)
    return trec_pipelines.StagedTrainPipeline(
        [
            PipelineStage("h2d", lambda batch: batch, None),
            sdd.start_sparse_data_dist_stage(runnable=sdd.start_sparse_data_dist),
        ]
    )


def _staged_step(pipeline: Any, model: Any, optimizer: Any, it: Any) -> None:
    """One progress() and the caller's own training of its batch."""
    batch = pipeline.progress(it)
    if batch is None:
        raise StopIteration
    optimizer.zero_grad()
    loss, _ = model(batch)
    torch.sum(loss, dim=0).backward()
    optimizer.step()


class _CopyFails(Batch):
    """A batch whose copy to the device raises :class:`Fault`."""

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        raise Fault("injected on rank 0 in the copy of batch 0")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pipeline", default="TrainPipelineSparseDist")
    parser.add_argument("--fail-at", type=int, default=2)
    parser.add_argument("--then", choices=["stay", "retry"], default="stay")
    parser.add_argument("--first-step-copy", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=1)
    calls = {"n": 0}

    def fail_once(*_: object) -> None:
        calls["n"] += 1
        if rank == 0 and calls["n"] == args.fail_at + 1:
            raise Fault(f"injected on rank 0 at forward {calls['n'] - 1}")

    dmp.module.over_arch.register_forward_pre_hook(fail_once)
    if args.pipeline == "StagedTrainPipeline":
        pipeline: Any = _staged(dmp)
        step = functools.partial(_staged_step, pipeline, dmp, optimizer)
    else:
        options: dict = {"sync_exhaustion": False} if args.first_step_copy else {}
        name, _, mode = args.pipeline.partition("+")
        if mode == "thread":
            options["loader_thread"] = True
        if name.startswith("Eval"):
            dmp.eval()
        pipeline = getattr(trec_pipelines, name)(dmp, optimizer, torch.device("cpu"), **options)
        step = pipeline.progress
    batches = make_batches(8, seed=3)
    store = dist.distributed_c10d._get_default_store()
    if args.first_step_copy and rank == 0:
        first = batches[0]
        assert isinstance(first, Batch)
        batches[0] = _CopyFails(first.dense, first.sparse, first.labels)
    elif args.first_step_copy:
        store.wait([_COPY_FAILED], timedelta(seconds=60))  # rank 0's failure is published
    it = iter(batches)
    record: dict = {"rank": rank, "steps": 0, "error": None}
    started = time.monotonic()
    try:
        while True:
            step(it)
            record["steps"] += 1
    except StopIteration:
        pass
    except Exception as error:  # noqa: BLE001  what a user's loop would catch
        record["error"] = f"{type(error).__name__}: {error}"
        record["notes"] = "".join(getattr(error, "__notes__", []))
        if args.first_step_copy and rank == 0:
            store.set(_COPY_FAILED, "1")
        if rank == 0 and args.then == "retry":
            try:
                pipeline.progress(it)
                record["retry"] = "trained"
            except Exception as again:  # noqa: BLE001
                record["retry"] = f"{type(again).__name__}: {again}"
    record["seconds"] = time.monotonic() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        time.sleep(60)  # alive, and in no step: the others must not wait for it


if __name__ == "__main__":
    main()
