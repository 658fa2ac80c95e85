"""How much code one steady-state training step runs: the read path, ours against torchrec's.

A reader who follows one ``progress()`` call from top to bottom reads every
function it runs.  For one pipeline class this module runs the 4th
``progress()`` (the pipeline is full by then: a steady-state step) on the
sharded test DLRM under :func:`sys.setprofile`, and counts

* the distinct functions of the package that ran (code objects whose file is
  under the package; property getters count, comprehensions, generator
  expressions and lambdas do not: they are read as part of their function;
  the test model under ``trec_pipelines/testing`` does not either: it is the
  user's code, not the pipeline's),
* the distinct files those functions live in,
* every call the step makes, Python and C, ours, torchrec's and the model's
  alike (the calls per step),

then does the same for torchrec's class of the same name (functions under
``torchrec/distributed/train_pipeline``).  It also reads two static shapes of
the class: its private names (``dir()``, dunders left out) and the length of
its MRO.  Needs the default process group (2 ranks, gloo on CPU)::

    PYTHONPATH=$PWD TREC_DEVICE=cpu .venv/bin/torchrun --standalone --nproc_per_node=2 \\
        -m benchmarks.measuring.read_path [ClassName ...]

Rank 0 prints the table.  The numbers describe a step; no test holds them.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

# Code objects that are part of the function that defines them, not functions a reader follows.
_INLINE = ("<listcomp>", "<genexpr>", "<lambda>", "<dictcomp>", "<setcomp>")
# The call measured: the first three fill the pipeline.
STEADY_CALL = 4


@dataclass(frozen=True)
class ReadPath:
    """One class's read path: the functions one steady-state step runs, and its shape."""

    name: str
    functions: Optional[int]  # None: the class could not run its step here
    files: Optional[int]
    private_names: int
    mro: int
    function_names: Tuple[str, ...] = ()
    calls: Optional[int] = None  # every call of the step, Python and C


def private_names(cls: type) -> List[str]:
    """The class's private names as ``dir()`` lists them, dunders left out."""
    return [
        n for n in dir(cls) if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))
    ]


class _Calls:
    """Collects the code objects called under ``root``, and counts every call, while
    active (this thread and new ones)."""

    def __init__(self, root: str) -> None:
        self.root = root
        # The test model lives in the package but is the user's code, not the pipeline's.
        self.skip = os.path.join(root, "testing") + os.sep
        self.codes: Set[CodeType] = set()
        self.calls = 0

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            self.calls += 1
        if event == "call":
            code = frame.f_code
            name = code.co_filename
            if (
                code.co_name not in _INLINE
                and name.startswith(self.root)
                and not name.startswith(self.skip)
            ):
                self.codes.add(code)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)
        try:
            yield
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]

    def names(self) -> Tuple[str, ...]:
        out = []
        for code in self.codes:
            rel = os.path.relpath(code.co_filename, self.root)
            out.append(f"{rel}:{getattr(code, 'co_qualname', code.co_name)}")
        return tuple(sorted(out))


def _root(module: Any) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


def ours_root() -> str:
    import trec_pipelines

    return _root(trec_pipelines)


def torchrec_root() -> str:
    import torchrec.distributed.train_pipeline as tp

    return _root(tp)


def count_step(step: Callable[[], Any], root: str) -> Tuple[int, int, Tuple[str, ...], int]:
    """Run ``step`` once under the profiler: (functions, files, their names) under
    ``root``, and every call the step made."""
    calls = _Calls(root)
    with calls.active():
        step()
    files = {code.co_filename for code in calls.codes}
    return len(calls.codes), len(files), calls.names(), calls.calls


# ------------------------------------------------------------------ builders


def _sparse_dist_like(cls: type, count: int, **kwargs: Any) -> Tuple[Any, Callable[[], Any]]:
    from trec_pipelines.testing import devices
    from trec_pipelines.testing.dlrm import DLRM, make_batches, make_sharded

    batches = make_batches(count, seed=7)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=1234)
    pipeline = cls(dmp, optimizer, devices.device(), **kwargs)
    it = iter(batches)
    return pipeline, lambda: pipeline.progress(it)


def _staged(cls: type, sdd_cls: type, stage_cls: type, count: int) -> Tuple[Any, Callable[[], Any]]:
    from trec_pipelines.testing import devices
    from trec_pipelines.testing.dlrm import DLRM, make_batches, make_sharded

    batches = make_batches(count, seed=7)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=1234)
    device = devices.device()
    sdd = sdd_cls(dmp, data_dist_stream=None)
    stages = [
        stage_cls("h2d", lambda batch: batch.to(device, non_blocking=True), None),
        sdd.start_sparse_data_dist_stage(),
    ]
    pipeline = cls(stages)
    it = iter(batches)

    def step() -> Any:
        # The stages hand over a batch; the user's loop trains it, as the plain loop does.
        batch = pipeline.progress(it)
        optimizer.zero_grad()
        losses, pred = dmp(batch)
        torch.sum(losses, dim=0).backward()
        optimizer.step()
        return pred

    return pipeline, step


def plain_loop(batches: int = STEADY_CALL + 4) -> Callable[[], Any]:
    """One step of the plain loop a call, over the batches :func:`build`'s pipelines
    train: pull the batch, copy it to the device, ``zero_grad``, forward,
    ``torch.sum(losses, dim=0).backward()``, ``step``."""
    from trec_pipelines.testing import devices
    from trec_pipelines.testing.dlrm import DLRM, make_batches, make_sharded

    model, optimizer = make_sharded(DLRM, "table_wise", seed=1234)
    model.train()
    device = devices.device()
    it = iter(make_batches(batches, seed=7))

    def step() -> Any:
        batch = next(it).to(device, non_blocking=True)
        optimizer.zero_grad()
        losses, output = model(batch)
        torch.sum(losses, dim=0).backward()
        optimizer.step()
        return output

    return step


