"""A recommender framework's pipeline subclasses that keep torchrec's own ``progress()``.

Frameworks built on torchrec mostly override a hook or two and let the
parent's ``progress()`` run: a SparseDist subclass that takes torchrec's ten
constructor arguments positionally plus one of its own, whose ``_next_batch``
all-reduces "has a batch" at every pull (stopping every rank when one is
out), and whose ``_backward`` divides the loss by the optimizer's gradient
accumulation steps and scales it through the optimizer's loss scaler; and a
Base subclass with that ``_backward``.  (Those that rebuild ``progress()``
from torchrec's verbs, and the padded prediction pipeline, are in
``test_outside_subclasses.py``.)  Each is built on torchrec's class and on
ours, trains the same data on 2 gloo ranks, and per-step outputs and final
weights must be equal bit for bit.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Type

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import TrainPipelineContext

from tests.distributed.test_outside_subclasses import (
    DEVICE,
    PARENTS,
    _counts,
    _my_batches,
    _parent,
    _scaled_model,
)
from trec_pipelines.testing.dlrm import Run, assert_runs_equal, run_pipeline

# The gradient accumulation steps the framework's optimizer reports: a power of two,
# so dividing by it is exact.
ACCUMULATION = 2


def _framework_backward(optimizer: Any, losses: torch.Tensor) -> None:
    """The summed loss, divided by the accumulation steps, through the optimizer's scaler."""
    loss = torch.sum(losses, dim=0)
    steps = getattr(optimizer, "_gradient_accumulation_steps", 1)
    if steps > 1:
        loss = loss / steps
    scaler = getattr(optimizer, "_grad_scaler", None)
    (scaler.scale(loss) if scaler is not None else loss).backward()


def framework_sparse_dist(parent: type) -> type:
    """torchrec's ten arguments positionally plus ``check_all_workers_data_status``;
    ``_next_batch`` all-reduces (average) "has a batch" at every pull when checking,
    and ends the epoch on every rank once any rank is out; the framework's backward."""

    class FrameworkSparseDist(parent):  # type: ignore[misc, valid-type]
        def __init__(
            self,
            model: torch.nn.Module,
            optimizer: torch.optim.Optimizer,
            device: torch.device,
            execute_all_batches: bool = True,
            apply_jit: bool = False,
            context_type: Type[Any] = TrainPipelineContext,
            pipeline_postproc: bool = False,
            custom_model_fwd: Optional[Callable[..., Any]] = None,
            dmp_collection_sync_interval_batches: Optional[int] = 1,
            enqueue_batch_after_forward: bool = False,
            check_all_workers_data_status: bool = False,
        ) -> None:
            super().__init__(
                model,
                optimizer,
                device,
                execute_all_batches,
                apply_jit,
                context_type,
                pipeline_postproc,
                custom_model_fwd,
                dmp_collection_sync_interval_batches,
                enqueue_batch_after_forward,
            )
            self._check_all_workers_data_status = check_all_workers_data_status

        def _next_batch(self, dataloader_iter: Iterator[Any]) -> Optional[Any]:
            if dataloader_iter is not self._dataloader_iter:
                self._dataloader_iter = dataloader_iter
                self._dataloader_exhausted = False
            if self._dataloader_exhausted:
                return None
            batch = next(dataloader_iter, None)
            if self._check_all_workers_data_status:
                has_batch = torch.tensor(0.0 if batch is None else 1.0, device=self._device)
                dist.all_reduce(has_batch, dist.ReduceOp.AVG)
                if has_batch.item() < 1:
                    self._dataloader_exhausted = True
                    batch = None
            elif batch is None:
                self._dataloader_exhausted = True
            return batch

        def _backward(self, losses: torch.Tensor) -> None:
            _framework_backward(self._optimizer, losses)

    return FrameworkSparseDist


def framework_base(parent: type) -> type:
    """torchrec's four Base arguments positionally; the framework's backward."""

    class FrameworkBase(parent):  # type: ignore[misc, valid-type]
        def __init__(
            self,
            model: torch.nn.Module,
            optimizer: torch.optim.Optimizer,
            device: torch.device,
            custom_model_fwd: Optional[Callable[..., Any]] = None,
        ) -> None:
            super().__init__(model, optimizer, device, custom_model_fwd)

        def _backward(self, losses: torch.Tensor) -> None:
            _framework_backward(self._optimizer, losses)

    return FrameworkBase


def _framework_model() -> Any:
    dmp, optimizer = _scaled_model()
    optimizer._gradient_accumulation_steps = ACCUMULATION  # type: ignore[attr-defined]
    return dmp, optimizer


@pytest.mark.parametrize(
    "check_all_workers, execute_all", [(True, True), (False, True), (False, False)]
)
def test_framework_sparse_dist_trains_as_on_torchrec(
    check_all_workers: bool, execute_all: bool
) -> None:
    """Uneven data with the check (every rank stops at the shortest), or even data
    without it, every batch trained or (``execute_all_batches=False``) the epoch ended
    where the pull finds the end: the same steps, outputs and weights on torchrec's
    class and ours."""
    counts = _counts() if check_all_workers else [6] * dist.get_world_size()
    batches = _my_batches(counts[dist.get_rank()])
    runs: Dict[str, Run] = {}
    for which in PARENTS:
        cls = framework_sparse_dist(_parent("TrainPipelineSparseDist", which))
        dmp, optimizer = _framework_model()
        arguments: List[Any] = [dmp, optimizer, DEVICE, execute_all, False, TrainPipelineContext]
        arguments += [False, None, 1, False, check_all_workers]
        runs[which] = run_pipeline(cls(*arguments), batches, dmp)
    assert len(runs["torchrec"]) == min(counts) - (0 if execute_all else 2)
    assert_runs_equal(runs["torchrec"], runs["ours"], ("torchrec parent", "our parent"))


def test_framework_base_trains_as_on_torchrec() -> None:
    batches = _my_batches(5)
    runs: Dict[str, Run] = {}
    for which in PARENTS:
        cls = framework_base(_parent("TrainPipelineBase", which))
        dmp, optimizer = _framework_model()
        runs[which] = run_pipeline(cls(dmp, optimizer, DEVICE, None), batches, dmp)
    assert len(runs["torchrec"]) == 5
    assert_runs_equal(runs["torchrec"], runs["ours"], ("torchrec parent", "our parent"))
