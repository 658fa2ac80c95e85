"""Subclasses written against torchrec's pipelines, the way outside frameworks write them.

A recommender framework built on torchrec does not only call ``progress()``: it
subclasses the pipelines, passes torchrec's constructor arguments positionally,
overrides ``_next_batch`` and ``_backward``, rebuilds ``progress()`` from
torchrec's verbs, and reads and writes the pipeline's state
(``_dataloader_iter``, ``_dataloader_exhausted``, ``batches``, ``_state``,
``_cur_batch``, ...).  The classes below are such code, written once against a
``parent`` and built twice: on torchrec's class and on ours.  The module keeps
torchrec's own imports for what it does not subclass (``TrainPipelineContext``,
``PipelineState``), as code that swapped only the pipeline import would.

Every test trains the same model on the same data (2 or more gloo ranks, each
with its own data, some with fewer batches than others) through both, and
compares per-step outputs and final weights bit for bit.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Type

import pytest
import torch
import torch.distributed as dist
import torchrec.distributed.train_pipeline.train_pipelines as upstream
from torchrec.distributed.train_pipeline import TrainPipelineContext
from torchrec.distributed.train_pipeline.types import PipelineState

import trec_pipelines
from tests.hook_parity import torchrec_class
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    Batch,
    Run,
    _snapshot,
    assert_runs_equal,
    make_batches,
    make_sharded,
    run_pipeline,
    weights,
)
from trec_pipelines.testing.references import plain_loop_of
from trec_pipelines.testing.torchrec_cpu import torchrec_on_cpu

DEVICE = devices.device()
SEED, DATA_SEED = 4321, 11
# The loss scale the outside framework's optimizer carries: a power of two, so
# scaling is exact and nothing overflows.
LOSS_SCALE = 2.0**6


def _counts() -> List[int]:
    """Each rank's batch count: rank 0 has the most, the last rank the fewest."""
    return [7 - min(rank, 3) for rank in range(dist.get_world_size())]


def _my_batches(n: int) -> List[Batch]:
    return make_batches(n, seed=DATA_SEED)


# --------------------------------------------------------------------------
# The outside framework's classes, written against ``parent``
# --------------------------------------------------------------------------


def _scaled_backward(optimizer: Any, losses: torch.Tensor) -> None:
    """The framework's backward: the summed loss through the optimizer's scaler, if any."""
    loss = torch.sum(losses, dim=0)
    scaler = getattr(optimizer, "_grad_scaler", None)
    if scaler is not None:
        scaler.scale(loss).backward()
    else:
        loss.backward()


def outside_sparse_dist(parent: type) -> type:
    """A SparseDist subclass as a framework writes it: torchrec's ten arguments passed
    on positionally, a ``_next_batch`` that stops every rank at the shortest rank's
    data (an all-reduce of "has a batch"), a backward through the optimizer's loss
    scaler, and a ``progress()`` rebuilt from torchrec's verbs that keeps
    ``_state`` up to date."""

    class OutsideSparseDist(parent):  # type: ignore[misc, valid-type]
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
            stop_at_shortest: bool = False,
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
            self.stop_at_shortest = stop_at_shortest
            self.states_seen: List[Any] = []

        def _next_batch(self, dataloader_iter: Iterator[Any]) -> Optional[Any]:
            if dataloader_iter is not self._dataloader_iter:
                self._dataloader_iter = dataloader_iter
                self._dataloader_exhausted = False
            if self._dataloader_exhausted:
                return None
            batch = next(dataloader_iter, None)
            if self.stop_at_shortest:
                has_batch = torch.tensor([0.0 if batch is None else 1.0], device=self._device)
                dist.all_reduce(has_batch, op=dist.ReduceOp.MIN)
                if has_batch.item() < 1:
                    self._dataloader_exhausted = True
                    return None
            elif batch is None:
                self._dataloader_exhausted = True
            return batch

        def _backward(self, losses: torch.Tensor) -> None:
            _scaled_backward(self._optimizer, losses)

        def progress(self, dataloader_iter: Iterator[Any]) -> Any:
            self._state = PipelineState.IDLE
            if not self._model_attached:
                self.attach(self._model)
            self.fill_pipeline(dataloader_iter)
            if not self.batches:
                raise StopIteration
            self._set_module_context(self.contexts[0])
            training = self._model.training
            if training:
                self._optimizer.zero_grad()
            self._wait_for_batch()
            if len(self.batches) >= 2:
                self.start_sparse_data_dist(self.batches[1], self.contexts[1])
            if not self._enqueue_batch_after_forward:
                self.enqueue_batch(dataloader_iter)
            self._state = PipelineState.CALL_FWD
            self.states_seen.append(self._state)
            losses, output = self._model_fwd(self.batches[0])
            if self._enqueue_batch_after_forward:
                self.enqueue_batch(dataloader_iter)
            if len(self.batches) >= 2:
                self.wait_sparse_data_dist(self.contexts[1])
            if training:
                self._state = PipelineState.CALL_BWD
                self.states_seen.append(self._state)
                self._backward(losses)
                self.sync_embeddings(
                    self._model, self._dmp_collection_sync_interval_batches, self.contexts[0]
                )
                self._optimizer.step()
            self.dequeue_batch()
            return output

    return OutsideSparseDist


