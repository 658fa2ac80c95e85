"""Where one steady-state step's calls go: the package's own parts against a plain loop.

For each train pipeline class this module runs the 4th ``progress()`` (a
steady-state step, as :mod:`benchmarks.measuring.read_path`) on the sharded
test DLRM under :func:`sys.setprofile`, counts every call the step makes
(Python and C, as ``read_path`` does: the totals match its calls per step),
and gives each call to a *part*.  It does the same for one step of the plain
loop of :func:`trec_pipelines.testing.dlrm.plain_loop` on the same model and
batches (pull the batch, copy it to the device, ``zero_grad``, forward,
``torch.sum(losses, dim=0).backward()``, ``step``), whose calls are all the
work a training loop does with no pipeline.

The rule that gives a call its part.  Look at the stack from the call
outwards, up to the step:

* the innermost frame of the package on it (code under ``trec_pipelines/``;
  the test model under ``trec_pipelines/testing`` is the user's code, not
  ours) names the part, by the module that frame's function lives in (see
  :data:`PARTS`; the callee itself counts when it is ours);
* the call is the part's **own** when that frame of ours made it (a function
  of ours, a C call of ours, or the entry into a torch/torchrec/model
  function), and **in library** when it was made inside a torch, torchrec or
  model function that the part called (the model's forward under the
  timeline's forward, the KJT's ``to()`` under the copy, torchrec's
  ``input_dist`` under ours);
* a call with no frame of ours on the stack is **plain**: the driver's own
  calls, all of the plain loop's.

So ``own`` is the package's own Python work, and ``in library`` is what it
asked torch, torchrec and the model to do, which holds the work the plain loop
does too (the forward, the backward, the optimizer, the copy, the input
distribution) plus any extra.  "added over plain" is the pipeline's total
minus the plain loop's.  Needs the default process group (2 ranks, gloo on CPU)::

    PYTHONPATH=$PWD TREC_DEVICE=cpu .venv/bin/torchrun --standalone --nproc_per_node=2 \\
        -m benchmarks.measuring.step_profile [ClassName ...]

Rank 0 prints the tables.  Deterministic call counts, not time; no test holds them.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from benchmarks.measuring.read_path import (
    STEADY_CALL,
    build,
    measuring_world,
    ours_root,
    plain_loop,
)

# The part each module of the package belongs to, by path prefix under the package
# (the first that matches wins); anything else of ours is "other-ours".
PARTS: Tuple[Tuple[str, str], ...] = (
    ("data/agreement.py", "agreement"),
    ("sparse/carried_agreement.py", "agreement"),
    ("data/validation.py", "validation"),
    ("data/", "batch source"),
    ("core/streams.py", "copy"),
    ("sparse/input_dist", "input dist"),
    ("core/input_dist_group.py", "input dist"),
    ("model/context.py", "contexts"),
    ("sparse/forwards.py", "forward wrappers"),
    ("sparse/lookup.py", "forward wrappers"),
    ("sparse/deferred_lookup.py", "forward wrappers"),
    ("model/args.py", "forward wrappers"),
    ("core/step_guard.py", "step guard / peer failure"),
    ("core/peer_failure.py", "step guard / peer failure"),
    ("core/errors.py", "step guard / peer failure"),
    ("observe/", "recording"),
    ("pipelines/", "timeline"),
    ("assembly/pipeline.py", "timeline"),
    ("core/model_step.py", "timeline"),
)
PLAIN = "plain (no frame of ours)"
ORDER = tuple(dict.fromkeys(part for _, part in PARTS)) + ("other-ours", PLAIN)


def part_of(relpath: str) -> str:
    """The part of the package's module at ``relpath`` (relative to the package)."""
    for prefix, part in PARTS:
        if relpath.startswith(prefix):
            return part
    return "other-ours"


@dataclass
class Profile:
    """One step's calls: per part, its own and those made inside library code it called."""

    name: str
    own: Counter[str] = field(default_factory=Counter)
    library: Counter[str] = field(default_factory=Counter)
    # Per function of ours (module:qualname), its own calls: where a part's count comes from.
    functions: Counter[str] = field(default_factory=Counter)
    # Per function of ours, the calls made inside library code it called.
    functions_library: Counter[str] = field(default_factory=Counter)
    error: Optional[str] = None

    @property
    def total(self) -> int:
        return sum(self.own.values()) + sum(self.library.values())


def _function(frame: FrameType, rel: str) -> str:
    code = frame.f_code
    return f"{rel}:{getattr(code, 'co_qualname', code.co_name)}"


