"""What runs in the benchmark: the pipeline variants and an adapter per contender.

A *variant* is a pipeline class name that ``trec_pipelines`` exports (found at
run time, so new variants join the benchmark once they are exported).  Each
variant has up to two contenders, ours and torchrec's same-named class, and
is compared with a plain loop in the same mode (training or eval).

A *contender* builds its own model (so one pipeline's rewrite never touches
another's model) and knows how to drive one epoch:

* training pipelines: ``progress(it)`` until ``StopIteration``;
* eval pipelines: the same with the model in eval mode, under ``no_grad``;
* ``StagedTrainPipeline``: the pipeline returns batches and the loop does
  zero_grad, forward, backward and step itself;
* compiled variants (PT2, CompAutograd) compile during the untimed warm-up
  epoch, so compile time is never timed; they only run with ``--include-compiled``.

After every epoch the pipeline's ``reset()`` is called, so an epoch leaves
nothing in flight (no background thread, no pending all-to-all) while the
next contender is timed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
from typing import Any, Callable, ContextManager, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.contenders.variants import (
    EVAL,
    NEEDS_PYTHON_REDUCER,
    STAGED,
    STASH_WEIGHTS_VARIANTS,
    TRAIN,
    Variant,
)
from benchmarks.settings.variants import COMPILED_PLAIN
from trec_pipelines.observe import task_names as tasks
from trec_pipelines.testing import devices, torchrec_cpu as shim
from trec_pipelines.testing.dlrm import Batch
from trec_pipelines.testing.dlrm_sharded import make_spec_sharded
from trec_pipelines.testing.dlrm_spec import ModelSpec

# Where the ranks train: CPU, or the rank's GPU (trec_pipelines/testing/devices.py, TREC_DEVICE).
DEVICE = devices.device()


# Constructor arguments given to both libraries' classes.  SemiSync's default
# start_batch (900) would keep it synchronous through every short epoch here.
VARIANT_KWARGS: Dict[str, Dict[str, Any]] = {
    "TrainPipelineSemiSync": {"start_batch": 0},
    # The optimizer steps at the bench model's embedding output dist.
    "TrainPipelineSparseDistBwdOpt": {"site_fqn": "ebc"},
    # Their restore points: OptStash at ebc's output dist, the others at over_arch.
    "TrainPipelineSparseDistOptStash": {"site_fqn": "ebc"},
    "TrainPipelineSparseDistEmbStash": {"site_fqn": "over_arch"},
    "TrainPipelinePrefetchEMS": {"site_fqn": "over_arch"},
}


# --------------------------------------------------------------------------
# Contenders
# --------------------------------------------------------------------------


class Contender:
    """One thing that trains (or evaluates) the model for an epoch.

    Attributes:
        key: unique id, e.g. ``"ours:TrainPipelineSparseDist"``.
        variant: the variant name, or ``"plain"`` for a plain loop.
        side: "ours", "torchrec" or "plain".
        mode: TRAIN, EVAL or STAGED.
    """

    def __init__(self, key: str, variant: str, side: str, mode: str, shimmed: bool = False) -> None:
        self.key = key
        self.variant = variant
        self.side = side
        self.mode = mode
        self.shimmed = shimmed
        self.model: Optional[nn.Module] = None
        self.optimizer: Optional[Any] = None
        self.pg: Optional[dist.ProcessGroup] = None
        # Called after every step of a pipeline contender (the memory measurement); never timed.
        self.after_step: Optional[Callable[[], None]] = None

    # The shim is on for torchrec's shimmed classes and nothing else.
    @property
    def base_variant(self) -> str:
        """The pipeline class name behind :attr:`variant` (a row label for a twin)."""
        return self.variant

    def _context(self) -> ContextManager[None]:
        if self.shimmed:
            return shim.torchrec_on_cpu()
        if shim.shim_active():
            raise RuntimeError(f"{self.key} must never run under the torchrec CPU shim")
        return contextlib.nullcontext()

    def _grad_context(self) -> ContextManager[None]:
        return torch.no_grad() if self.mode == EVAL else contextlib.nullcontext()

    def build(
        self,
        spec: ModelSpec,
        sharding_type: str,
        pg: dist.ProcessGroup,
        seed: int,
        emb_lr: float,
        dense_lr: float,
    ) -> None:
        """Build the sharded model and whatever drives it."""
        self.pg = pg
        if self.base_variant in STASH_WEIGHTS_VARIANTS:
            spec = dataclasses.replace(spec, stash_weights=True)
        with self._model_context():
            self.model, self.optimizer = make_spec_sharded(
                spec, sharding_type, pg, seed, emb_lr, dense_lr
            )
        if self.mode == EVAL:
            self.model.eval()
        with self._context():
            self._build()

    def _model_context(self) -> ContextManager[Any]:
        # Compiled autograd can't run DDP's C++ reducer, and DDP picks its
        # reducer when it is built: both libraries need the model built so.
        if self.base_variant in NEEDS_PYTHON_REDUCER:
            return torch._dynamo.config.patch(optimize_ddp="python_reducer")
        return contextlib.nullcontext()

    def _build(self) -> None:
        pass

    def run_epoch(self, batches: Sequence[Batch]) -> int:
        """Drive one epoch over ``batches``; returns the number of steps it made."""
        with self._context(), self._grad_context():
            return self._run_epoch(batches)

    def _run_epoch(self, batches: Sequence[Batch]) -> int:
        raise NotImplementedError

    def close(self) -> None:
        self.model = self.optimizer = None


# Entered around every step's forward and backward of the plain loops: one
# reusable object, not one built per step.
_NOTHING: ContextManager[None] = contextlib.nullcontext()


class PlainLoop(Contender):
    """No pipeline: per batch, copy, zero_grad, forward, backward, step (train) or forward (eval)."""

    def __init__(self, mode: str) -> None:
        super().__init__(f"plain:{mode}", "plain", "plain", mode)

    def _run_epoch(self, batches: Sequence[Batch]) -> int:
        model, optimizer = self.model, self.optimizer
        assert model is not None and optimizer is not None
        for batch in batches:
            batch = batch.to(DEVICE, non_blocking=True)
            if self.mode == EVAL:
                model(batch)
                continue
            optimizer.zero_grad()
            with self._forward_backward():
                losses, _ = model(batch)
                torch.sum(losses, dim=0).backward()
            optimizer.step()
        return len(batches)

    def _forward_backward(self) -> ContextManager[Any]:
        """What a training step's forward and backward run under (nothing here)."""
        return _NOTHING