def outside_base(parent: type) -> type:
    """A Base subclass: torchrec's arguments positionally, the scaled backward, and a
    ``progress()`` of its own over torchrec's Base state (``_connected``,
    ``_cur_batch``, ``_data_iter_stopped``)."""

    class OutsideBase(parent):  # type: ignore[misc, valid-type]
        def __init__(
            self,
            model: torch.nn.Module,
            optimizer: torch.optim.Optimizer,
            device: torch.device,
            custom_model_fwd: Optional[Callable[..., Any]] = None,
        ) -> None:
            super().__init__(model, optimizer, device, custom_model_fwd)
            self.steps_taken = 0

        def _backward(self, losses: torch.Tensor) -> None:
            _scaled_backward(self._optimizer, losses)

        def progress(self, dataloader_iter: Iterator[Any]) -> Any:
            if not self._connected:
                self._connect(dataloader_iter)
            if self._data_iter_stopped:
                raise StopIteration()
            upcoming = self._next_batch(dataloader_iter)
            current = self._cur_batch
            training = self._model.training
            if training:
                self._optimizer.zero_grad()
            if current is not None:
                self._wait_for_batch(current)
            losses, output = self._model(current)
            if training:
                self._backward(losses)
            self._cur_batch = current = upcoming
            if current is not None:
                self._copy_batch_to_gpu(current)
            if training:
                self._optimizer.step()
            self.steps_taken += 1
            return output

    return OutsideBase


@dataclass
class TaggedBatch(Batch):
    """A batch that can be marked as padding (``dummy``), which the device copy keeps."""

    dummy: bool = False

    def to(self, device: torch.device, non_blocking: bool = False) -> "TaggedBatch":
        moved = super().to(device, non_blocking)
        return TaggedBatch(moved.dense, moved.sparse, moved.labels, dummy=self.dummy)


class TaggingDLRM(DLRM):
    """The test DLRM whose output says whether its batch was padding."""

    def forward(self, batch: TaggedBatch) -> Tuple[torch.Tensor, Any]:  # type: ignore[override]
        loss, logits = super().forward(batch)
        return loss, (logits, batch.dummy)


def outside_predict(parent: type) -> type:
    """A prediction pipeline that keeps a rank whose data ended in step with the others:
    until every rank is out, it pulls a copy of the batch in flight marked ``dummy``,
    whose output the caller drops."""

    class OutsidePredict(parent):  # type: ignore[misc, valid-type]
        def _next_batch(self, dataloader_iter: Iterator[Any]) -> Optional[Any]:
            if dataloader_iter is not self._dataloader_iter:
                self._dataloader_iter = dataloader_iter
                self._dataloader_exhausted = False
            if self._dataloader_exhausted:
                return None
            batch = next(dataloader_iter, None)
            has_batch = torch.tensor([0.0 if batch is None else 1.0], device=self._device)
            dist.all_reduce(has_batch, op=dist.ReduceOp.MAX)
            if batch is None:
                if has_batch.item() > 0:
                    batch = copy.copy(self.batches[0])
                    batch.dummy = True
                else:
                    self._dataloader_exhausted = True
            return batch

    return OutsidePredict


