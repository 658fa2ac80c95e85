"""The hooks a pipeline leaves on the user's model are torchrec's, on 2 gloo ranks.

torchrec's code and users' code count a model's hooks and remove them (torchrec's
own detach test counts the model's forward hooks), so a pipeline of ours leaves
on the model, its submodules and their parameters exactly the hooks torchrec's
class of the same name leaves: as many, of the same kinds, in the same places
(:func:`tests.hook_parity.model_hooks`).  For every class, ours and torchrec's
train the same DLRM on the same batches for three steps of six (mid-epoch, as a
user's detach comes), and the model's hooks are compared; then again after
``detach()`` where torchrec's class has one (for Staged, its
``SparseDataDistUtil``'s).  torchrec's class runs where it can on CPU (some
under the test shim, :mod:`trec_pipelines.testing.torchrec_cpu`); elsewhere the
reference is the hooks the model had before any pipeline plus what torchrec's
source registers, written out in :data:`REGISTERED`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import pytest
import torch
from torchrec.distributed.train_pipeline import train_pipelines as upstream_pipelines

import trec_pipelines
from tests.distributed.test_comp_autograd import python_reducer_side_effects_undone
from tests.distributed.test_hooks import RUNNABLE
from tests.hook_parity import (
    CLASSES,
    Hooks,
    hooks_plus,
    model_hooks,
    ours,
    reached,
    torchrec_class,
)
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import DLRM, make_batches, make_sharded
from trec_pipelines.testing.torchrec_cpu import torchrec_on_cpu

DEVICE = devices.device()
SEED, DATA_SEED, STEPS, BATCHES = 1234, 5, 3, 6

# Arguments beyond (model, optimizer, device), the same for ours and torchrec's.
KWARGS: Dict[str, Dict[str, Any]] = {
    "TrainPipelineSemiSync": {"start_batch": 2},
    "TrainPipelineSparseDistBwdOpt": {"site_fqn": "ebc"},
    "TrainPipelineSparseDistOptStash": {"site_fqn": "ebc"},
    "TrainPipelineSparseDistEmbStash": {"site_fqn": "over_arch"},
    "TrainPipelinePrefetchEMS": {"site_fqn": "over_arch"},
}
# Its tables must be replicated on the host.
SHARDING = {"EvalPipelineCPUSparse": "data_parallel"}
COMP_AUTOGRAD = "TrainPipelineSparseDistCompAutograd"
EVAL = {"EvalPipelineSparseDist", "EvalPipelineFusedSparseDist", "EvalPipelineCPUSparse"}

# torchrec's classes that run here: name -> whether under the test shim.
THEIRS_RUN: Dict[str, bool] = {
    **{name: shim for name, (shim, _) in RUNNABLE.items()},
    "TrainPipelineSparseDistBwdOpt": False,
    "TrainPipelinePT2": False,
}

Added = Callable[[torch.nn.Module], Hooks]


def _nothing(dmp: torch.nn.Module) -> Hooks:
    return {}


def _name_of(target: Any, named: Iterator[Tuple[str, Any]]) -> str:
    """``target``'s name among ``named`` (the model's modules or parameters)."""
    return next(name for name, value in named if value is target)


def _site_forward_hook(site: str) -> Added:
    """torchrec's ``register_backward_hook`` at an ACTIVATION site (the default
    target type): one forward hook, with kwargs, on the site's module."""

    def added(dmp: torch.nn.Module) -> Hooks:
        module = dmp.module.get_submodule(site)
        return {(_name_of(module, dmp.named_modules()), "forward+kwargs"): 1}

    return added


def _site_last_parameter(site: str) -> Added:
    """torchrec's ``register_backward_hook`` at a PARAM_GRAD site (a site given by
    name to the EmbStash classes): one post-accumulate-grad hook on the parameter
    at ``hook_position`` 1.0, the site's last (a plain leaf here)."""

    def added(dmp: torch.nn.Module) -> Hooks:
        param = list(dmp.module.get_submodule(site).parameters())[-1]
        return {(_name_of(param, dmp.named_parameters()), "post_accumulate_grad"): 1}

    return added


# What torchrec's classes that do not run here register on the model, read from
# their source (torchrec 1.7.0 to 1.9.2): name -> (after training, after detach()).
# The site hooks are registered in _pipeline_model and never removed, so they
# outlive detach(); only SparseDataDistUtil removes its hook.
REGISTERED: Dict[str, Tuple[Added, Added]] = {
    # SparseDataDistUtil: one plain forward hook on the model, its detach() removes it.
    "StagedTrainPipeline": (lambda dmp: {("", "forward"): 1}, _nothing),
    "TrainPipelineSparseDistOptStash": (_site_forward_hook("ebc"), _site_forward_hook("ebc")),
    "TrainPipelineSparseDistEmbStash": (
        _site_last_parameter("over_arch"),
        _site_last_parameter("over_arch"),
    ),
    "TrainPipelinePrefetchEMS": (
        _site_last_parameter("over_arch"),
        _site_last_parameter("over_arch"),
    ),
    # None: their schedules change where the work runs, not the model's hooks.
    "PrefetchTrainPipelineSparseDist": (_nothing, _nothing),
    "TrainPipelineSparseDistCompAutograd": (_nothing, _nothing),
    "TrainPipelinePEC": (_nothing, _nothing),
    "EvalPipelineCPUSparse": (_nothing, _nothing),
}


class Census:
    """The model's hooks before the pipeline, after training, after detach()."""

    def __init__(self) -> None:
        self.before: Hooks = {}
        self.trained: Hooks = {}
        self.detached: Optional[Hooks] = None


def _compile_config(side: Any) -> Any:
    # Compiling is slow on CPU and adds no module hook: the steps here stay eager.
    return side.TorchCompileConfig(compile_on_iter=1000)


