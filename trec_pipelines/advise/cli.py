"""The command line of advise: ``python -m trec_pipelines.advise --build pkg.module:function``.

Run directly, it launches itself under torchrun (``--nproc`` ranks) as
``make bench`` does; under torchrun (``RANK`` set) it is one rank: it starts
the process group, imports ``build``, runs :func:`~trec_pipelines.advise`,
and rank 0 prints the table and writes ``advice.json`` and ``advice.png``
(when matplotlib is installed: what the outputs need is checked before
anything is measured, :func:`output_needs`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from typing import Any, Callable, List, Optional, Sequence, Tuple, cast

from trec_pipelines.advise.budget import DEFAULT_TIME_BUDGET

DESCRIPTION = """\
Which pipeline for my model?  Builds your model once per variant and round
(never two at once), trains each applicable train variant of trec_pipelines
and a plain loop on the same batches, and answers one of three:

  recommend X          X is more than 2% faster than the plain loop beyond the
                       noise, no variant is more than 2% faster than X, and X
                       holds the least of those that qualify (within
                       --memory-budget; never one that left a sharded module
                       unpipelined when another did not);
  keep your plain loop no variant is more than 2% faster than it, beyond the noise;
  cannot tell          the --time-budget ran out before the epochs were long
                       enough to time (0.5 s) or the rounds settled the
                       differences that decide; or, whatever the budget, a
                       variant's spread against the plain loop is wider than
                       2%: it names the fastest variant seen and what to re-run
                       with (the rounds, or the budget that would let it go on).

Within --time-budget it lengthens the timed epochs until they are long
enough to time (cycling your batches, in the same order for every contender,
when they end first) and adds rounds while the noise leaves the answer open.
Variants within the noise of each other are an answer: either will do, so
the one holding least (or the plain loop, when no variant is faster than it
beyond the noise) -- unless a variant's spread against the plain loop is
wider than 2%: then it cannot tell yet.  The output says how long the epochs were, how many
times the batches were cycled, and the time taken.

--build names a function of yours, importable from the current directory,
that takes no arguments and returns (model, optimizer, batches): a
DMP-sharded model whose forward returns (loss, output), its optimizer, and a
list (or a DataLoader) of this rank's batches, the same ones on every call
(fewer than an epoch needs are cycled).  It runs on every rank, inside the
process group this command starts.

Output: a table of the applicable variants (QPS, ratio to the plain loop
with its spread, bytes the pipeline holds by its memory ledger, peak
resident and device memory, how much of the input dist each hides, modules
left unpipelined, failures), the others in one line, the verdict in one
sentence, and advice.json + advice.png (ratio to the plain loop against held
memory, with the rounds' spread) in --out.  The PNG needs matplotlib, which
is not a dependency: without it advise says so once, before measuring, and
writes the table and the JSON (every number is there).

It also prints where your model sits on the performance guide's regime
map: its bytes per step on the link by kind (the input dist's ids, the
output dist's embeddings, the gradient all-reduce), from its shapes, and
what they imply at 1 and 10 Gbit/s (advise itself runs on this machine's
link, often the loopback).
"""

EXAMPLES = """\
examples:
  python -m trec_pipelines.advise --build mymodels.dlrm:build
  python -m trec_pipelines.advise --build mymodels.dlrm:build --memory-budget 64MiB --rounds 5
  python -m trec_pipelines.advise --build mymodels.dlrm:build --time-budget 600   # a large model
  python -m trec_pipelines.advise --build benchmarks.advise_build:build   # the bench's DLRM, from the repo
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trec_pipelines.advise",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--build",
        required=True,
        metavar="MODULE:FUNCTION",
        help="your factory: a function of no arguments returning (model, optimizer, batches)",
    )
    _add_measure_arguments(p)
    _add_launch_arguments(p)
    return p


def _add_measure_arguments(p: argparse.ArgumentParser) -> None:
    """What to measure: the epochs, the rounds, the budgets and the variants."""
    p.add_argument(
        "--steps",
        type=int,
        default=20,
        help=(
            "the fewest batches per timed epoch (default 20); advise lengthens the epoch, "
            "cycling your batches, until it lasts long enough to time (0.5 s or more)"
        ),
    )
    p.add_argument(
        "--warmup", type=int, default=5, help="untimed batches before it, same model (default 5)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help=(
            "times every contender is built and timed at least; the result is the median "
            "(default 3, the fewest that can give a verdict); more are added while the noise "
            "leaves the answer open, within --time-budget"
        ),
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=DEFAULT_TIME_BUDGET,
        metavar="SECONDS",
        help=(
            f"seconds the whole run may take (default {DEFAULT_TIME_BUDGET:.0f}: enough for a small "
            "model; give a large one more); 0 times exactly --steps and --rounds. "
            "The --rounds asked for are always measured"
        ),
    )
    p.add_argument(
        "--memory-budget",
        default=None,
        metavar="BYTES",
        help="most a pipeline may hold beyond model and optimizer, e.g. 64MiB, 1.5GiB, 500MB (default: no budget)",
    )
    p.add_argument(
        "--variants",
        default=None,
        metavar="NAME,NAME",
        help="class names to time, comma-separated (default: every applicable one)",
    )
    p.add_argument(
        "--include-compiled",
        action="store_true",
        help="also time TrainPipelinePT2 and TrainPipelineSparseDistCompAutograd (they compile: minutes)",
    )


