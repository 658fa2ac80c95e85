"""One short 2-rank run that must end with exit code 0: train or evaluate 8 batches, then exit.

Run under torchrun, one process per rank::

    torchrun --standalone --nproc_per_node=2 tests/soak/exit_check.py --pipeline SparseDist

``--pipeline plain`` runs the same model and batches in a plain loop, without
the package's pipelines, to tell torch's own exit from ours.  ``--keep-pg``
leaves the default process group to the interpreter's exit instead of
destroying it at the end, as many user scripts do; ``--release-model`` drops
the model and collects it after that (the default group's threads are then
joined before the exit); ``--sync-exhaustion`` gives the pipeline its agreement
group.  ``--show-threads`` prints the threads still alive when the last exit
hook runs, the C++ ones (gloo's) included.

:mod:`tests.soak.exit_soak` runs this many times and counts the exit codes.
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import gc
import os
import sys
import threading
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _show_threads() -> None:
    """The Python threads, and every thread of the process by its OS name (C++ ones included)."""
    names = [f"{t.name}(daemon={t.daemon})" for t in threading.enumerate()]
    native: Dict[str, int] = {}
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            comm = f.read().strip()
        native[comm] = native.get(comm, 0) + 1
    rank = dist.get_rank() if dist.is_initialized() else "?"
    print(f"rank {rank} at exit: python {names}; native {native}", flush=True)


if "--show-threads" in sys.argv:
    # Registered before the package is imported, so it runs after the package's
    # own exit hook (atexit runs its hooks last registered first).
    atexit.register(_show_threads)


import trec_pipelines as tp  # noqa: E402
from trec_pipelines.pipelines.sparse_data_dist_util import SparseDataDistUtil  # noqa: E402
from trec_pipelines.pipelines.staged import PipelineStage, StagedTrainPipeline  # noqa: E402
from trec_pipelines.testing import devices  # noqa: E402
from trec_pipelines.testing.dlrm import DLRM, make_batches, make_sharded  # noqa: E402

BATCHES = 8


def _drive(pipeline: Any, batches: List[Any]) -> int:
    """Call ``progress`` until the data ends; the number of steps."""
    it = iter(batches)
    steps = 0
    while True:
        try:
            pipeline.progress(it)
        except StopIteration:
            return steps
        steps += 1


def _plain(dmp: Any, optimizer: Any, batches: List[Any], extra: Dict[str, Any]) -> int:
    assert not extra, "the plain loop takes no pipeline options"
    for batch in batches:
        optimizer.zero_grad()
        loss, _ = dmp(batch)
        torch.sum(loss, dim=0).backward()
        optimizer.step()
    return len(batches)


def _staged(dmp: Any, optimizer: Any, batches: List[Any], extra: Dict[str, Any]) -> int:
    assert not extra, "SparseDataDistUtil takes no pipeline options here"
    sdd = SparseDataDistUtil(dmp, data_dist_stream=None)
    device = devices.device()
    stages = [
        PipelineStage("h2d", lambda batch: batch.to(device, non_blocking=True), None),
        sdd.start_sparse_data_dist_stage(),
    ]
    pipeline = StagedTrainPipeline(stages)
    it = iter(batches)
    steps = 0
    while (batch := pipeline.progress(it)) is not None:
        optimizer.zero_grad()
        loss, _ = dmp(batch)
        torch.sum(loss, dim=0).backward()
        optimizer.step()
        steps += 1
    return steps


Run = Callable[[Any, Any, List[Any], Dict[str, Any]], int]


def _train(cls: Callable[..., Any], **options: Any) -> Run:
    def run(dmp: Any, optimizer: Any, batches: List[Any], extra: Dict[str, Any]) -> int:
        return _drive(cls(dmp, optimizer, devices.device(), **options, **extra), batches)

    return run


def _eval(cls: Callable[..., Any], **options: Any) -> Run:
    def run(dmp: Any, optimizer: Any, batches: List[Any], extra: Dict[str, Any]) -> int:
        dmp.eval()
        return _drive(cls(dmp, optimizer, devices.device(), **options, **extra), batches)

    return run


RUNS: Dict[str, Run] = {
    "plain": _plain,
    "SparseDist": _train(tp.TrainPipelineSparseDist),
    "Fused": _train(tp.TrainPipelineFusedSparseDist),
    "SemiSync": _train(tp.TrainPipelineSemiSync, start_batch=2),
    "Staged": _staged,
    "Eval": _eval(tp.EvalPipelineSparseDist),
    "EvalThread": _eval(tp.EvalPipelineSparseDist, loader_thread=True),
    "EvalFused": _eval(tp.EvalPipelineFusedSparseDist),
}


# ``--pipeline all``: these, one after the other, each on a model of its own.
ALL = ["SparseDist", "Fused", "SemiSync", "Staged", "Eval", "EvalFused"]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", choices=sorted(RUNS) + ["all"], required=True)
    parser.add_argument("--keep-pg", action="store_true", help="do not destroy the default group")
    parser.add_argument(
        "--sync-exhaustion",
        action="store_true",
        help="build the pipeline with sync_exhaustion=True (its own agreement group)",
    )
    parser.add_argument(
        "--release-model",
        action="store_true",
        help="after destroying the group, drop the model and collect it (the exit workaround)",
    )
    parser.add_argument(
        "--show-threads", action="store_true", help="list the threads alive at the last exit hook"
    )
    args = parser.parse_args(argv)
    faulthandler.enable()
    torch.set_num_threads(1)
    devices.bind()
    dist.init_process_group(backend=devices.backend())
    extra = {"sync_exhaustion": True} if args.sync_exhaustion else {}
    for name in ALL if args.pipeline == "all" else [args.pipeline]:
        dmp, optimizer = make_sharded(DLRM, "table_wise", seed=0)
        steps = RUNS[name](dmp, optimizer, make_batches(BATCHES, seed=1), dict(extra))
        assert steps == BATCHES, (name, steps)
    if not args.keep_pg:
        dist.destroy_process_group()
    if args.release_model:
        # The model's sharded modules and DDP hold the default group: once they
        # are gone, its gloo threads are joined here rather than in the
        # interpreter's teardown.
        del dmp, optimizer
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