class _Attributor:
    """The profile function: gives each call of the step to a part (module docstring)."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.root = ours_root()
        self.skip = os.path.join(self.root, "testing") + os.sep
        self._ours: Dict[str, Optional[str]] = {}  # file -> path relative to the package, or None

    def _relpath(self, frame: FrameType) -> Optional[str]:
        name = frame.f_code.co_filename
        rel = self._ours.get(name, "")
        if rel == "":
            ours = name.startswith(self.root) and not name.startswith(self.skip)
            rel = os.path.relpath(name, self.root) if ours else None
            self._ours[name] = rel
        return rel

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "c_call"):
            return
        # The frame that made the call: for a Python call its caller, for a C call the frame itself.
        if event == "call":
            rel = self._relpath(frame)
            if rel is not None:  # a function of ours
                self._count_own(frame, rel)
                return
            caller = frame.f_back
        else:
            caller = frame
        if caller is None:
            self.profile.own[PLAIN] += 1
            return
        rel = self._relpath(caller)
        if rel is not None:  # made by a frame of ours
            self._count_own(caller, rel)
            return
        outer: Optional[FrameType] = caller.f_back
        while outer is not None:
            rel = self._relpath(outer)
            if rel is not None:
                self.profile.library[part_of(rel)] += 1
                self.profile.functions_library[_function(outer, rel)] += 1
                return
            outer = outer.f_back
        self.profile.own[PLAIN] += 1

    def _count_own(self, frame: FrameType, rel: str) -> None:
        self.profile.own[part_of(rel)] += 1
        self.profile.functions[_function(frame, rel)] += 1

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        threading.setprofile(self)
        sys.setprofile(self)
        try:
            yield
        finally:
            sys.setprofile(None)
            threading.setprofile(None)


def profile_step(name: str, make_step: Callable[[], Callable[[], Any]]) -> Profile:
    """Profile the 4th call of the step ``make_step()`` returns."""
    profile = Profile(name)
    # As read_path: collect an earlier pipeline now, and keep the collector off
    # until the step has been counted (a finalizer would run inside it).
    gc.collect()
    gc.disable()
    try:
        step = make_step()
        for _ in range(STEADY_CALL - 1):
            step()
        with _Attributor(profile).active():
            step()
    except Exception as error:  # noqa: BLE001 -- a variant may not run on this device
        profile.error = f"{error!r:.160}"
    finally:
        gc.enable()
    return profile


def _pipeline_step(name: str) -> Callable[[], Callable[[], Any]]:
    import trec_pipelines

    return lambda: build(trec_pipelines, name)[1]


CLASSES = (
    "TrainPipelineBase",
    "TrainPipelineSparseDist",
    "TrainPipelineSparseDistLite",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "PrefetchTrainPipelineSparseDist",
    "StagedTrainPipeline",
    "TrainPipelinePT2",
    "TrainPipelineSparseDistCompAutograd",
)


def table(profile: Profile, plain: Profile) -> str:
    """A markdown table of one class's step: part -> own calls, in library, total."""
    lines = [
        f"### `{profile.name}`",
        "",
        "| part | own | in library | total |",
        "|---|---|---|---|",
    ]
    for part in ORDER:
        own, lib = profile.own[part], profile.library[part]
        if own or lib:
            lines.append(f"| {part} | {own} | {lib} | {own + lib} |")
    lines.append(f"| **pipeline total** | | | **{profile.total}** |")
    lines.append(f"| plain loop total | | | {plain.total} |")
    lines.append(f"| **added over plain** | | | **{profile.total - plain.total}** |")
    return "\n".join(lines)


def summary(rows: Sequence[Profile], plain: Profile) -> str:
    """One line per class: its total, the plain loop's and what the pipeline adds."""
    lines = [
        "| class | calls per step | plain loop | added over plain | own calls of ours |",
        "|---|---|---|---|---|",
    ]
    for p in rows:
        if p.error is not None:
            lines.append(f"| `{p.name}` | - | {plain.total} | - | - |")
            continue
        ours = sum(n for part, n in p.own.items() if part != PLAIN)
        lines.append(
            f"| `{p.name}` | {p.total} | {plain.total} | {p.total - plain.total} | {ours} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    with measuring_world(argv, CLASSES) as (prints, names):
        plain = profile_step("plain loop", plain_loop)
        rows: List[Profile] = [profile_step(name, _pipeline_step(name)) for name in names]
        if prints:
            print(summary(rows, plain))
            for p in rows:
                print()
                if p.error is not None:
                    print(f"### `{p.name}`: no step on this device: {p.error}")
                    continue
                print(table(p, plain))
                if "-v" in argv:
                    print("\n    own calls, by the function of ours that made them:")
                    for function, n in p.functions.most_common():
                        print(f"    {n:5d}  {function}")
                    print("\n    calls inside library code, by the function of ours under them:")
                    for function, n in p.functions_library.most_common():
                        print(f"    {n:5d}  {function}")


if __name__ == "__main__":
    main(sys.argv[1:])
