"""Subclass hooks called as torchrec calls them, on 2 gloo ranks (generated).

For each class whose torchrec twin runs here (on CPU some only under the test
shim, :mod:`trec_pipelines.testing.torchrec_cpu`), the same subclass of ours and of
torchrec's class records every call of every hook ours honours (name and
arguments, a batch named by its index), trains the same batches, and the two
records are compared: the same calls, in the same order, with equivalent
arguments.  Where ours calls a hook torchrec's class never calls (the
documented superset: ``_optimizer_step`` where torchrec steps the optimizer
itself, so an override takes effect in ours), those calls are listed apart
and checked against that list.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch

from tests.hook_parity import ours, overridable, torchrec_class
from trec_pipelines.core.subclass_hooks import UncalledHookWarning, decided_hooks, uncalled_hooks
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import DLRM, make_batches, make_sharded, run_pipeline
from trec_pipelines.testing.references import plain_loop_of
from trec_pipelines.testing.torchrec_cpu import torchrec_on_cpu

DEVICE = devices.device()
SEED, DATA_SEED, STEPS = 1234, 5, 5

Call = Tuple[str, Tuple[str, ...]]

# Hooks whose result the record shows (a pull's batch, a context's index).
_BY_RESULT = {"_next_batch", "_create_context"}
# Contexts torchrec makes past the last batch, before finding it has none.
_WASTED = tuple(f"context {i}" for i in range(STEPS, STEPS + 8))
_IDEMPOTENT = {"_set_module_context", "start_sparse_data_dist"}

# Hooks ours calls where torchrec's class of that name never does (the superset,
# documented in the migration guide's "Subclassing"); everything else must match.
SUPERSET: Dict[str, set] = {
    "TrainPipelineSparseDistLite": {"_optimizer_step"},
    "TrainPipelineFusedSparseDist": {"_optimizer_step", "sync_embeddings"},
    "TrainEvalHybridPipelineBase": {"_optimizer_step"},
    "TrainPipelineSemiSync": {"is_semi_sync"},
    "EvalPipelineSparseDist": {"_wait_for_batch"},
}
# Ours points the wrappers at the first batch once more than torchrec's class does
# (as it rewrites the model), the same pointing torchrec does another way.
FIRST_POINTING = {"EvalPipelineSparseDist", "TrainPipelineSemiSync"}


def _describe(value: Any, batches: List[Any]) -> str:
    """An argument as the comparison sees it: a batch by its index, a context by its
    batch's index, anything else by kind."""
    dense = getattr(value, "dense", None)
    if isinstance(dense, torch.Tensor):
        for index, batch in enumerate(batches):
            if dense.shape == batch.dense.shape and torch.equal(dense.cpu(), batch.dense):
                return f"batch {index}"
        return "batch ?"
    if hasattr(value, "module_contexts"):
        return f"context {getattr(value, 'index', None)}"
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, torch.nn.Module):
        return "model"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if hasattr(value, "__next__"):
        return "iterator"
    return type(value).__name__


def recording(base: type, hooks: List[str], log: List[Call], batches: List[Any]) -> type:
    """``base`` with every hook in ``hooks`` logging its call, then doing what it did."""

    def recorder(name: str) -> Callable[..., Any]:
        # An uncalled hook ours does not define: the override only records.
        original = getattr(base, name, None)

        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            described = tuple(_describe(a, batches) for a in args) + tuple(
                f"{k}={_describe(v, batches)}" for k, v in sorted(kwargs.items())
            )
            result = None if original is None else original(self, *args, **kwargs)
            if name in _BY_RESULT:
                described += ("->", _describe(result, batches))
            log.append((name, described))
            return result

        return hook if original is None else functools.wraps(original)(hook)

    namespace: Dict[str, Any] = {"__module__": "user_subclass"}
    for name in hooks:
        if isinstance(base.__dict__.get(name), staticmethod):
            continue
        namespace[name] = recorder(name)
    return type(f"Recording{base.__name__}", (base,), namespace)


def honoured(name: str) -> List[str]:
    """The hooks of torchrec's ``name`` that ours honours (callable, neither uncalled
    nor refused)."""
    theirs = torchrec_class(name)
    assert theirs is not None
    decided = decided_hooks(ours(name))
    skip = {"progress", "_pipelined_forward_type", "state_dict", "load_state_dict"}
    return sorted(
        h
        for h, v in overridable(theirs).items()
        if h not in decided and h not in skip and callable(getattr(ours(name), h, None))
    )


def uncalled(name: str) -> List[str]:
    """The hooks of torchrec's ``name`` that neither its class nor ours calls."""
    theirs = torchrec_class(name)
    assert theirs is not None
    return sorted(h for h in uncalled_hooks(ours(name)) if callable(getattr(theirs, h, None)))