class CompiledPlainLoop(PlainLoop):
    """The plain training loop over the compiled work of one compiled variant.

    Per-step overhead measured against the eager plain loop counts what the
    compiled code costs per call (guards, compiled autograd's capture of each
    backward): the same code in both libraries.  Against this loop, which
    runs that code with nothing around it, what is left is the pipeline's own
    bookkeeping.

    * ``TrainPipelinePT2``: the model compiled as the pipeline compiles it
      (default :class:`~trec_pipelines.TorchCompileConfig`, torchrec's dynamo
      settings held for the whole epoch, as a user sets them once);
    * ``TrainPipelineSparseDistCompAutograd``: forward and backward under
      compiled autograd with the pipeline's compiler and settings (held for
      the epoch), torchrec's collectives synchronous, DDP's Python reducer.

    Compilation happens in the untimed warm-up epoch, as for the pipelines.
    """

    def __init__(self, variant: str) -> None:
        super().__init__(TRAIN)
        self.key = f"plain:{TRAIN}+{COMPILED_PLAIN[variant]}"
        self.compiles_like = variant
        self._compiler: Any = None
        self._steps = 0  # steps run so far (PT2 compiles after compile_on_iter of them)
        self.model_compiled = False

    def _model_context(self) -> ContextManager[Any]:
        if self.compiles_like in NEEDS_PYTHON_REDUCER:
            return torch._dynamo.config.patch(optimize_ddp="python_reducer")
        return contextlib.nullcontext()

    def _build(self) -> None:
        if self.compiles_like != "TrainPipelinePT2":
            self._compiler = torch.compile(backend="inductor", dynamic=True, fullgraph=False)

    def _compile_model(self) -> None:
        # As TrainPipelinePT2 does, after compile_on_iter eager steps: DDP's
        # static graph takes its first steps on a path that does not compile.
        from trec_pipelines import TorchCompileConfig

        assert self.model is not None
        config = TorchCompileConfig()
        torch.ops.import_module("fbgemm_gpu.sparse_ops")
        self.model.compile(
            fullgraph=config.fullgraph, dynamic=config.dynamic, backend=config.backend
        )

    def _run_epoch(self, batches: Sequence[Batch]) -> int:
        if self.compiles_like != "TrainPipelinePT2":
            return self._run_compiled_autograd_epoch(batches)
        from trec_pipelines import TorchCompileConfig
        from trec_pipelines.pipelines.pt2 import dynamo_settings

        eager = (
            0 if self.model_compiled else max(0, TorchCompileConfig().compile_on_iter - self._steps)
        )
        self._steps += len(batches)
        if eager >= len(batches):  # still before the pipeline's compile_on_iter
            return super()._run_epoch(batches)
        if not self.model_compiled:  # eager steps up to compile_on_iter, then compile
            super()._run_epoch(batches[:eager])
            self._compile_model()
            self.model_compiled = True
        with dynamo_settings():
            super()._run_epoch(batches[eager:])
        return len(batches)

    def _run_compiled_autograd_epoch(self, batches: Sequence[Batch]) -> int:
        from trec_pipelines.pipelines import comp_autograd as ca

        with ca.compiled_autograd_settings(), ca._inline_ddp_for_dynamo(), ca.sync_collectives():
            return super()._run_epoch(batches)

    def _forward_backward(self) -> ContextManager[Any]:
        if self._compiler is None:  # PT2: the model itself is compiled
            return _NOTHING
        return torch._dynamo.compiled_autograd._enable(self._compiler)


