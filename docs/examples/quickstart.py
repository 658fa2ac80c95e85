"""A small DLRM trained by TrainPipelineSparseDist on two CPU ranks, over gloo.

Run it with: torchrun --standalone --nproc_per_node=2 docs/examples/quickstart.py
"""

from __future__ import annotations

from typing import Any, Iterable, List

import torch
import torch.distributed as dist
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from trec_pipelines import TrainPipelineSparseDist

FEATURES = ["user", "item", "category"]


def train_one_epoch(
    model: torch.nn.Module,  # a DistributedModelParallel
    optimizer: torch.optim.Optimizer,
    dataloader: Iterable[Any],
    device: torch.device,
) -> List[Any]:
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    outputs = []
    it = iter(dataloader)
    while True:
        try:
            # The step's backward and optimizer step are done; what comes back is
            # the second of the model's (loss, output).
            outputs.append(pipeline.progress(it))
        except StopIteration:
            break
    if dist.get_rank() == 0:
        print(pipeline.rewrite_result.report())  # what was pipelined, and why not
    return outputs


def build_model(device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A DLRM with one table per feature, sharded by torchrec over every rank."""
    tables = [
        EmbeddingBagConfig(
            name=f"t_{name}", feature_names=[name], num_embeddings=1000, embedding_dim=16
        )
        for name in FEATURES
    ]
    torch.manual_seed(0)  # the same dense weights on every rank
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables, device=torch.device("meta")),
            dense_in_features=8,
            dense_arch_layer_sizes=[32, 16],
            over_arch_layer_sizes=[32, 1],
        )
    )
    # The tables are updated inside the backward (torchrec's fused optimizer) ...
    apply_optimizer_in_backward(torch.optim.SGD, model.model.sparse_arch.parameters(), {"lr": 0.1})
    dmp = DistributedModelParallel(model, device=device)
    # ... and the dense part by an ordinary optimizer.
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def main() -> None:
    dist.init_process_group("gloo")  # torchrun sets the rank and the world size
    device = torch.device("cpu")
    model, optimizer = build_model(device)
    batches = RandomRecDataset(  # a torchrec Batch: dense_features, sparse_features, labels
        keys=FEATURES,
        batch_size=64,
        hash_size=1000,
        ids_per_feature=3,
        num_dense=8,
        manual_seed=dist.get_rank(),  # each rank its own data
        num_batches=20,
    )
    outputs = train_one_epoch(model, optimizer, batches, device)
    losses = [loss.item() for loss, _logits, _labels in outputs]
    mine = f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, mine)
    if dist.get_rank() == 0:  # one process prints: the lines stay whole and in order
        for rank, line in enumerate(every_rank):
            print(f"rank {rank}: {line}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
