"""torchrec's TrainPipelineBase and TrainPipelinePT2 tests, adapted (no process group needed).

From upstream's ``TrainPipelineBaseTest`` and ``TrainPipelinePT2Test``
(GPU-only there, a CPU model as the reference): the same small model, data and
SGD, with the pipeline on CPU too, so Base must match the plain loop bit for
bit and PT2 within the compile tolerance of ``tests/unit/test_pt2.py``.
torchrec 1.8.0's classes run on CPU and are checked the same way.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, List, Tuple

import pytest
import torch
import torchrec.distributed.train_pipeline.train_pipelines as upstream
from torch import nn
from torch._dynamo.testing import reduce_to_scalar_loss
from torchrec.distributed.test_utils.test_model import ModelInput
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.pt2.utils import kjt_for_pt2_tracing
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

import trec_pipelines

CPU = torch.device("cpu")
# As tests/unit/test_pt2.py: inductor reorders float32 reductions (a few ULPs per step).
ATOL, RTOL = 1e-6, 0.0


@dataclass
class SimpleInput(Pipelineable):
    float_features: torch.Tensor
    label: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "SimpleInput":
        return SimpleInput(
            self.float_features.to(device, non_blocking=non_blocking),
            self.label.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.float_features.record_stream(stream)
        self.label.record_stream(stream)


class LinearModule(nn.Module):
    """One linear layer and a BCE loss, returning ``(loss, pred)``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(10, 1)
        self.loss_fn = nn.BCEWithLogitsLoss()
        self._dummy_setting = "dummy"

    def forward(self, batch: SimpleInput) -> Tuple[torch.Tensor, torch.Tensor]:
        pred = self.model(batch.float_features)
        return self.loss_fn(pred, batch.label), pred


def simple_data(n: int = 5) -> List[SimpleInput]:
    g = torch.Generator().manual_seed(0)
    return [
        SimpleInput(torch.rand((10,), generator=g), torch.randint(2, (1,), generator=g).float())
        for _ in range(n)
    ]


def plain(model: nn.Module, data: List[Any], step: bool = True) -> List[torch.Tensor]:
    optimizer = torch.optim.SGD(model.model.parameters(), lr=0.01)
    preds = []
    for batch in data:
        optimizer.zero_grad()
        loss, pred = model(batch)
        reduce_to_scalar_loss(loss).backward()
        if step:
            optimizer.step()
        preds.append(pred.detach().clone())
    return preds


def pipelined(cls: Any, model: nn.Module, data: List[Any], **kwargs: Any) -> List[torch.Tensor]:
    pipeline = cls(model, torch.optim.SGD(model.model.parameters(), lr=0.01), CPU, **kwargs)
    it = iter(data)
    preds = [pipeline.progress(it).detach().clone() for _ in data]
    with pytest.raises(StopIteration):
        pipeline.progress(it)
    return preds


def fresh(factory: Callable[[], nn.Module]) -> Tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(1)
    model = factory()
    return model, copy.deepcopy(model), copy.deepcopy(model)


def test_base_equal_to_non_pipelined() -> None:
    data = simple_data()
    ref_model, their_model, our_model = fresh(LinearModule)
    ref = plain(ref_model, data)
    theirs = pipelined(upstream.TrainPipelineBase, their_model, data)
    ours = pipelined(trec_pipelines.TrainPipelineBase, our_model, data)
    for step, (r, t, o) in enumerate(zip(ref, theirs, ours, strict=True)):
        assert torch.equal(r, t), f"step {step}: torchrec != plain loop"
        assert torch.equal(r, o), f"step {step}: ours != plain loop"
    assert torch.equal(ref_model.model.weight, our_model.model.weight)


@pytest.mark.parametrize(
    "cls", [upstream.TrainPipelinePT2, trec_pipelines.TrainPipelinePT2], ids=["torchrec", "ours"]
)
def test_pt2_equal_to_non_pipelined_and_pre_compile_fn(cls: Any) -> None:
    """Upstream's two PT2 tests in one run (one compile): predictions as the
    plain loop's, and ``pre_compile_fn`` sees the model before it is compiled."""
    data = simple_data()
    ref_model, _, model = fresh(LinearModule)
    ref = plain(ref_model, data)
    seen: List[str] = []

    def pre_compile_fn(m: nn.Module) -> None:
        seen.append(m._dummy_setting)
        m._dummy_setting = "dummy modified"

    torch._dynamo.reset()
    preds = pipelined(cls, model, data, pre_compile_fn=pre_compile_fn)
    assert seen == ["dummy"] and model._dummy_setting == "dummy modified"
    for step, (r, p) in enumerate(zip(ref, preds, strict=True)):
        torch.testing.assert_close(
            p, r, atol=ATOL, rtol=RTOL, msg=lambda m, step=step: f"step {step}: {m}"
        )


class TwoTables(nn.Module):
    """Upstream's PT2 input-transformer model: an EBC whose pooled outputs come
    back as a list; the first is used as the loss, the second as predictions."""

    def __init__(self, tables: List[EmbeddingBagConfig]) -> None:
        super().__init__()
        self.model = EmbeddingBagCollection(tables=tables, device=CPU)

    def forward(self, kjt: KeyedJaggedTensor) -> List[torch.Tensor]:
        return list(self.model(kjt).to_dict().values())


@pytest.mark.parametrize(
    "cls", [upstream.TrainPipelinePT2, trec_pipelines.TrainPipelinePT2], ids=["torchrec", "ours"]
)
def test_pt2_equal_to_non_pipelined_with_input_transformer(cls: Any) -> None:
    tables = [
        EmbeddingBagConfig(
            num_embeddings=256, embedding_dim=12, name=f"{p}table_{i}", feature_names=[f"{p}f{i}"]
        )
        for p in ("",)
        for i in range(2)
    ]
    weighted = [
        EmbeddingBagConfig(
            num_embeddings=256,
            embedding_dim=12,
            name=f"weighted_table_{i}",
            feature_names=[f"weighted_f{i}"],
        )
        for i in range(2)
    ]
    torch.manual_seed(2)
    _, inputs = ModelInput.generate(
        batch_size=10,
        world_size=4,
        num_float_features=8,
        tables=tables,
        weighted_tables=weighted,
        variable_batch_size=False,
    )
    data = [i.idlist_features for i in inputs if isinstance(i.idlist_features, KeyedJaggedTensor)]
    ref_model, _, model = fresh(lambda: TwoTables(tables))
    # As upstream, the reference does not step: the predictions (second table)
    # get no gradient from the loss (first table), so they stay comparable.
    ref = plain(ref_model, data, step=False)
    torch._dynamo.reset()
    preds = pipelined(cls, model, data, input_transformer=kjt_for_pt2_tracing)
    for step, (r, p) in enumerate(zip(ref, preds, strict=True)):
        torch.testing.assert_close(
            p, r, atol=ATOL, rtol=RTOL, msg=lambda m, step=step: f"step {step}: {m}"
        )