class PipelineContender(Contender):
    """A pipeline class (ours or torchrec's) driven through ``progress()``."""

    def __init__(self, variant: Variant, side: str) -> None:
        shimmed = side == "torchrec" and variant.shimmed
        super().__init__(f"{side}:{variant.name}", variant.name, side, variant.mode, shimmed)
        cls = variant.ours if side == "ours" else variant.theirs
        assert cls is not None
        self.info = variant
        self.cls: type = cls
        self.pipeline: Any = None
        # Constructor arguments on top of VARIANT_KWARGS (the memory options runs, twins).
        self.extra_kwargs: Dict[str, Any] = {}

    @property
    def base_variant(self) -> str:
        return self.info.name

    @property
    def input_dist_group(self) -> Optional[str]:
        """The input_dist_group it runs with (None: the class has no such option)."""
        if not takes_input_dist_group(self):
            return None
        default = "dedicated" if self.side == "ours" else "shared"  # torchrec: the model's group
        return str(self.extra_kwargs.get("input_dist_group", default))

    def _build(self) -> None:
        kwargs = {**VARIANT_KWARGS.get(self.base_variant, {}), **self.extra_kwargs}
        self.pipeline = self.cls(self.model, self.optimizer, DEVICE, **kwargs)

    def _run_epoch(self, batches: Sequence[Batch]) -> int:
        pipeline = self.pipeline
        it = iter(batches)
        steps = 0
        limit = len(batches) + 8  # a pipeline that never stops is a failure, not a hang
        while steps <= limit:
            try:
                pipeline.progress(it)
            except StopIteration:
                break
            steps += 1
            if self.after_step is not None:
                self.after_step()
        else:
            raise RuntimeError(f"{self.key} did not raise StopIteration after {limit} steps")
        pipeline.reset()
        if steps != len(batches):
            raise RuntimeError(f"{self.key} made {steps} steps over {len(batches)} batches")
        return steps

    def close(self) -> None:
        if self.pipeline is not None:
            with self._context(), contextlib.suppress(Exception):
                self.pipeline.reset()
        self.pipeline = None
        super().close()


