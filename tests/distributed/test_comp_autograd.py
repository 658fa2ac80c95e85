"""TrainPipelineSparseDistCompAutograd against the plain loop, on 2 gloo ranks.

One model, few batches: compiling the backward with inductor takes over a
minute on a 2-core machine with an empty inductor cache (~20 s with a warm one).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
import torch._inductor.config
import torch._logging
import torch.distributed as dist
from torchrec.distributed import comm_ops

from trec_pipelines.model.backward_hooks import (
    FirstGradTensorFinder,
    InjectionSite,
    InjectionTargetType,
)
from trec_pipelines.pipelines.comp_autograd import (
    TrainPipelineSparseDistCompAutograd,
    touched_settings,
)
from trec_pipelines.testing import devices, dlrm
from trec_pipelines.testing.dlrm import (
    DLRM,
    Batch,
    Run,
    make_batches,
    make_sharded,
    plain_loop,
    weights,
)
from trec_pipelines.testing.references import plain_loop_of

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 7
NUM_BATCHES = 4

# The compiled backward is inductor's code, not the eager kernels: it fuses
# the dense backward and reorders float32 sums (bias gradients, the matmul
# reductions of the MLPs), so gradients differ from eager by a few ULPs.  (The
# Python DDP reducer does the C++ one's arithmetic: grad / 2, then a sum of
# two values, which is exact in any order.)
# Measured over 4 steps: 3e-8 on the logits, 4e-8 on the weights (values of
# order 0.1-1, where one float32 ULP is 1e-8 to 1.2e-7).  1e-6 absolute is
# ~25x that, while the test below shows that a schedule fault (two batches
# trained in the wrong order) moves the same values by more than 1e-3.
ATOL, RTOL = 1e-6, 0.0

# What the pipeline holds around the compiled forward and backward (those of
# upstream's settings this PyTorch still has and honours).
HELD: Dict[str, Any] = {
    "torch._inductor.config.reorder_for_compute_comm_overlap": True,
    "torch._inductor.config.reorder_for_compute_comm_overlap_passes": [
        "sink_waits",
        "raise_comms",
        "reorder_compute_for_overlap",
    ],
    "torch._functorch.config.recompute_views": True,
    "torch._functorch.config.cse": False,
}


@contextlib.contextmanager
def python_reducer_side_effects_undone(group: dist.ProcessGroup) -> Iterator[None]:
    """Build the test's models on ``group``; leave the process as the tests after
    a compiled-autograd run expect it.

    ``group`` is conftest's ``compiled_autograd_group``: the compiled backward
    is kept for the next test (one of the same shape reuses it instead of
    compiling its own), and with it the model it was compiled for, which
    therefore holds that group rather than the test's own.  A DDP built with
    the Python reducer turns on inductor's DDP-fusion settings globally (in
    DDP's constructor, not in the pipeline): they are put back.  The test's
    other garbage is collected now, while the test's own group still exists.
    """
    inductor = torch._inductor.config
    own = dlrm.current_group()
    dlrm.set_current_group(group)
    try:
        with inductor.patch(
            _fuse_ddp_communication=inductor._fuse_ddp_communication,
            _fuse_ddp_bucket_size=inductor._fuse_ddp_bucket_size,
        ):
            yield
    finally:
        dlrm.set_current_group(own)
    gc.collect()


@pytest.fixture(autouse=True)
def undo_python_reducer_side_effects(
    compiled_autograd_group: dist.ProcessGroup, per_test_group: dist.ProcessGroup
) -> Iterator[None]:
    with python_reducer_side_effects_undone(compiled_autograd_group):
        yield


def _assert_close(ours: Run, ref: Run, atol: float = ATOL) -> None:
    assert len(ours) == len(ref)
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        torch.testing.assert_close(
            a, b, atol=atol, rtol=RTOL, msg=lambda m, step=step: f"step {step}: {m}"
        )
    assert ours.weights.keys() == ref.weights.keys()
    for key in ref.weights:
        torch.testing.assert_close(
            ours.weights[key],
            ref.weights[key],
            atol=atol,
            rtol=RTOL,
            msg=lambda m, key=key: f"{key}: {m}",
        )


def _max_difference(a: Run, b: Run) -> float:
    outputs = max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))
    weights = max((a.weights[k] - b.weights[k]).abs().max().item() for k in a.weights)
    return max(outputs, weights)


def test_comp_autograd_matches_plain_loop_and_leaves_config_alone() -> None:
    # Compiled afresh: what this test checks happens while a backward compiles,
    # and a backward of this shape compiled by an earlier test would be reused.
    torch._dynamo.reset()
    batches: List[Batch] = make_batches(NUM_BATCHES, seed=DATA_SEED)  # type: ignore[assignment]
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    swapped = plain_loop(
        *make_sharded(DLRM, "table_wise", seed=SEED), [batches[1], batches[0]] + batches[2:]
    )
    assert _max_difference(ref, swapped) > 1000 * ATOL, "the tolerance would hide a schedule fault"

    before = touched_settings()
    optimize_ddp_before = torch._dynamo.config.optimize_ddp
    log_state_before = repr(torch._logging._internal.log_state)

    # DDP picks its reducer when built; compiled autograd needs the Python one.
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)

    seen: List[Tuple[Dict[str, Any], bool, bool]] = []

    def forward(batch: Any) -> Any:
        # What the pipeline holds while the model runs.
        compiled = torch._dynamo.compiled_autograd.compiled_autograd_enabled
        seen.append((touched_settings(), comm_ops.USE_SYNC_COLLECTIVES, compiled))
        return dmp(batch)

    torch._dynamo.utils.counters.clear()
    pipeline = TrainPipelineSparseDistCompAutograd(dmp, optimizer, DEVICE, custom_model_fwd=forward)
    assert touched_settings() == before, "the constructor changed compiler settings"
    assert pipeline.compiled_autograd_options == {
        "backend": "inductor",
        "dynamic": True,
        "fullgraph": False,  # CPU: fbgemm's embedding backward has no fake kernel
    }
    compiled_with: List[Dict[str, Any]] = []
    compiler = pipeline._compiler

    def recording_compiler(graph: Any) -> Any:
        # Called by compiled autograd inside the backward, when it compiles a graph.
        compiled_with.append(touched_settings())
        return compiler(graph)

    pipeline._compiler = recording_compiler

    outputs: List[torch.Tensor] = []
    it = iter(batches)
    while True:
        try:
            outputs.append(pipeline.progress(it).clone())
        except StopIteration:
            break
        # Between progress() calls everything is as the user left it.
        assert touched_settings() == before
        assert comm_ops.USE_SYNC_COLLECTIVES is False
    ours = Run(outputs, weights(dmp))

    counters = torch._dynamo.utils.counters
    assert counters["compiled_autograd"]["captures"] >= 1, "the backward was not captured"
    assert counters["stats"]["unique_graphs"] >= 1, "nothing reached the compiler"
    _assert_close(ours, ref)

    # The first forward runs without compiled autograd (as upstream), the
    # others with it; every forward and the backward graphs' compilation
    # run under the settings and with synchronous collectives.
    assert len(seen) == NUM_BATCHES
    assert [compiled for _, _, compiled in seen] == [False] + [True] * (NUM_BATCHES - 1)
    assert compiled_with, "compiled autograd never called the compiler"
    assert HELD.keys() <= before.keys()
    for settings, sync in [(s, sync) for s, sync, _ in seen] + [(c, True) for c in compiled_with]:
        assert sync is True
        for key, value in HELD.items():
            assert settings[key] == value, key

    del pipeline
    assert touched_settings() == before
    assert torch._dynamo.config.optimize_ddp == optimize_ddp_before
    assert repr(torch._logging._internal.log_state) == log_state_before


def test_normally_built_dmp_matches_plain_loop_and_keeps_training_eagerly() -> None:
    """The DMP is built the usual way (C++ reducer): the pipeline switches its
    DDP to the Python reducer, trains like the plain loop, leaves the global
    settings alone, and the model then goes on training eagerly (the switched
    reducer still averages the dense gradients across ranks).  A backward hook
    (register_backward_hook, PARAM_GRAD) runs once per compiled backward, and the
    backward compiles once."""
    extra = 2
    batches: List[Batch] = make_batches(NUM_BATCHES + extra, seed=DATA_SEED)  # type: ignore[assignment]
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)

    inductor = torch._inductor.config
    rules = torch._dynamo.trace_rules
    global_state = lambda: (  # noqa: E731
        touched_settings(),
        torch._dynamo.config.optimize_ddp,
        inductor._fuse_ddp_communication,
        inductor._fuse_ddp_bucket_size,
        "torch.nn.parallel.distributed" in rules.LEGACY_MOD_INLINELIST,
    )
    before = global_state()
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    ddps = [m for m in dmp.modules() if isinstance(m, torch.nn.parallel.DistributedDataParallel)]
    assert ddps and not any(d._use_python_reducer for d in ddps), "not a normally built DMP"

    torch._dynamo.utils.counters.clear()
    pipeline = TrainPipelineSparseDistCompAutograd(dmp, optimizer, DEVICE)
    assert pipeline.switched_ddp_reducers == len(ddps)
    hook_calls: List[int] = []
    hook = pipeline.register_backward_hook(
        InjectionSite(
            "over_arch", FirstGradTensorFinder(), target_type=InjectionTargetType.PARAM_GRAD
        ),
        # Outside the graph: a hook that appends would make every backward compile again.
        torch.compiler.disable(lambda p: hook_calls.append(len(hook_calls))),
    )
    outputs: List[torch.Tensor] = []
    graphs: List[int] = []  # graphs compiled so far, after each step
    it = iter(batches[:NUM_BATCHES])
    while True:
        try:
            outputs.append(pipeline.progress(it).clone())
        except StopIteration:
            break
        assert global_state() == before, "a global setting changed between steps"
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] >= 1
    assert hook_calls == list(range(NUM_BATCHES))
    # The first backward (the second step) compiles; the later ones reuse its graphs.
    assert graphs[1] == graphs[-1], f"the backward compiled again: {graphs}"
    hook.remove()
    # Eager training of the same model, as a user might go on after the pipeline.
    pipeline.detach()
    more = plain_loop(dmp, optimizer, batches[NUM_BATCHES:])
    ours = Run(outputs + list(more), more.weights)
    assert len(ours) == len(ref)
    _assert_close(ours, ref)
    assert global_state() == before


# One run meets a fault at each point of a step in turn (each run compiles the
# model again, a quarter of a minute on two cores): the forward's calls that
# raise, and where in the call, then the optimizer step call that raises.  Every
# attempt counts, so the plain loop and the pipeline meet each fault at the same
# attempt and retry the same batch.
FORWARD_FAULTS = {2: "before_lookup", 5: "after_lookup", 8: "backward"}
OPTIMIZER_FAULT = 7


def _faulty_at_every_site() -> Tuple[Any, Any]:
    from tests.distributed.test_faults import FaultyDLRM, FaultyOptimizer

    class FaultyAtEverySite(FaultyDLRM):
        def forward(self, batch: Batch) -> Any:
            if not torch.fx._symbolic_trace.is_fx_tracing():
                self.where = FORWARD_FAULTS.get(self.calls, "")
                self.at = self.calls if self.where else -1
            return super().forward(batch)

    dmp, optimizer = make_sharded(FaultyAtEverySite, "table_wise", seed=SEED)
    return dmp, FaultyOptimizer(optimizer, OPTIMIZER_FAULT)


def test_a_fault_at_each_point_of_a_step_is_retried_and_training_equals_the_plain_loop() -> None:
    """A fault before the lookup, after it, in the (compiled) backward and in the
    optimizer step, one after another in one run: each time the next progress()
    retries that batch from its host copy, as the plain loop with retry does
    (compile tolerance)."""
    from tests.distributed.test_faults import plain_loop_with_retry, train_noting_faults

    batches = make_batches(NUM_BATCHES + 4, seed=SEED + 3)
    ref = plain_loop_with_retry(*_faulty_at_every_site(), batches)
    dmp, optimizer = _faulty_at_every_site()
    pipeline = TrainPipelineSparseDistCompAutograd(dmp, optimizer, DEVICE)
    ours, faults = train_noting_faults(pipeline, batches, dmp)
    assert faults == [
        "injected before the lookup",
        "injected in the over-arch",
        "injected in backward",
        "injected in the optimizer",
    ], faults
    _assert_close(ours, ref)


def test_resumed_from_a_checkpoint_equals_the_plain_loop() -> None:
    """Issue #22 for CompAutograd: 3 steps, a checkpoint (the pipeline's in-flight
    batches), a new model and pipeline loaded from it, then the rest: the plain
    loop's outputs and weights, within the compile tolerance."""
    from tests.distributed.test_resume import Counting

    batches = make_batches(NUM_BATCHES, seed=SEED + 5)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = TrainPipelineSparseDistCompAutograd(dmp, optimizer, DEVICE)
    it = Counting(batches)
    outputs = [pipeline.progress(it).clone() for _ in range(3)]
    state = pipeline.state_dict()
    pipeline.detach()
    dmp2, optimizer2 = make_sharded(DLRM, "table_wise", seed=SEED + 1)
    dmp2.load_state_dict(dmp.state_dict())
    optimizer2.load_state_dict(optimizer.state_dict())
    resumed = TrainPipelineSparseDistCompAutograd(dmp2, optimizer2, DEVICE)
    resumed.load_state_dict(state)
    rest = Counting(batches, it.yielded)
    while True:
        try:
            outputs.append(resumed.progress(rest).clone())
        except StopIteration:
            break
    assert len(outputs) == len(batches)
    _assert_close(Run(outputs, weights(dmp2)), ref)
