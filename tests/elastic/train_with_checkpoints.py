"""A training job that checkpoints every few steps and resumes from the last checkpoint.

Run under ``torchrun --max-restarts`` by tests/unit/test_killed_rank.py: with
``--die-at S --die-rank R``, rank ``R`` of the first attempt dies (``os._exit``)
right before step ``S``; torchrun restarts every rank, which finds the last
checkpoint (model, optimizer, pipeline, data loader, all through
``torch.distributed.checkpoint``) and trains to the end.  Each rank writes its
final weights and the indices of the batches its attempts trained.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
from datetime import timedelta
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchdata.stateful_dataloader import StatefulDataLoader

import trec_pipelines
from trec_pipelines.elastic import attempt_store
from trec_pipelines.testing.dlrm import DLRM, make_batches, make_sharded, weights

CPU = torch.device("cpu")


class Batches(torch.utils.data.Dataset):
    """This rank's batches, one per item."""

    def __init__(self, batches: List[Any]) -> None:
        self._batches = batches

    def __len__(self) -> int:
        return len(self._batches)

    def __getitem__(self, index: int) -> Any:
        return self._batches[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="directory for checkpoints and results")
    parser.add_argument("--variant", default="TrainPipelineSparseDist")
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--every", type=int, default=3, help="checkpoint after every N steps")
    parser.add_argument("--die-at", type=int, default=-1, help="step the first attempt dies before")
    parser.add_argument("--die-rank", type=int, default=1)
    args = parser.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group(
        "gloo",
        store=attempt_store(timedelta(minutes=2)),
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=2),  # a test: fail rather than wait 30 minutes
    )
    torch.set_num_threads(1)
    me = f"rank_{rank}"

    dmp, optimizer = make_sharded(
        DLRM, "table_wise", seed=1234 + attempt
    )  # a restart starts elsewhere
    pipeline = getattr(trec_pipelines, args.variant)(dmp, optimizer, CPU)
    loader = StatefulDataLoader(Batches(make_batches(args.batches, seed=5)), batch_size=None)
    latest = os.path.join(args.out, "latest")
    step = 0
    if os.path.exists(latest):
        with open(latest) as f:
            step = int(f.read())
        path = os.path.join(args.out, f"step_{step}")
        model_state, optimizer_state = dmp.state_dict(), optimizer.state_dict()
        dcp.load({"model": model_state}, checkpoint_id=path)
        dcp.load({"optimizer": optimizer_state}, checkpoint_id=path)
        dmp.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        # The loader's state as one bytes value per rank, as torchtitan stores it:
        # its nested fields would need the same structure in place to load into.
        loader_state: Dict[str, Any] = {me: b""}
        dcp.load({"pipeline": pipeline, "loader": loader_state}, checkpoint_id=path)
        loader.load_state_dict(pickle.loads(loader_state[me]))

    resumed_from = step
    trained: List[int] = []
    it = iter(loader)
    # Bounded by the step count, not by StopIteration: an attempt that torchrun
    # restarts after the last checkpoint (a rank aborting at exit, seen under load)
    # must train nothing, and the loader restored from an end-of-epoch state
    # would start the next epoch.
    while step < args.batches:
        if attempt == 0 and step == args.die_at and rank == args.die_rank:
            # What the test reads to know the death was the planned one: torchrun
            # names only the first failure it saw, which may be the other rank's.
            with open(os.path.join(args.out, f"died_{me}_at_step_{step}"), "w"):
                pass
            os._exit(17)
        pipeline.progress(it)
        trained.append(step)
        step += 1
        if step % args.every == 0:
            path = os.path.join(args.out, f"step_{step}")
            dcp.save(
                {
                    "pipeline": pipeline,  # first: PEC applies a deferred gradient here
                    "model": dmp.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "loader": {me: pickle.dumps(loader.state_dict())},
                },
                checkpoint_id=path,
            )
            dist.barrier()
            if rank == 0:
                with open(latest + ".tmp", "w") as f:
                    f.write(str(step))
                os.replace(latest + ".tmp", latest)
            dist.barrier()

    torch.save(weights(dmp), os.path.join(args.out, f"weights_{me}.pt"))
    with open(os.path.join(args.out, f"steps_{me}_attempt_{attempt}.json"), "w") as f:
        json.dump({"resumed_from": resumed_from, "trained_steps": trained}, f)
    dist.destroy_process_group()
    # The model and DDP hold torch's default group: drop them, so its gloo threads
    # are joined here rather than in the interpreter's teardown (see "the program
    # exits" in the what-happens-when guide).
    del pipeline, dmp, optimizer, loader
    gc.collect()


if __name__ == "__main__":
    main()