def _add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """How to run: the ranks, the device, the threads, and where the results go."""
    p.add_argument("--nproc", type=int, default=2, help="ranks to launch (default 2)")
    p.add_argument(
        "--backend", default="gloo", help="the process group's backend (default gloo; nccl on GPUs)"
    )
    p.add_argument(
        "--device",
        default=None,
        help="where the model trains (default: its first parameter's device; 'cuda' means cuda:<LOCAL_RANK>)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument(
        "--out",
        default=None,
        help="directory for advice.json and advice.png (default advise-results/<UTC time>)",
    )
    p.add_argument(
        "--no-plot",
        action="store_true",
        help="no PNG (it needs matplotlib; without it there is none either, with a warning)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def load_build(spec: str) -> Callable[[], Any]:
    """The function ``module:function`` names, with an error that says what went wrong."""
    module_name, _, function = spec.partition(":")
    if not module_name or not function:
        raise SystemExit(
            f"--build {spec!r}: give it as module.path:function, e.g. mymodels.dlrm:build"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SystemExit(
            f"--build {spec!r}: cannot import {module_name!r} ({exc}); run from the directory that holds it, "
            "or put it on PYTHONPATH"
        ) from exc
    build = getattr(module, function, None)
    if not callable(build):
        raise SystemExit(f"--build {spec!r}: {module_name} has no function {function!r}")
    return cast(Callable[[], Any], build)


def launch(argv: Sequence[str], nproc: int, threads: int) -> int:
    """This command again, under torchrun, with the current directory importable."""
    env = dict(os.environ)
    cwd = os.getcwd()
    env["PYTHONPATH"] = cwd + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "trec_pipelines.advise",
        *_without_nproc(argv),
    ]
    print(f"launching {nproc} ranks under torchrun: {' '.join(command)}", flush=True)
    return subprocess.run(command, env=env, cwd=cwd).returncode


def _without_nproc(argv: Sequence[str]) -> List[str]:
    """``argv`` less ``--nproc``: torchrun would take it for its own ``--nproc-per-node``."""
    out: List[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


class _Bar:
    """A tqdm bar on rank 0 (tqdm comes with torchrec); silent elsewhere."""

    def __init__(self, enabled: bool) -> None:
        self.bar: Any = None
        if enabled:
            # tqdm ships no type stubs: looked up by name, it is Any to mypy.
            tqdm = importlib.import_module("tqdm").tqdm
            self.bar = tqdm(total=1, unit="run", dynamic_ncols=True)

    def __call__(self, label: str, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.total = total
            self.bar.set_description(label[:48], refresh=False)
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def worker(args: argparse.Namespace) -> int:
    import logging
    import warnings

    import torch
    import torch.distributed as dist

    from trec_pipelines.advise.run import advise

    torch.set_num_threads(args.threads)
    rank = int(os.environ["RANK"])
    if rank != 0:
        logging.getLogger("trec_pipelines").setLevel(logging.ERROR)
    for category in (FutureWarning, UserWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    for name in ("torchrec", "torch", "fbgemm_gpu"):
        logging.getLogger(name).setLevel(logging.ERROR)
    device = None
    if args.device is not None:
        device = torch.device(args.device)
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, int(os.environ.get("LOCAL_RANK", "0")))
            torch.get_device_module(device).set_device(device)
    dist.init_process_group(backend=args.backend)
    plot, out = _agreed_outputs(args, rank)
    build = load_build(args.build)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else None
    bar = _Bar(rank == 0 and not args.no_progress)
    try:
        advice = advise(
            build,
            steps=args.steps,
            warmup=args.warmup,
            rounds=args.rounds,
            memory_budget=args.memory_budget,
            variants=variants,
            include_compiled=args.include_compiled,
            device=device,
            progress=bar,
            time_budget=args.time_budget,
        )
    finally:
        bar.close()
    if rank == 0:
        print("\n" + advice.table(), flush=True)
        advice.write_json(
            os.path.join(out, "advice.json"), extra={"build": args.build, "argv": sys.argv[1:]}
        )
        written = ["advice.json"]
        if plot:
            advice.save_plot(os.path.join(out, "advice.png"))
            written.append("advice.png")
        print(f"results: {out}/ ({', '.join(written)})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


MATPLOTLIB_MISSING = (
    "advise: matplotlib is not installed, so advice.png is left out (the table and "
    "advice.json have every number); `pip install matplotlib` for the picture, or --no-plot "
    "to leave it out without this warning"
)


def output_needs(args: argparse.Namespace) -> Tuple[bool, str, Optional[str]]:
    """What the outputs need, checked before anything is measured: ``(plot, out, error)``.

    ``plot``: the PNG is wanted and matplotlib is there to draw it (when it is
    not, a warning says so once and the run goes on: the picture is optional);
    ``out``: the results directory (``--out``, or ``advise-results/<UTC
    time>``), created here; ``error``: why the run cannot write its results
    (None: it can), so that it stops in seconds rather than after measuring.
    """
    plot = not args.no_plot
    if plot and importlib.util.find_spec("matplotlib") is None:
        print(MATPLOTLIB_MISSING, file=sys.stderr, flush=True)
        plot = False
    out = args.out or os.path.join(
        "advise-results",
        datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d_%H%M%S"),
    )
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        return (
            plot,
            out,
            (
                f"advise: cannot write the results to {out!r} ({exc}); give --out a directory "
                "you can write to"
            ),
        )
    return plot, out, None


def _agreed_outputs(args: argparse.Namespace, rank: int) -> Tuple[bool, str]:
    """Rank 0's :func:`output_needs`, shared with every rank: all go on, or all stop now."""
    import torch.distributed as dist

    decided: List[Any] = [output_needs(args) if rank == 0 else None]
    dist.broadcast_object_list(decided, src=0)
    plot, out, error = decided[0]
    if error is not None:
        dist.destroy_process_group()
        raise SystemExit(error)
    return plot, out


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Bad options end here, before any rank is launched."""
    from trec_pipelines.advise.advice import parse_bytes
    from trec_pipelines.advise.variants import resolve

    try:
        parse_bytes(args.memory_budget)
        if args.variants:
            resolve([v.strip() for v in args.variants.split(",") if v.strip()])
    except ValueError as exc:
        p.error(
            str(exc)
            .replace("memory_budget=", "--memory-budget ")
            .replace("variants=", "--variants ")
        )
    if (
        args.steps < 1
        or args.warmup < 0
        or args.rounds < 1
        or args.nproc < 1
        or not args.time_budget >= 0
    ):
        p.error(
            f"need --steps >= 1, --warmup >= 0, --rounds >= 1, --nproc >= 1 and --time-budget >= 0 "
            f"(got {args.steps}, {args.warmup}, {args.rounds}, {args.nproc}, {args.time_budget})"
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    arguments: List[str] = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(arguments)
    check(p, args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return worker(args)
    return launch(arguments, args.nproc, args.threads)


__all__ = ["check", "launch", "load_build", "main", "parser", "worker"]
