"""docs/examples/checkpoint.py as a user runs it: under ``torchrun --max-restarts=1``, with
rank 1 SIGKILLed mid-run, the restarted job resumes from its last checkpoint exactly.

Two runs on 2 gloo ranks: one never stopped, and one whose rank 1 is killed
(SIGKILL, from here) once the first checkpoint is whole; torchrun restarts both
ranks, which resume from the last whole checkpoint (through ``resume``, with the
batches in flight) and train to the end.  Every rank's final checkpoint -- model,
optimizer, pipeline and loader, as ``save`` writes them -- must be the unkilled
run's byte for byte.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY = 200, 20
LIMIT_S = 400.0  # a hang guard for the whole test: two jobs, each rank importing torchrec


def _launch(out: Path) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=1",
        # Each worker's stdout in a file of its own (the two ranks' lines cannot mix).
        "--log-dir",
        str(out / "logs"),
        "--redirects",
        "1",
        "-m",
        "docs.examples.checkpoint",
        str(out),
        "--steps",
        str(STEPS),
        "--every",
        str(EVERY),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _rank_pid(agent: int, rank: int) -> Optional[int]:
    """The pid of torchrun's worker ``rank`` (a child of the agent, RANK in its environment)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != agent:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def _last_attempt_lines(out: Path) -> List[str]:
    """Each rank's stdout in the job's last attempt, one line a rank, rank by rank."""
    attempts = sorted(out.glob("logs/*/attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    assert attempts, f"torchrun wrote no attempt under {out / 'logs'}"
    lines = []
    for rank in (0, 1):
        log = attempts[-1] / str(rank) / "stdout.log"
        lines.append(log.read_text().strip() if log.exists() else f"(no {log})")
    return lines


def _finish(job: subprocess.Popen[str], deadline: float) -> subprocess.CompletedProcess[str]:
    try:
        out, err = job.communicate(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        job.kill()
        out, err = job.communicate()
        pytest.fail(f"the job did not end within the test's limit:\n{err[-3000:]}")
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the rank by /proc")
def test_the_example_killed_mid_run_under_torchrun_resumes_exactly(tmp_path: Path) -> None:
    deadline = time.monotonic() + LIMIT_S
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    whole.mkdir()
    killed.mkdir()
    done = _finish(_launch(whole), deadline)
    assert done.returncode == 0, done.stderr[-3000:]

    job = _launch(killed)
    # Once the first checkpoint is whole (``latest`` names it), kill rank 1 outright.
    while not (killed / "latest").exists():
        assert job.poll() is None, job.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint within the test's limit"
        time.sleep(0.05)
    victim = _rank_pid(job.pid, 1)
    assert victim is not None, "rank 1 not found among torchrun's workers"
    os.kill(victim, signal.SIGKILL)
    restarted = _finish(job, deadline)
    assert restarted.returncode == 0, restarted.stderr[-3000:]

    # Killed mid-run: no rank of the first attempt reached the end; both ranks of the
    # restarted one resumed from a checkpoint and trained to the end.
    lines = _last_attempt_lines(killed)
    for rank, line in enumerate(lines):
        found = re.fullmatch(
            rf"rank {rank}: resumed from step (\d+), trained to step {STEPS}", line
        )
        assert found is not None, lines
        resumed = int(found.group(1))
        assert resumed >= EVERY and resumed % EVERY == 0 and resumed < STEPS, line
    assert "exitcode: -9" in restarted.stderr or "Signals.SIGKILL" in restarted.stderr, (
        restarted.stderr[-3000:]
    )
    # Exact resume: every rank's final checkpoint, byte for byte.
    for rank in (0, 1):
        ours = (killed / f"step_{STEPS}" / f"rank{rank}.pt").read_bytes()
        reference = (whole / f"step_{STEPS}" / f"rank{rank}.pt").read_bytes()
        assert ours == reference, f"rank {rank}'s final checkpoint differs from the unkilled run's"