class StagedContender(PipelineContender):
    """``StagedTrainPipeline``: stages H2D and input dist; the loop trains on what it returns.

    Each library builds the stages from its own helpers (``PipelineStage`` and
    ``SparseDataDistUtil``); ours must export them next to the pipeline.
    """

    def __init__(self, variant: Variant, side: str) -> None:
        super().__init__(variant, side)
        # Set for the recorded epoch only (benchmarks/running/recording.py): wraps each
        # part of the loop's step, (task, batch index), so its timeline shows them.
        self.step_span: Optional[Callable[[str, int], ContextManager[Any]]] = None

    def _helpers(self) -> Tuple[Any, Any]:
        if self.side == "torchrec":
            from torchrec.distributed.train_pipeline.pipeline_stage import (
                PipelineStage,
                SparseDataDistUtil,
            )

            return PipelineStage, SparseDataDistUtil
        stage = _ours("PipelineStage", self.cls.__module__)
        util = _ours("SparseDataDistUtil", self.cls.__module__)
        if stage is None or util is None:
            raise RuntimeError(
                "trec_pipelines exports StagedTrainPipeline but the benchmark can't find its "
                "PipelineStage and SparseDataDistUtil (looked in trec_pipelines and its pipelines modules)"
            )
        return stage, util

    def _build(self) -> None:
        stage_cls, util_cls = self._helpers()
        # A real torch.Stream object (on CPU too, so code that reads .device works).
        copy_stream = torch.Stream(device=DEVICE)
        # input_dist_group is SparseDataDistUtil's option; the rest go to the pipeline.
        util_kwargs = {k: v for k, v in self.extra_kwargs.items() if k == "input_dist_group"}
        pipeline_kwargs = {k: v for k, v in self.extra_kwargs.items() if k not in util_kwargs}
        self._sdd = util_cls(
            model=self.model, data_dist_stream=torch.Stream(device=DEVICE), **util_kwargs
        )
        stages = [
            stage_cls(name="data_copy", runnable=_to_device, stream=copy_stream),
            stage_cls(
                name="start_sparse_data_dist",
                runnable=self._sdd.start_sparse_data_dist,
                stream=self._sdd.data_dist_stream,
                fill_callback=self._sdd.wait_sdd_fill_callback,
            ),
        ]
        # torchrec would otherwise ask torch.cpu for a "current stream" that has no .device.
        self.pipeline = self.cls(
            pipeline_stages=stages, compute_stream=torch.Stream(device=DEVICE), **pipeline_kwargs
        )

    def _run_epoch(self, batches: Sequence[Batch]) -> int:
        model, optimizer, pipeline = self.model, self.optimizer, self.pipeline
        assert model is not None and optimizer is not None
        it = iter(batches)
        steps = 0
        while steps <= len(batches) + 8:
            batch = pipeline.progress(it)
            if batch is None:
                break
            if self.after_step is not None:
                self.after_step()
            if self.step_span is not None:
                self._spanned_step(batch, steps)
            else:
                optimizer.zero_grad()
                losses, _ = model(batch)
                torch.sum(losses, dim=0).backward()
                optimizer.step()
            steps += 1
        if self.side == "torchrec":
            # torchrec's pipeline never fills again after returning None;
            # flush_end() is its public way to make it (ours starts a new epoch by itself).
            pipeline.flush_end()
        if steps != len(batches):
            raise RuntimeError(f"{self.key} made {steps} steps over {len(batches)} batches")
        return steps

    def _spanned_step(self, batch: Batch, index: int) -> None:
        """The loop's step, each part in a ``step_span`` (the recorded epoch's timeline)."""
        model, optimizer, span = self.model, self.optimizer, self.step_span
        assert model is not None and optimizer is not None and span is not None
        with span(tasks.ZERO_GRAD, index):
            optimizer.zero_grad()
        with span(tasks.FORWARD, index):
            losses, _ = model(batch)
        with span(tasks.BACKWARD, index):
            torch.sum(losses, dim=0).backward()
        with span(tasks.OPTIMIZER_STEP, index):
            optimizer.step()

    def close(self) -> None:
        self.pipeline = None
        Contender.close(self)


def _ours(name: str, home_module: str) -> Any:
    """``name`` from trec_pipelines: exported, in the module of the class, or any loaded pipelines module."""
    import trec_pipelines

    found = getattr(trec_pipelines, name, None)
    if found is not None:
        return found
    import pkgutil

    import trec_pipelines.pipelines as package

    candidates = [home_module] + [
        f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)
    ]
    for module_name in candidates:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found = getattr(module, name, None)
        if found is not None:
            return found
    return None


def _to_device(batch: Batch) -> Batch:
    return batch.to(DEVICE, non_blocking=True)


def make_contender(variant: Variant, side: str) -> Contender:
    if variant.mode == STAGED:
        return StagedContender(variant, side)
    return PipelineContender(variant, side)


def takes_input_dist_group(contender: "PipelineContender") -> bool:
    """Whether ``contender``'s class (Staged: its SparseDataDistUtil) has ``input_dist_group``."""
    if contender.side != "ours":
        return False
    cls = contender.cls
    if isinstance(contender, StagedContender):
        cls = contender._helpers()[1]
    return "input_dist_group" in inspect.signature(cls).parameters


def group_twin(contender: "PipelineContender", group: str) -> "PipelineContender":
    """Our ``contender`` again with ``input_dist_group=group``, as its own row
    (variant label ``"<Variant> [<group>]"``, key ``"ours:<label>"``)."""
    twin = make_contender(contender.info, "ours")
    assert isinstance(twin, PipelineContender)
    twin.variant = f"{contender.info.name} [{group}]"
    twin.key = f"ours:{twin.variant}"
    twin.extra_kwargs = {"input_dist_group": group}
    return twin


# --------------------------------------------------------------------------
# The stage probe: SparseDist's stages timed one at a time
# --------------------------------------------------------------------------