def _torchrec_stages() -> Any:
    import torchrec.distributed.train_pipeline.pipeline_stage as stages

    return stages


def _torchrec_classes() -> Any:
    import torchrec.distributed.train_pipeline.train_pipelines as classes

    return classes


def build(module: Any, name: str, batches: int = STEADY_CALL + 4) -> Tuple[Any, Callable[[], Any]]:
    """A pipeline of class ``name`` from ``module`` (ours or torchrec's) on the test
    DLRM, and its step (a ``progress()`` call; Staged: and the user's training of the
    batch it hands over: forward, backward, optimizer step), over ``batches`` batches."""
    cls = getattr(module, name)
    if name == "StagedTrainPipeline":
        stages = _torchrec_stages() if module.__name__.startswith("torchrec") else module
        return _staged(cls, stages.SparseDataDistUtil, stages.PipelineStage, batches)
    kwargs: Dict[str, Any] = {"start_batch": 0} if name == "TrainPipelineSemiSync" else {}
    return _sparse_dist_like(cls, batches, **kwargs)


# torchrec's classes that call CUDA stream APIs on CPU: run under the test shim.
_SHIMMED = {
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "PrefetchTrainPipelineSparseDist",
    "StagedTrainPipeline",
}


def _measure_one(module: Any, name: str, root: str, shim: bool) -> ReadPath:
    from trec_pipelines.testing.torchrec_cpu import torchrec_on_cpu

    cls = getattr(module, name)
    functions: Optional[int] = None
    files: Optional[int] = None
    names: Tuple[str, ...] = ()
    calls: Optional[int] = None
    # An earlier pipeline left for the collector notes a wrapper change when it
    # is collected: inside the counted step that adds its finalizer, and before
    # it the step takes the slow path that looks for a new owner.  Collect it
    # now and keep the collector off until the step has been counted.
    gc.collect()
    gc.disable()
    with torchrec_on_cpu() if shim else contextlib.nullcontext():
        try:
            _, step = build(module, name)
            for _ in range(STEADY_CALL - 1):
                step()
            functions, files, names, calls = count_step(step, root)
        except Exception as error:  # noqa: BLE001 -- torchrec's class may not run on CPU
            print(
                f"{name} ({module.__name__}): no step on this device: {error!r:.120}",
                file=sys.stderr,
            )
        finally:
            gc.enable()
    mro = len(cls.__mro__)
    return ReadPath(name, functions, files, len(private_names(cls)), mro, names, calls)


def measure_ours(name: str) -> ReadPath:
    """Our class ``name``'s read path."""
    import trec_pipelines

    return _measure_one(trec_pipelines, name, ours_root(), shim=False)


def measure(name: str) -> Tuple[ReadPath, Optional[ReadPath]]:
    """Ours and torchrec's (None where torchrec has no such class) read path for ``name``."""
    import trec_pipelines

    upstream = _torchrec_classes()

    ours = _measure_one(trec_pipelines, name, ours_root(), shim=False)
    theirs = None
    if hasattr(upstream, name):
        theirs = _measure_one(upstream, name, torchrec_root(), shim=name in _SHIMMED)
    return ours, theirs


CLASSES = (
    "TrainPipelineBase",
    "TrainPipelineSparseDist",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "PrefetchTrainPipelineSparseDist",
    "StagedTrainPipeline",
)


def _cell(value: Optional[int]) -> str:
    return "-" if value is None else str(value)


def table(rows: Sequence[Tuple[ReadPath, Optional[ReadPath]]]) -> str:
    """A markdown table: per class, ours and torchrec's numbers side by side."""
    head = (
        "| class | functions, ours | functions, torchrec | files, ours | files, torchrec "
        "| private names, ours | private names, torchrec | MRO, ours | MRO, torchrec "
        "| calls, ours | calls, torchrec |"
    )
    lines = [head, "|" + "---|" * 11]
    for ours, theirs in rows:
        t = theirs
        lines.append(
            f"| `{ours.name}` | {_cell(ours.functions)} | {_cell(t and t.functions)} "
            f"| {_cell(ours.files)} | {_cell(t and t.files)} | {ours.private_names} "
            f"| {_cell(t and t.private_names)} | {ours.mro} | {_cell(t and t.mro)} "
            f"| {_cell(ours.calls)} | {_cell(t and t.calls)} |"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def measuring_world(
    argv: Sequence[str], classes: Sequence[str]
) -> Iterator[Tuple[bool, List[str]]]:
    """The default process group for a measuring tool run under torchrun (one torch
    thread per rank), destroyed at the end; yields whether this rank prints (rank 0)
    and the classes to measure: those ``argv`` names (``-v`` aside), else ``classes``."""
    import torch.distributed as dist

    from trec_pipelines.testing import devices

    torch.set_num_threads(1)
    devices.bind()
    dist.init_process_group(backend=devices.backend())
    try:
        yield dist.get_rank() == 0, [n for n in argv if n != "-v"] or list(classes)
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str]) -> None:
    with measuring_world(argv, CLASSES) as (prints, names):
        rows = [measure(name) for name in names]
        if prints:
            print(table(rows))
            if "-v" in argv:
                for ours, _ in rows:
                    print(f"\n{ours.name}:")
                    print("\n".join(f"  {n}" for n in ours.function_names))


if __name__ == "__main__":
    main(sys.argv[1:])
