"""Run :mod:`tests.soak.exit_check` many times under torchrun and count how each run ended.

::

    python -m tests.soak.exit_soak --runs 50 --pipelines plain SparseDist Fused

The runs go round-robin over the pipelines, so a busy stretch of the machine
falls on all of them alike.  A name ending in ``:keep`` runs that pipeline with
``--keep-pg`` (the default group left to the interpreter's exit), one ending in
``:release`` with ``--release-model``, one ending in ``:sync`` with
``--sync-exhaustion``.  A run ends ``ok`` (torchrun exit code 0), ``abort`` (a
rank died of a signal: "terminate called ..." and the like), ``error`` (another
non-zero code) or ``timeout``.  The counts, and what each failed run printed
about its failure, are printed and written as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "soak" / "exit_check.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")

# torchrun's failure summary names each failed rank's exit code, or its signal.
_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


def _classify(returncode: Optional[int], output: str) -> str:
    if returncode is None:
        return "timeout"
    if returncode == 0:
        return "ok"
    codes = [int(c) for c in _EXITCODE.findall(output)]
    if any(c < 0 for c in codes) or "terminate called" in output:
        return "abort"
    return "error"


# A case name's suffixes, each an exit_check flag.
FLAGS = {"keep": "--keep-pg", "release": "--release-model", "sync": "--sync-exhaustion"}


def command_for(case: str) -> List[str]:
    """The torchrun command of one case: ``PIPELINE[:suffix...]``."""
    pipeline, *suffixes = case.split(":")
    unknown = [x for x in suffixes if x not in FLAGS]
    if unknown:
        raise SystemExit(f"{case}: unknown suffix(es) {unknown}; known: {sorted(FLAGS)}")
    command = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(SCRIPT)]
    return command + ["--pipeline", pipeline] + [FLAGS[x] for x in suffixes]


def run_once(case: str, timeout: float) -> Tuple[str, str]:
    """One torchrun of ``exit_check``: its outcome and its whole output."""
    command = command_for(case)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    try:
        done = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout or ""
        err = expired.stderr or ""
        text = (out if isinstance(out, str) else out.decode()) + (
            err if isinstance(err, str) else err.decode()
        )
        return "timeout", text
    output = done.stdout + done.stderr
    return _classify(done.returncode, output), output


def _telling(output: str) -> str:
    """The lines of a failed run's output that say why: the abort and the stacks
    faulthandler printed, without the warnings every run prints."""
    keep = ("terminate", "Fatal Python", "Thread 0x", "Current thread", 'File "', "exitcode")
    return "\n".join(line for line in output.splitlines() if any(k in line for k in keep))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="runs per pipeline (and ending)")
    parser.add_argument("--pipelines", nargs="+", required=True)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--logs", type=Path, default=None, help="folder for failed runs' output")
    args = parser.parse_args(argv)
    for case in args.pipelines:
        command_for(case)  # refuses a bad name before any run
    counts: Dict[str, collections.Counter] = {
        case: collections.Counter() for case in args.pipelines
    }
    failures: List[Dict[str, str]] = []
    start = time.monotonic()
    for i in range(args.runs):
        for name in args.pipelines:
            outcome, output = run_once(name, args.timeout)
            counts[name][outcome] += 1
            if outcome != "ok":
                why = _telling(output)
                failures.append({"case": name, "run": str(i), "outcome": outcome, "why": why})
                print(f"run {i} {name}: {outcome}\n{why}", flush=True)
                if args.logs is not None:
                    args.logs.mkdir(parents=True, exist_ok=True)
                    (args.logs / f"{name.replace(':', '_')}_{i}.log").write_text(output)
        summary = "  ".join(f"{n}: {dict(c)}" for n, c in counts.items())
        print(f"[{time.monotonic() - start:.0f}s] after {i + 1} round(s): {summary}", flush=True)
    result = {"runs": args.runs, "counts": {n: dict(c) for n, c in counts.items()}}
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(dict(result, failures=failures), indent=1))
    return 0 if all(set(c) == {"ok"} for c in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
