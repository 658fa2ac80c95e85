"""torchrec's 2D-sharding sync tests for TrainPipelineSparseDist, adapted (no process group).

Upstream's ``TrainPipelineSparseDist2DShardingTest`` patches the pipeline's
verbs away and calls one ``progress()``.  Here the pipeline runs for real: the
model handed to it is a ``MagicMock`` that ``isinstance``-checks as
``DMPCollection`` (or as a plain ``DistributedModelParallel``), whose ``module``
is a real small model and whose call runs that model's forward.  Each
``sync()`` is recorded with the index of the batch whose forward came last, so
the tests see on which batches the replicas were synced.

The rule (``TrainPipeline.sync_embeddings`` in torchrec 1.8.0 and 1.9.2): a
training step on batch ``i`` syncs after the backward, before the optimizer
step, when the model is a ``DMPCollection``, the interval ``n`` is not None and
``i % n == 0``.  Batch indices count from 0 and restart at ``reset()``.

Ours runs the fake sharded model of :mod:`tests.unit.fakes`, so its input_dist
is really pipelined; torchrec's pipeline cannot drive that fake (its fused
splits all-to-all needs a real one), so the torchrec reference runs a dense
model with the same data.  Which batches sync depends only on the indices.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple, Type, Union
from unittest.mock import MagicMock

import pytest
import torch
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel, DMPCollection
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist as UpstreamSparseDist

from tests.unit.fakes import Batch, TinyModel, drain, make_batches, optimizer_for
from trec_pipelines import TrainPipelineSparseDist

CPU = torch.device("cpu")
N_BATCHES = 7

Event = Union[str, Tuple[str, int]]


class DenseModel(nn.Module):
    """No sharded module: what torchrec's pipeline can run on CPU without one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(3, 1)

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        logits = self.linear(batch.dense).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(
            logits, batch.labels, reduction="none"
        )
        return loss, logits.detach()


class Wrapped:
    """A mock DMP(Collection) around a real model that logs forwards and syncs."""

    def __init__(self, spec: type, inner: nn.Module) -> None:
        self.inner = inner
        self.events: List[Event] = []
        self.model = MagicMock(spec=spec)
        self.model.module = inner
        self.model.training = True
        self.model.side_effect = self._forward
        self.model.parameters.side_effect = inner.parameters
        if spec is DMPCollection:
            self.model.sync.side_effect = self._sync

    def _forward(self, batch: Any) -> Any:
        self.events.append("forward")
        return self.inner(batch)

    def _sync(self, *args: Any, **kwargs: Any) -> None:
        self.events.append(("sync", self.forwards - 1))

    @property
    def forwards(self) -> int:
        return self.events.count("forward")

    @property
    def synced(self) -> List[int]:
        return [e[1] for e in self.events if isinstance(e, tuple)]


def expected_syncs(indices: range, interval: Optional[int]) -> List[int]:
    return [] if interval is None else [i for i in indices if i % interval == 0]


def train(
    pipeline_cls: Type[Any], inner: nn.Module, interval: Optional[int], spec: type = DMPCollection
) -> Tuple[Wrapped, Any, int]:
    wrapped = Wrapped(spec, inner)
    pipeline = pipeline_cls(
        wrapped.model,
        optimizer_for(inner),
        CPU,
        dmp_collection_sync_interval_batches=interval,
    )
    steps = len(drain(pipeline, iter(make_batches(N_BATCHES))))
    return wrapped, pipeline, steps


INTERVALS = [1, 3, 10, None]


@pytest.mark.parametrize("interval", INTERVALS)
def test_torchrec_syncs_on_multiples_of_the_interval(interval: Optional[int]) -> None:
    # The reference: pins down the rule the test below holds ours to.
    wrapped, _, steps = train(UpstreamSparseDist, DenseModel(), interval)
    assert steps == N_BATCHES
    assert wrapped.synced == expected_syncs(range(N_BATCHES), interval)


@pytest.mark.parametrize("interval", INTERVALS)
def test_dmp_collection_syncs_on_the_same_batches_as_torchrec(interval: Optional[int]) -> None:
    ref, _, ref_steps = train(UpstreamSparseDist, DenseModel(), interval)
    ours, pipeline, steps = train(TrainPipelineSparseDist, TinyModel(), interval)
    assert steps == ref_steps == N_BATCHES
    assert ours.synced == ref.synced == expected_syncs(range(N_BATCHES), interval)
    # One forward per step, each sync right after its batch's forward (and backward).
    assert ours.events == ref.events
    # The input_dist really was pipelined: the fake sharded module was found and wrapped.
    assert pipeline.rewrite_result is not None and pipeline.rewrite_result.modules


def test_sync_comes_after_backward_and_before_the_optimizer_step() -> None:
    inner = TinyModel()
    wrapped = Wrapped(DMPCollection, inner)
    optimizer = optimizer_for(inner)
    seen: List[str] = []
    steps_taken: List[int] = []

    def sync(*args: Any, **kwargs: Any) -> None:
        # Backward has run (zero_grad set the grads to None) and the step has not.
        seen.append("grad" if inner.over.weight.grad is not None else "no grad")
        seen.append("stepped" if steps_taken else "not stepped")

    wrapped.model.sync.side_effect = sync
    optimizer.register_step_post_hook(lambda *_: steps_taken.append(1))
    pipeline = TrainPipelineSparseDist(wrapped.model, optimizer, CPU)
    pipeline.progress(iter(make_batches(1)))
    assert seen == ["grad", "not stepped"]
    assert steps_taken == [1]


def test_eval_steps_do_not_sync() -> None:
    wrapped = Wrapped(DMPCollection, TinyModel())
    wrapped.model.training = False
    pipeline = TrainPipelineSparseDist(
        wrapped.model, optimizer_for(wrapped.inner), CPU, dmp_collection_sync_interval_batches=1
    )
    assert len(drain(pipeline, iter(make_batches(3)))) == 3
    wrapped.model.sync.assert_not_called()


BOTH = pytest.mark.parametrize(
    "pipeline_cls", [TrainPipelineSparseDist, UpstreamSparseDist], ids=["ours", "torchrec"]
)


@BOTH
def test_plain_dmp_with_an_interval_trains_and_syncs_nothing(pipeline_cls: Type[Any]) -> None:
    # A DistributedModelParallel has no sync(): the spec'd mock raises on any use of it.
    inner = TinyModel() if pipeline_cls is TrainPipelineSparseDist else DenseModel()
    wrapped, _, steps = train(pipeline_cls, inner, 1, spec=DistributedModelParallel)
    assert steps == N_BATCHES
    assert wrapped.forwards == N_BATCHES
    assert not hasattr(wrapped.model, "sync")


@BOTH
def test_reset_restarts_the_batch_count(pipeline_cls: Type[Any]) -> None:
    # Second epoch after reset(): batch indices (and so the syncs) start from 0 again.
    inner = TinyModel() if pipeline_cls is TrainPipelineSparseDist else DenseModel()
    wrapped = Wrapped(DMPCollection, inner)
    pipeline = pipeline_cls(
        wrapped.model, optimizer_for(inner), CPU, dmp_collection_sync_interval_batches=3
    )
    assert len(drain(pipeline, iter(make_batches(4)))) == 4
    pipeline.reset()
    assert len(drain(pipeline, iter(make_batches(4, seed=2)))) == 4
    assert wrapped.synced == [0, 3, 4 + 0, 4 + 3]