# --------------------------------------------------------------------------
# Driving them
# --------------------------------------------------------------------------


class ScaledOptimizer:
    """The framework's optimizer: torchrec's combined optimizer, plus the loss scaler
    its pipelines look for (``_grad_scaler``); its ``step`` unscales first."""

    def __init__(self, inner: Any, scale: float) -> None:
        self.inner = inner
        self._grad_scaler = _FixedScaler(scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self._grad_scaler.unscale(self.inner)
        self.inner.step()

    @property
    def param_groups(self) -> Any:
        return self.inner.param_groups

    def state_dict(self) -> Any:
        return self.inner.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.inner.load_state_dict(state)


class _FixedScaler:
    """A loss scaler with a fixed power-of-two scale (exact on any device)."""

    def __init__(self, scale: float) -> None:
        self.scale_factor = scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_factor

    def unscale(self, optimizer: Any) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.div_(self.scale_factor)


def _scaled_model() -> Tuple[torch.nn.Module, ScaledOptimizer]:
    # SGD on the embeddings: the fused update sees the scaled gradient the same way
    # in both runs, and Adagrad on the dense part sees it unscaled.
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED, emb_optimizer=torch.optim.SGD)
    return dmp, ScaledOptimizer(optimizer, LOSS_SCALE)


PARENTS = ["torchrec", "ours"]


def _parent(name: str, which: str) -> type:
    return getattr(upstream if which == "torchrec" else trec_pipelines, name)


@pytest.mark.parametrize("stop_at_shortest", [True, False])
def test_sparse_dist_subclass_trains_as_on_torchrec(stop_at_shortest: bool) -> None:
    """Uneven data, every rank stopped at the shortest by the subclass's own
    all-reduce (or, with even data, no all-reduce): the same outputs and weights
    with torchrec's class or ours as the parent."""
    counts = _counts() if stop_at_shortest else [6] * dist.get_world_size()
    batches = _my_batches(counts[dist.get_rank()])
    runs: Dict[str, Run] = {}
    for which in PARENTS:
        cls = outside_sparse_dist(_parent("TrainPipelineSparseDist", which))
        dmp, optimizer = _scaled_model()
        pipeline = cls(
            dmp,
            optimizer,
            DEVICE,
            True,
            False,
            TrainPipelineContext,
            False,
            None,
            1,
            False,
            stop_at_shortest,
        )
        runs[which] = run_pipeline(pipeline, batches, dmp)
        assert pipeline.states_seen == [PipelineState.CALL_FWD, PipelineState.CALL_BWD] * len(
            runs[which]
        )
        assert pipeline._state == PipelineState.IDLE
    assert len(runs["torchrec"]) == min(counts)
    assert_runs_equal(runs["torchrec"], runs["ours"], ("torchrec parent", "our parent"))


def test_sparse_dist_subclass_with_our_context_type_trains_as_on_torchrec() -> None:
    """The same subclass given our ``TrainPipelineContext`` (code that swapped that
    import too) trains as torchrec's class with torchrec's context."""
    batches = _my_batches(5)
    runs: Dict[str, Run] = {}
    for which in PARENTS:
        context = (
            upstream.TrainPipelineContext
            if which == "torchrec"
            else trec_pipelines.TrainPipelineContext
        )
        cls = outside_sparse_dist(_parent("TrainPipelineSparseDist", which))
        dmp, optimizer = _scaled_model()
        pipeline = cls(dmp, optimizer, DEVICE, True, False, context)
        runs[which] = run_pipeline(pipeline, batches, dmp)
    assert_runs_equal(runs["torchrec"], runs["ours"], ("torchrec parent", "our parent"))


