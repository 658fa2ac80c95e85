"""TrainPipelinePT2 against the plain loop, compiled with inductor on CPU."""

from __future__ import annotations

import logging
from typing import Any, List, Tuple

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from tests.fault_injection import FailingBackward, Fault
from tests.unit.fakes import FEATURES, drain, make_batches
from tests.unit.test_step_guard import FaultyOptimizer, plain_loop_with_retry, train_with_retry
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
                EmbeddingBagConfig(
                    name=f"t{i}", embedding_dim=4, num_embeddings=20, feature_names=[f]
                )
                for i, f in enumerate(FEATURES)
            ]
        )
        self.dense = nn.Linear(3, 4)
        self.over = nn.Linear(4 * (len(FEATURES) + 1), 1)

    def forward(self, batch: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        embedded = self.ebc(batch.sparse).values()
        logits = self.over(torch.cat([embedded, self.dense(batch.dense)], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(
            logits, batch.labels, reduction="none"
        )
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
    for step, (ours, ref) in enumerate(zip(outputs, ref_outputs, strict=True)):
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL, msg=f"step {step}")
    for (name, ours), (_, ref) in zip(
        model.state_dict().items(), ref_model.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL, msg=name)
    assert torch._dynamo.config.skip_torchrec == skip_before


def test_pt2_eager_before_compile_is_exact_and_stops_cleanly(caplog: Any) -> None:
    batches = make_batches(3)
    ref_model, ref_outputs = _plain(batches)
    model = Unsharded()
    pipeline = TrainPipelinePT2(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.device("cpu"),
        compile_configs=TorchCompileConfig(compile_on_iter=100),
    )
    with caplog.at_level(logging.INFO, logger="trec_pipelines.pipelines.pt2"):
        outputs = drain(pipeline, iter(batches))
    # The eager start is said once, at the first step (a run this short never compiles).
    assert [r.getMessage() for r in caplog.records if r.name == "trec_pipelines.pipelines.pt2"] == [
        "TrainPipelinePT2: the first 100 batches run eagerly; the model compiles at batch 100 "
        "(compile_configs.compile_on_iter=100), and that batch takes the compile's time; "
        "TorchCompileConfig(compile_on_iter=0) compiles at the first"
    ]
    assert (
        all(torch.equal(a, b) for a, b in zip(outputs, ref_outputs, strict=True))
        and len(outputs) == 3
    )
    with pytest.raises(StopIteration):
        pipeline.progress(iter([]))


class FaultyUnsharded(Unsharded):
    """Unsharded that raises at forward call ``at`` (every attempt counts): before
    the lookup, after it (in the head), or in the backward."""

    def __init__(self, where: str, at: int) -> None:
        super().__init__()
        self.where, self.at, self.calls = where, at, 0

    def forward(self, batch: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        call, self.calls = self.calls, self.calls + 1
        fail = call == self.at
        if fail and self.where == "before_lookup":
            raise Fault("injected before the lookup")
        embedded = self.ebc(batch.sparse).values()
        if fail and self.where == "after_lookup":
            raise Fault("injected after the lookup")
        logits = self.over(torch.cat([embedded, self.dense(batch.dense)], dim=1)).squeeze(1)
        if fail and self.where == "backward":
            logits = FailingBackward.apply(logits)
        loss = nn.functional.binary_cross_entropy_with_logits(
            logits, batch.labels, reduction="none"
        )
        return loss, logits.detach()


@pytest.mark.parametrize("where", ["before_lookup", "after_lookup", "backward", "optimizer"])
def test_a_compiled_step_that_raises_is_retried_like_the_plain_loop(where: str) -> None:
    """Issue #16 with the compiled model: step 3 (compiled from step 2) raises once;
    the next progress() retries its batch, as the plain loop with retry does."""
    torch._dynamo.reset()
    batches = make_batches(6)
    at = 3 if where != "optimizer" else -1
    step_at = 3 if where == "optimizer" else -1
    ref = FaultyUnsharded(where, at)
    ref_outputs = plain_loop_with_retry(ref, FaultyOptimizer(ref.parameters(), step_at), batches)
    model = FaultyUnsharded(where, at)
    pipeline = TrainPipelinePT2(
        model,
        FaultyOptimizer(model.parameters(), step_at),
        torch.device("cpu"),
        compile_configs=TorchCompileConfig(compile_on_iter=2),
    )
    outputs, failures = train_with_retry(pipeline, iter(batches))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    assert failures == 1
    assert len(outputs) == len(ref_outputs) == len(batches)
    for step, (ours, expected) in enumerate(zip(outputs, ref_outputs, strict=True)):
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=RTOL, msg=f"step {step}")
    for (name, ours), (_, expected) in zip(
        model.state_dict().items(), ref.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=RTOL, msg=name)
