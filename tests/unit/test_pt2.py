"""TrainPipelinePT2 against the plain loop, compiled with inductor on CPU."""

from __future__ import annotations

from typing import Any, List, Tuple

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from tests.unit.fakes import FEATURES, drain, make_batches
from trec_pipelines.pipelines.pt2 import TorchCompileConfig, TrainPipelinePT2

# Inductor fuses the dense ops and reorders float32 reductions (bias-gradient
# sums, the BCE reduction), so compiled steps may differ from eager ones by a
# few ULPs, which six SGD steps at lr=0.1 amplify to ~1e-8 at most (measured:
# 0 on outputs, 7e-9 on weights).  1e-6 absolute leaves ~100x headroom while a
# real fault (a batch skipped, trained twice or out of order) moves the
# values by more than 1e-3.
ATOL, RTOL = 1e-6, 0.0


class Unsharded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=20, feature_names=[f])
                for i, f in enumerate(FEATURES)
            ]
        )
        self.dense = nn.Linear(3, 4)
        self.over = nn.Linear(4 * (len(FEATURES) + 1), 1)

    def forward(self, batch: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        embedded = self.ebc(batch.sparse).values()
        logits = self.over(torch.cat([embedded, self.dense(batch.dense)], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
        return loss, logits.detach()


def _plain(batches: List[Any]) -> Tuple[nn.Module, List[torch.Tensor]]:
    model = Unsharded()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs = []
    for batch in batches:
        optimizer.zero_grad()
        loss, pred = model(batch)
        torch.sum(loss).backward()
        optimizer.step()
        outputs.append(pred)
    return model, outputs


def test_pt2_matches_plain_loop_and_restores_dynamo_config() -> None:
    torch._dynamo.reset()
    skip_before = torch._dynamo.config.skip_torchrec
    batches = make_batches(6)
    ref_model, ref_outputs = _plain(batches)
    model = Unsharded()
    compiled: List[nn.Module] = []
    pipeline = TrainPipelinePT2(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.device("cpu"),
        compile_configs=TorchCompileConfig(compile_on_iter=2),
        post_compile_fn=compiled.append,
    )
    outputs = drain(pipeline, iter(batches))
    assert compiled == [model]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    assert len(outputs) == len(ref_outputs)
    for step, (ours, ref) in enumerate(zip(outputs, ref_outputs)):
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL, msg=f"step {step}")
    for (name, ours), (_, ref) in zip(model.state_dict().items(), ref_model.state_dict().items()):
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL, msg=name)
    assert torch._dynamo.config.skip_torchrec == skip_before


def test_pt2_eager_before_compile_is_exact_and_stops_cleanly() -> None:
    batches = make_batches(3)
    ref_model, ref_outputs = _plain(batches)
    model = Unsharded()
    pipeline = TrainPipelinePT2(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.device("cpu"),
        compile_configs=TorchCompileConfig(compile_on_iter=100),
    )
    outputs = drain(pipeline, iter(batches))
    assert all(torch.equal(a, b) for a, b in zip(outputs, ref_outputs)) and len(outputs) == 3
    with pytest.raises(StopIteration):
        pipeline.progress(iter([]))