def _model(name: str) -> Tuple[Any, Any]:
    if name != COMP_AUTOGRAD:
        return make_sharded(DLRM, SHARDING.get(name, "table_wise"), seed=SEED)
    # As torchrec's own CompAutograd test builds it: DDP with its Python reducer,
    # which compiled autograd can capture (see test_comp_autograd_...).
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    # The compiled backward's kernels do not matter here: the quickest backend.
    dmp._compiled_autograd_options = {"backend": "eager", "dynamic": True, "fullgraph": False}
    return dmp, optimizer


def _progress_run(cls: type, name: str, side: Any, detach: bool) -> Census:
    census = Census()
    dmp, optimizer = _model(name)
    kwargs = dict(KWARGS.get(name, {}))
    if name == "TrainPipelinePT2":
        kwargs["compile_configs"] = _compile_config(side)
    if name in EVAL:
        dmp.eval()
    census.before = model_hooks(dmp)
    pipeline = cls(dmp, optimizer, DEVICE, **kwargs)
    it = iter(make_batches(BATCHES, seed=DATA_SEED))
    for _ in range(STEPS):
        pipeline.progress(it)
    census.trained = model_hooks(dmp)
    if detach:
        assert pipeline.detach() is dmp
        census.detached = model_hooks(dmp)
    return census


def _staged_run(detach: bool) -> Census:
    """Ours: the user's loop around copy and input_dist stages."""
    census = Census()
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    census.before = model_hooks(dmp)
    sdd = trec_pipelines.SparseDataDistUtil(dmp, data_dist_stream=None)
    pipeline = trec_pipelines.StagedTrainPipeline(
        [
            trec_pipelines.PipelineStage("data_copy", lambda batch: batch.to(DEVICE), None),
            sdd.start_sparse_data_dist_stage(),
        ]
    )
    it = iter(make_batches(BATCHES, seed=DATA_SEED))
    for _ in range(STEPS):
        batch = pipeline.progress(it)
        optimizer.zero_grad()
        loss, _ = dmp(batch)
        torch.sum(loss, dim=0).backward()
        optimizer.step()
    census.trained = model_hooks(dmp)
    if detach:
        assert sdd.detach() is dmp
        census.detached = model_hooks(dmp)
    return census


def _ours(name: str, detach: bool) -> Census:
    if name == "StagedTrainPipeline":
        return _staged_run(detach)
    return _progress_run(ours(name), name, trec_pipelines, detach)


def _theirs(name: str, theirs: type, detach: bool) -> Census:
    with torchrec_on_cpu() if THEIRS_RUN[name] else contextlib.nullcontext():
        return _progress_run(theirs, name, upstream_pipelines, detach)


def _written_out(name: str, before: Hooks, dmp: torch.nn.Module, detach: bool) -> Census:
    trained, detached = REGISTERED[name]
    census = Census()
    census.before = before
    census.trained = hooks_plus(before, trained(dmp))
    census.detached = hooks_plus(before, detached(dmp)) if detach else None
    return census


PRESENT = [name for name in CLASSES if torchrec_class(name) is not None]


def test_every_class_has_a_reference() -> None:
    missing = [n for n in CLASSES if n not in THEIRS_RUN and n not in REGISTERED]
    assert not missing, f"no reference for the model's hooks of {missing}"
    assert not set(THEIRS_RUN) & set(REGISTERED), "run and written out: keep one"


@pytest.mark.parametrize("name", sorted(set(REGISTERED) & set(PRESENT) - {"StagedTrainPipeline"}))
def test_the_written_out_references_follow_torchrecs_source(name: str) -> None:
    """A class written out with site hooks is one whose source reaches
    register_backward_hook from its constructor, progress(), attach or detach;
    one written out with none never does.  (Staged's hook is its
    SparseDataDistUtil's, read from pipeline_stage.py.)"""
    theirs = torchrec_class(name)
    assert theirs is not None
    trained, detached = REGISTERED[name]
    assert ("register_backward_hook" in reached(theirs)) == (trained is not _nothing), name
    assert (trained is _nothing) == (detached is _nothing), "hooks outlive detach() unless removed"


@pytest.mark.parametrize("name", [n for n in CLASSES if n != COMP_AUTOGRAD])
def test_the_model_carries_torchrecs_hooks_after_training_and_after_detach(name: str) -> None:
    _compare(name)


def test_comp_autograd_leaves_torchrecs_hooks(compiled_autograd_group: Any) -> None:
    """On a model built for compiled autograd (DDP's Python reducer, whose own
    post-accumulate-grad hooks are there before any pipeline), CompAutograd adds
    no hook, as torchrec's class adds none.  (On a DDP built with the C++
    reducer torchrec's class fails in the first backward; ours switches that DDP
    to the Python reducer, whose hooks then stay: see the migration guide.)"""
    with python_reducer_side_effects_undone(compiled_autograd_group):
        _compare(COMP_AUTOGRAD)


def _compare(name: str) -> None:
    theirs = torchrec_class(name)
    if name in THEIRS_RUN:
        assert theirs is not None, f"torchrec's {name} runs here but was not found"
    # torchrec's Staged detaches through its SparseDataDistUtil, which has detach().
    detach = name in REGISTERED or hasattr(theirs, "detach")
    got = _ours(name, detach)
    if name in THEIRS_RUN:
        assert theirs is not None
        want = _theirs(name, theirs, detach)
        assert want.before == got.before, "the two models differ before any pipeline"
    else:
        dmp, _ = _model(name)
        want = _written_out(name, got.before, dmp, detach)
    assert got.trained == want.trained, (name, "after training", got.trained, want.trained)
    assert got.detached == want.detached, (name, "after detach()", got.detached, want.detached)
