"""Checkpoint and resume with the batches in flight: one file per rank.

``save`` and ``resume`` are the recipe; ``main`` is a whole job that torchrun
may restart: it checkpoints every few steps and, started again (a rank died,
torchrun restarted them all), resumes from the last checkpoint.  Run it with:

    torchrun --standalone --nproc_per_node=2 --max-restarts=1 -m docs.examples.checkpoint DIRECTORY
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Iterator, List, Tuple

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader
from torchrec.datasets.random import RandomRecDataset

from docs.examples.quickstart import FEATURES, build_model
from trec_pipelines import TrainPipelineSparseDist
from trec_pipelines.elastic import attempt_store


def save(
    directory: str,
    pipeline: TrainPipelineSparseDist[Any, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Any,  # a torchdata StatefulDataLoader
) -> None:
    # Between two progress() calls, on every rank.  The pipeline's state first:
    # TrainPipelinePEC applies a gradient it deferred to the next step there.
    torch.save(
        {
            "pipeline": pipeline.state_dict(),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "loader": loader.state_dict(),
        },
        f"{directory}/rank{dist.get_rank()}.pt",
    )


def resume(
    directory: str,
    model: torch.nn.Module,  # built as before the checkpoint
    optimizer: torch.optim.Optimizer,
    loader: Any,
    device: torch.device,
) -> Tuple[TrainPipelineSparseDist[Any, Any], Iterator[Any]]:
    state = torch.load(f"{directory}/rank{dist.get_rank()}.pt", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    pipeline = TrainPipelineSparseDist(model, optimizer, device)  # or any train variant
    pipeline.load_state_dict(state["pipeline"])
    loader.load_state_dict(state["loader"])
    return pipeline, iter(loader)  # progress() trains the in-flight batches first


class Batches(torch.utils.data.Dataset):
    """This rank's batches, one per item: a loader over it can say where it is."""

    def __init__(self, batches: List[Any]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Any:
        return self.batches[index]


def main() -> None:
    parser = argparse.ArgumentParser(description="checkpoint every few steps; resume if restarted")
    parser.add_argument("directory", help="where the checkpoints go (the same for every rank)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20, help="checkpoint after every N steps")
    args = parser.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torchrun keeps its store across restarts: a store per attempt keeps a restarted
    # rank from reading what a rank of the dead attempt published there.
    dist.init_process_group("gloo", store=attempt_store(), rank=rank, world_size=world)
    device = torch.device("cpu")
    model, optimizer = build_model(device)
    data = RandomRecDataset(
        keys=FEATURES,
        batch_size=64,
        hash_size=1000,
        ids_per_feature=3,
        num_dense=8,
        manual_seed=rank,
        num_batches=args.steps,
    )
    loader = StatefulDataLoader(Batches(list(data)), batch_size=None)

    latest = os.path.join(args.directory, "latest")
    step = 0
    if os.path.exists(latest):  # a restart: the last whole checkpoint
        with open(latest) as f:
            step = int(f.read())
        pipeline, it = resume(f"{args.directory}/step_{step}", model, optimizer, loader, device)
    else:
        pipeline, it = TrainPipelineSparseDist(model, optimizer, device), iter(loader)
    resumed_from = step
    # Counted in steps, not ended by StopIteration: a job restarted after its last
    # checkpoint trains nothing more.
    while step < args.steps:
        pipeline.progress(it)
        step += 1
        if step % args.every == 0 or step == args.steps:
            path = f"{args.directory}/step_{step}"
            os.makedirs(path, exist_ok=True)
            save(path, pipeline, model, optimizer, loader)
            dist.barrier()  # every rank's file is written: the checkpoint is whole
            if rank == 0:
                with open(latest + ".tmp", "w") as f:
                    f.write(str(step))
                os.replace(latest + ".tmp", latest)
    print(f"rank {rank}: resumed from step {resumed_from}, trained to step {step}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
