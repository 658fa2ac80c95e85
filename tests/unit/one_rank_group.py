"""Run by test_one_rank_group.py in a fresh process: a gloo world of one rank.

Trains the distributed tier's DLRM, sharded table-wise over that single rank,
with a plain loop, torchrec's TrainPipelineSparseDist and each of our variants
named on the command line, and prints one JSON line per run: whether it
matched its oracle bit for bit (the plain loop; torchrec's SemiSync for
SemiSync), and the kinds of splits awaitables it waited on.
"""

from __future__ import annotations

import json
import sys
import tempfile
from typing import Any, Dict, List

import torch
import torch.distributed as dist

CPU = torch.device("cpu")


def main(names: List[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            _run(names)
        finally:
            dist.destroy_process_group()


def _matches(ref: Any, run: Any) -> bool:
    from trec_pipelines.testing.dlrm import assert_runs_equal

    try:
        assert_runs_equal(ref, run)
    except AssertionError:
        return False
    return True


def _run(names: List[str]) -> None:
    import torchrec.distributed.train_pipeline as upstream

    import trec_pipelines
    import trec_pipelines.sparse.input_dist as input_dist
    from trec_pipelines.testing.dlrm import (
        DLRM,
        make_batches,
        make_sharded,
        plain_loop,
        run_pipeline,
    )

    batches = make_batches(seed=7)
    ref = plain_loop(*make_sharded(DLRM, "table_wise", seed=1234), batches)
    from torchrec.distributed.train_pipeline.train_pipelines import (
        TrainPipelineSemiSync as UpstreamSemiSync,
    )

    from trec_pipelines.testing.torchrec_cpu import torchrec_on_cpu

    theirs = run_pipeline(
        upstream.TrainPipelineSparseDist(*make_sharded(DLRM, "table_wise", seed=1234), CPU), batches
    )
    print(json.dumps({"run": "torchrec", "matches": _matches(ref, theirs)}), flush=True)
    # SemiSync trains differently from the plain loop by design: its oracle is
    # torchrec's class (under the CPU stream shim, as in the distributed tier).
    with torchrec_on_cpu():
        semi_ref = run_pipeline(
            UpstreamSemiSync(*make_sharded(DLRM, "table_wise", seed=1234), CPU, start_batch=0),
            batches,
        )

    issued: List[str] = []
    real_fuse = input_dist._fuse_splits

    def spy(context: Any, agreement: Any = None) -> None:
        real_fuse(context, agreement)
        issued.extend(type(awaitable).__name__ for _, awaitable in context.fused_splits_awaitables)

    input_dist._fuse_splits = spy  # type: ignore[assignment]
    for name in names:
        issued.clear()
        dmp, optimizer = make_sharded(DLRM, "table_wise", seed=1234)
        kwargs: Dict[str, Any] = {"start_batch": 0} if name == "TrainPipelineSemiSync" else {}
        pipeline = getattr(trec_pipelines, name)(dmp, optimizer, CPU, **kwargs)
        ours = run_pipeline(pipeline, batches, model=dmp)
        record = {
            "run": name,
            "matches": _matches(semi_ref if name == "TrainPipelineSemiSync" else ref, ours),
            "splits_only_overrides": len(pipeline._pipelined.fusion.overrides),
            "awaited": sorted(set(issued)),
            "steps": len(ours),
            # SemiSync's dense all-reduce: deferred past the embedding backward
            # (AllReduceWait) only where there are other ranks to wait for.
            "all_reduce": type(getattr(pipeline, "_all_reduce", None)).__name__,
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
