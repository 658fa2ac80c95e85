"""StagedTrainPipeline with SparseDataDistUtil: the pipeline prepares each batch
(copy, input dist, prefetch) while your own loop trains the one before.

From the repository's root (the model and data are the quickstart's):

    torchrun --standalone --nproc_per_node=2 -m docs.examples.staged
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torchrec.datasets.random import RandomRecDataset

from docs.examples.quickstart import FEATURES, build_model
from trec_pipelines import PipelineStage, SparseDataDistUtil, StagedTrainPipeline


@dataclass
class Streams:
    """Where each stage runs; ``None``: on the current stream (CPU).

    Attributes:
        copy: the host-to-device copy.
        data_dist: the input dist (the ids' all-to-alls).
        prefetch: the cache prefetch (with ``prefetch=True``).
    """

    copy: Optional[torch.Stream]
    data_dist: Optional[torch.Stream]
    prefetch: Optional[torch.Stream]


def make_streams(device: torch.device) -> Streams:
    if device.type == "cuda":
        # A side stream per stage: each overlaps the training
        # step, which runs on the current stream.
        return Streams(
            copy=torch.cuda.Stream(device),
            data_dist=torch.cuda.Stream(device),
            prefetch=torch.cuda.Stream(device),
        )
    return Streams(copy=None, data_dist=None, prefetch=None)


def build_pipeline(
    model: torch.nn.Module,  # a DistributedModelParallel
    device: torch.device,
    streams: Streams,
    prefetch: bool = False,
    on_flush_end: Optional[Callable[[], None]] = None,
) -> Tuple[StagedTrainPipeline[Any, Any], SparseDataDistUtil[Any]]:
    sdd: SparseDataDistUtil[Any] = SparseDataDistUtil(
        model,
        data_dist_stream=streams.data_dist,
        prefetch_stream=streams.prefetch if prefetch else None,
    )
    stages = [
        PipelineStage(
            "copy",
            lambda batch: batch.to(device, non_blocking=True),
            streams.copy,
        ),
        sdd.start_sparse_data_dist_stage(),  # after the copy
    ]
    if prefetch:  # a third batch in flight: its rows into the caches
        stages.append(
            PipelineStage(
                "prefetch",
                sdd.prefetch,
                streams.prefetch,
            ),
        )
    pipeline = StagedTrainPipeline(
        stages,
        on_flush_end=on_flush_end,
    )
    return pipeline, sdd


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
) -> Any:
    optimizer.zero_grad()
    loss, output = model(batch)  # reads the stage's input dist
    torch.sum(loss, dim=0).backward()
    optimizer.step()
    return output


def train_epoch(
    pipeline: StagedTrainPipeline[Any, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Any],
    flush_after: Optional[int] = None,
) -> List[Any]:
    outputs = []
    it = iter(batches)
    # None: the data has run out and every batch has come out.
    while (batch := pipeline.progress(it)) is not None:
        outputs.append(train_step(model, optimizer, batch))
        if len(outputs) == flush_after:
            # Load nothing more: the batches in flight (one per
            # stage) still come out; then on_flush_end runs and
            # loading resumes, all within progress().
            pipeline.set_flush(True)
    return outputs


def evaluate(
    sdd: SparseDataDistUtil[Any],
    model: torch.nn.Module,
    batches: Iterable[Any],
    device: torch.device,
) -> List[Any]:
    # The model's own forwards back; the batches in flight are
    # kept, and the next progress() pipelines the model again.
    sdd.detach()
    model.eval()
    outputs = []
    with torch.no_grad():
        for batch in batches:
            _loss, output = model(batch.to(device))
            outputs.append(output)
    model.train()
    return outputs


def main() -> None:
    dist.init_process_group("gloo")
    device = torch.device("cpu")
    model, optimizer = build_model(device)
    data = RandomRecDataset(
        keys=FEATURES,
        batch_size=64,
        hash_size=1000,
        ids_per_feature=3,
        num_dense=8,
        manual_seed=dist.get_rank(),
        num_batches=20,
    )
    pipeline, sdd = build_pipeline(model, device, make_streams(device), prefetch=True)
    outputs = train_epoch(pipeline, model, optimizer, data)
    evaluated = evaluate(sdd, model, list(data)[:2], device)
    mine = f"trained {len(outputs)} batches, evaluated {len(evaluated)}"
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, mine)
    if dist.get_rank() == 0:
        assert sdd.rewrite_result is not None
        print(sdd.rewrite_result.report())
        for rank, line in enumerate(every_rank):
            print(f"rank {rank}: {line}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