def _run(cls: type, batches: List[Any], shim: bool, kwargs: Dict[str, Any]) -> None:
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    evaluating = cls.__name__.startswith("RecordingEval")
    if evaluating:
        dmp.eval()
    with torchrec_on_cpu() if shim else contextlib.nullcontext():
        pipeline = cls(dmp, None if evaluating else optimizer, DEVICE, **kwargs)
        run_pipeline(pipeline, batches, model=dmp)


# name -> (runs under the shim: torchrec's class crashes on CPU without it, kwargs).
# Not here: torchrec's Prefetch fails on this model ("Invalid PrefetchPipelinedForward
# usage"), and its CompAutograd, PEC, stash and CPUSparse classes do not run on CPU;
# Staged's hooks are its stages.  Their hooks are checked for signature or refusal in
# tests/unit/test_hook_parity.py, and the user-style subclasses below run on ours.
RUNNABLE: Dict[str, Tuple[bool, Dict[str, Any]]] = {
    "TrainPipelineBase": (False, {}),
    "TrainPipelineSparseDist": (False, {}),
    "TrainPipelineSparseDistLite": (False, {}),
    "TrainPipelineSparseDistT": (False, {}),
    "TrainEvalHybridPipelineBase": (False, {}),
    "TrainPipelineFusedSparseDist": (True, {}),
    "TrainPipelineSemiSync": (True, {"start_batch": 2}),
    "EvalPipelineSparseDist": (True, {}),
    "EvalPipelineFusedSparseDist": (True, {}),
}


def by_hook(log: List[Call]) -> Dict[str, List[Tuple[str, ...]]]:
    """Each hook's calls, in order, with their arguments, as the comparison sees them.

    * A pull (``_next_batch``) or a context (``_create_context``) that came to
      nothing at the end of the data is left out: torchrec's classes poll an
      ended iterator again, and make a context before they know a batch came.
    * Repeats of an idempotent call (pointing the wrappers at the batch they
      already serve; starting a batch's input_dist that is already started:
      torchrec's Eval does so for its first batch) count once.
    """
    calls: Dict[str, List[Tuple[str, ...]]] = {}
    for name, args in log:
        if name in _BY_RESULT and args[-1] in ("None", "context None") + _WASTED:
            continue
        seen = calls.setdefault(name, [])
        if name in _IDEMPOTENT and seen and seen[-1] == args:
            continue
        seen.append(args)
    return calls


@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_hooks_are_called_as_torchrec_calls_them(name: str) -> None:
    batches = make_batches(STEPS, seed=DATA_SEED)
    hooks = honoured(name)
    shim, kwargs = RUNNABLE[name]
    # The uncalled hooks are recorded too: neither class may call them.
    not_called = uncalled(name)
    theirs_log: List[Call] = []
    ours_log: List[Call] = []
    theirs = torchrec_class(name)
    assert theirs is not None
    _run(recording(theirs, hooks + not_called, theirs_log, batches), batches, shim, kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncalledHookWarning)  # the unit tier checks them
        ours_cls = recording(ours(name), hooks + not_called, ours_log, batches)
    _run(ours_cls, batches, False, kwargs)
    assert not_called, name
    assert [c for c in theirs_log if c[0] in not_called] == [], "torchrec's class called them"
    assert [c for c in ours_log if c[0] in not_called] == [], "ours called them"
    theirs_calls, ours_calls = by_hook(theirs_log), by_hook(ours_log)
    extra = sorted(set(ours_calls) - set(theirs_calls))
    missing = sorted(set(theirs_calls) - set(ours_calls))
    if name in FIRST_POINTING and ours_calls.get("_set_module_context", [])[:1] == [("context 0",)]:
        ours_calls["_set_module_context"] = ours_calls["_set_module_context"][1:]
    differ = sorted(
        h for h in set(ours_calls) & set(theirs_calls) if ours_calls[h] != theirs_calls[h]
    )
    print(name, "EXTRA", extra, "MISSING", missing)
    for h in differ:
        print(name, "DIFFER", h, "\n  theirs", theirs_calls[h], "\n  ours  ", ours_calls[h])
    assert not missing and not differ
    assert set(extra) <= SUPERSET.get(name, set()), extra


# ------------------------------------------------- subclasses written as users write them

from trec_pipelines.testing.dlrm import assert_runs_equal  # noqa: E402


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler(DEVICE.type, init_scale=2.0**8)