def test_sparse_dist_subclass_switches_iterators_as_on_torchrec() -> None:
    """Two epochs from two iterators: the subclass's ``_next_batch`` sees the new
    iterator, records it in ``_dataloader_iter`` and clears ``_dataloader_exhausted``."""
    first, second = _my_batches(4), make_batches(3, seed=DATA_SEED + 1)
    runs: Dict[str, Run] = {}
    for which in PARENTS:
        cls = outside_sparse_dist(_parent("TrainPipelineSparseDist", which))
        dmp, optimizer = _scaled_model()
        pipeline = cls(dmp, optimizer, DEVICE)
        one = run_pipeline(pipeline, first, dmp)
        assert pipeline._dataloader_exhausted is True
        it = iter(second)
        two = []
        while True:
            try:
                two.append(_snapshot(pipeline.progress(it)))
            except StopIteration:
                break
        assert pipeline._dataloader_iter is it
        runs[which] = Run(list(one) + two, weights(dmp))
    assert len(runs["torchrec"]) == 7
    assert_runs_equal(runs["torchrec"], runs["ours"], ("torchrec parent", "our parent"))


def test_base_subclass_trains_as_on_torchrec() -> None:
    batches = _my_batches(5)
    runs: Dict[str, Run] = {}
    for which in PARENTS:
        cls = outside_base(_parent("TrainPipelineBase", which))
        dmp, optimizer = _scaled_model()
        pipeline = cls(dmp, optimizer, DEVICE, None)
        runs[which] = run_pipeline(pipeline, batches, dmp)
        assert pipeline.steps_taken == 5
        assert pipeline._data_iter_stopped and pipeline._cur_batch is None
    assert_runs_equal(runs["torchrec"], runs["ours"], ("torchrec parent", "our parent"))


def _predict(cls: type, batches: List[TaggedBatch]) -> List[Tuple[torch.Tensor, bool]]:
    """Every step's ``(logits, dummy)`` of ``cls`` in eval mode, until StopIteration."""
    dmp, optimizer = make_sharded(TaggingDLRM, "table_wise", seed=SEED)
    dmp.eval()
    pipeline = cls(dmp, optimizer, DEVICE)
    it = iter(batches)
    steps: List[Tuple[torch.Tensor, bool]] = []
    with torch.no_grad():
        for _ in range(100):
            try:
                logits, dummy = pipeline.progress(it)
            except StopIteration:
                break
            steps.append((logits.clone(), bool(dummy)))
    return steps


# Batches per rank: rank 0's, then every other rank's.  (5, 3): the short rank runs
# out during the fill of ours-would-be pull-ahead, where ``batches`` is still empty.
PREDICT_COUNTS = {"5-3": (5, 3), "7-6": (7, 6)}


@pytest.mark.parametrize("counts", sorted(PREDICT_COUNTS))
def test_padded_predict_scores_every_rank_s_batches_as_on_torchrec(counts: str) -> None:
    """Uneven prediction shards: a rank that ran out pads with ``dummy`` copies of
    ``self.batches[0]`` until every rank is out, so every rank returns as many
    outputs as the longest rank has batches, its own batches' among them; each
    step's output, padding included, equals torchrec's."""
    longest, others = PREDICT_COUNTS[counts]
    mine = longest if dist.get_rank() == 0 else others
    batches = [TaggedBatch(b.dense, b.sparse, b.labels) for b in _my_batches(mine)]
    steps = {
        which: _predict(outside_predict(_parent("TrainPipelineSparseDist", which)), batches)
        for which in PARENTS
    }
    for which, run in steps.items():
        assert len(run) == longest, (which, len(run))
        assert [dummy for _, dummy in run] == [False] * mine + [True] * (longest - mine), which
    for step, (theirs, ours) in enumerate(zip(steps["torchrec"], steps["ours"], strict=True)):
        assert torch.equal(theirs[0], ours[0]), f"rank {dist.get_rank()} step {step} differs"