def with_grad_scaler(base: type) -> type:
    """Mixed precision the way torchrec users add it: a GradScaler in ``_backward``."""

    class GradScalerPipeline(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.scaler = _scaler()

        def _backward(self, losses: torch.Tensor) -> None:
            self.scaler.scale(torch.sum(losses, dim=0)).backward()

        def _optimizer_step(self) -> None:
            self.scaler.step(self._optimizer)
            self.scaler.update()

    return GradScalerPipeline


def dropping(base: type, dropped: List[torch.Tensor]) -> type:
    """A ``_next_batch`` that skips the batches whose dense features are in ``dropped``."""

    class DroppingPipeline(base):  # type: ignore[misc, valid-type]
        def _next_batch(self, dataloader_iter: Any) -> Optional[Any]:
            while True:
                batch = super()._next_batch(dataloader_iter)
                if batch is None or not any(torch.equal(batch.dense, d) for d in dropped):
                    return batch

    return DroppingPipeline


def rebuilt(base: type) -> type:
    """``progress()`` rebuilt from the verbs, as torchrec's SparseDist writes it."""

    class RebuiltPipeline(base):  # type: ignore[misc, valid-type]
        def progress(self, dataloader_iter: Any) -> Any:
            if not self._model_attached:
                self.attach(self._model)
            self.fill_pipeline(dataloader_iter)
            if not self.batches:
                raise StopIteration
            self._set_module_context(self.contexts[0])
            if self._model.training:
                self._optimizer.zero_grad()
            self._wait_for_batch()
            if len(self.batches) >= 2:
                self.start_sparse_data_dist(self.batches[1], self.contexts[1])
            self.enqueue_batch(dataloader_iter)
            losses, output = self._model_fwd(self.batches[0])
            if len(self.batches) >= 2:
                self.wait_sparse_data_dist(self.contexts[1])
            if self._model.training:
                self._backward(losses)
                self._optimizer_step()
            self.dequeue_batch()
            return output

    return RebuiltPipeline


def _train(cls: type, batches: List[Any]) -> Any:
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    return run_pipeline(cls(dmp, optimizer, DEVICE), batches, model=dmp)


def _plain_scaled(batches: List[Any]) -> Any:
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    scaler, outputs = _scaler(), []
    for batch in batches:
        optimizer.zero_grad()
        loss, out = dmp(batch)
        scaler.scale(torch.sum(loss, dim=0)).backward()
        scaler.step(optimizer)
        scaler.update()
        outputs.append(out.detach().clone())
    from trec_pipelines.testing.dlrm import Run, weights

    return Run(outputs, weights(dmp))


USER_BASES = ["TrainPipelineSparseDist", "TrainPipelineBase"]


@pytest.mark.parametrize("name", USER_BASES)
def test_a_grad_scaler_in_backward_trains_as_the_plain_loop_with_a_scaler(name: str) -> None:
    """Ours equals the plain loop with the scaler, and torchrec's SparseDist with the
    same subclass.  (torchrec's Base steps the optimizer itself, so there the
    override's ``_optimizer_step`` never runs: the plain loop is Base's oracle.)"""
    batches = make_batches(6, seed=DATA_SEED)
    ours_run = _train(with_grad_scaler(ours(name)), batches)
    assert_runs_equal(_plain_scaled(batches), ours_run, ("plain loop with a scaler", name))
    if name == "TrainPipelineSparseDist":
        theirs = torchrec_class(name)
        assert theirs is not None
        assert_runs_equal(_train(with_grad_scaler(theirs), batches), ours_run, ("torchrec", name))


@pytest.mark.parametrize("name", USER_BASES)
def test_a_next_batch_that_drops_batches_trains_as_on_torchrec(name: str) -> None:
    batches = make_batches(7, seed=DATA_SEED)
    dropped = [batches[2].dense, batches[5].dense]
    kept = [b for i, b in enumerate(batches) if i not in (2, 5)]
    theirs = torchrec_class(name)
    assert theirs is not None
    reference = _train(dropping(theirs, dropped), batches)
    assert_runs_equal(
        plain_loop_of(DLRM, "table_wise", kept, seed=SEED),
        reference,
        ("plain loop over the kept batches", name),
    )
    assert_runs_equal(reference, _train(dropping(ours(name), dropped), batches), ("torchrec", name))


def test_a_progress_rebuilt_from_the_verbs_trains_as_on_torchrec() -> None:
    name = "TrainPipelineSparseDist"
    batches = make_batches(6, seed=DATA_SEED)
    theirs = torchrec_class(name)
    assert theirs is not None
    reference = _train(rebuilt(theirs), batches)
    assert_runs_equal(
        plain_loop_of(DLRM, "table_wise", batches, seed=SEED),
        reference,
        ("plain loop", name),
    )
    pipeline_cls = rebuilt(ours(name))
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = pipeline_cls(dmp, optimizer, DEVICE)
    assert_runs_equal(reference, run_pipeline(pipeline, batches, model=dmp), ("torchrec", name))
    # Each trained batch's host copy was let go (the step guard runs the user's progress).
    assert pipeline._source.in_flight == 0