# --------------------------------------------------------------------------
# Every class built with torchrec's arguments, positionally
# --------------------------------------------------------------------------

# Classes whose torchrec twin trains here -> whether it needs the CPU shim to.
POSITIONAL: Dict[str, bool] = {
    "TrainPipelineBase": False,
    "TrainPipelineSparseDist": False,
    "TrainPipelineSparseDistLite": False,
    "TrainPipelineFusedSparseDist": True,
    "TrainPipelineSemiSync": True,
    "EvalPipelineSparseDist": False,
    "EvalPipelineFusedSparseDist": True,
}


def _init_parameters(cls: type) -> Mapping[str, inspect.Parameter]:
    """``cls.__init__``'s parameters; where it only forwards ``*args, **kwargs`` (torchrec's
    EvalFused), its parent's."""
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters
        if any(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and name != "self"
            for name, p in parameters.items()
        ):
            return parameters
    raise AssertionError(f"{cls.__name__} has no positional constructor parameters")


# The stash variants' one required argument: where in the model their work is hooked.
STASH_SITES = {
    "TrainPipelineSparseDistOptStash": "ebc",
    "TrainPipelineSparseDistEmbStash": "over_arch",
    "TrainPipelinePrefetchEMS": "over_arch",
}


def _positional_arguments(theirs: type, ours: type, model: Any, optimizer: Any) -> List[Any]:
    """torchrec's ``__init__`` parameters in torchrec's order, each given the default of
    the class it is passed to (``context_type`` is each one's own context class)."""
    given = {"model": model, "optimizer": optimizer, "device": DEVICE}
    if theirs.__name__ in STASH_SITES:
        given["site_fqn"] = STASH_SITES[theirs.__name__]
    ours_defaults = _init_parameters(ours)
    values = []
    for name, parameter in _init_parameters(theirs).items():
        if name == "self":
            continue
        if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            break
        if name in given:
            values.append(given[name])
        else:
            assert parameter.default is not inspect.Parameter.empty, (theirs, name)
            values.append(ours_defaults[name].default if ours is not theirs else parameter.default)
    return values


@pytest.mark.parametrize("name", sorted(POSITIONAL))
def test_every_class_built_positionally_trains_as_torchrecs(name: str) -> None:
    theirs = getattr(upstream, name)
    ours = getattr(trec_pipelines, name)
    shim = POSITIONAL[name]
    batches = _my_batches(5)
    runs: Dict[str, Run] = {}
    for which, cls in (("torchrec", theirs), ("ours", ours)):
        dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
        arguments = _positional_arguments(theirs, cls, dmp, optimizer)
        assert len(arguments) >= 3
        if shim and which == "torchrec":
            with torchrec_on_cpu():
                runs[which] = run_pipeline(cls(*arguments), batches, dmp)
        else:
            runs[which] = run_pipeline(cls(*arguments), batches, dmp)
    assert len(runs["ours"]) == 5
    assert_runs_equal(runs["torchrec"], runs["ours"], (f"torchrec's {name}", f"our {name}"))


# Classes whose torchrec twin does not train on CPU but which train as the plain
# loop (the plain loop is their oracle), when this torchrec has them.
POSITIONAL_PLAIN = [
    "PrefetchTrainPipelineSparseDist",
    "TrainPipelinePEC",
    "TrainPipelineSparseDistT",
    "TrainPipelineSparseDistOptStash",
    "TrainPipelineSparseDistEmbStash",
    "TrainPipelinePrefetchEMS",
]


@pytest.mark.parametrize("name", [n for n in POSITIONAL_PLAIN if torchrec_class(n) is not None])
def test_every_class_built_positionally_trains_as_the_plain_loop(name: str) -> None:
    theirs = torchrec_class(name)
    assert theirs is not None
    ours = getattr(trec_pipelines, name)
    batches = _my_batches(5)
    reference = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = ours(*_positional_arguments(theirs, ours, dmp, optimizer))
    assert_runs_equal(reference, run_pipeline(pipeline, batches, dmp), ("plain loop", name))
