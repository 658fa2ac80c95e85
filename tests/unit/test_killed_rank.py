"""Issue #22, item 4: a rank killed mid-epoch under torchrun; the restarted job resumes exactly.

Two runs of tests/elastic/train_with_checkpoints.py on 2 gloo ranks under
``torchrun --max-restarts``: one that never stops, and one whose rank 1 dies
(``os._exit``) before step 5, after the checkpoint of step 3.  torchrun
restarts both ranks, which load the last checkpoint and train to the end.  The final weights must
be the uninterrupted run's, bit for bit, and the restarted attempt must train
exactly the steps from the checkpoint on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY, DIE_AT = 12, 3, 5


def _run(out: Path, variant: str, die_at: int) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        # One restart is the test; a second absorbs a restarted rank that aborts on its
        # own ("terminate called without an active exception", once in a full
        # run under load on torch 2.14; not reproduced alone in 6 runs): any
        # attempt resumes from the last checkpoint, and the checks below hold.
        "--max-restarts=2",
        "-m",
        "tests.elastic.train_with_checkpoints",
        "--out",
        str(out),
        "--variant",
        variant,
        "--batches",
        str(STEPS),
        "--every",
        str(EVERY),
        "--die-at",
        str(die_at),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _weights(out: Path, rank: int) -> Dict[str, torch.Tensor]:
    return torch.load(out / f"weights_rank_{rank}.pt", weights_only=False)


def _steps(out: Path, rank: int, attempt: int) -> list:
    return json.loads((out / f"steps_rank_{rank}_attempt_{attempt}.json").read_text())[
        "trained_steps"
    ]


def _last_attempt(out: Path, rank: int) -> int:
    return max(int(p.stem.rsplit("_", 1)[1]) for p in out.glob(f"steps_rank_{rank}_attempt_*.json"))


@pytest.mark.parametrize("variant", ["TrainPipelineSparseDist", "TrainPipelineSemiSync"])
def test_killed_rank_resumes_from_the_last_checkpoint_exactly(tmp_path: Path, variant: str) -> None:
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    whole.mkdir()
    killed.mkdir()
    done = _run(whole, variant, die_at=-1)
    assert done.returncode == 0, done.stderr[-3000:]
    restarted = _run(killed, variant, die_at=DIE_AT)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "exitcode  : 17" in restarted.stderr or "exitcode: 17" in restarted.stderr.replace(
        "  ", " "
    ), "rank 1 did not die as planned: " + restarted.stderr[-2000:]
    last_checkpoint = (DIE_AT // EVERY) * EVERY
    for rank in (0, 1):
        # The first attempt of the dying rank trained up to the step it died before;
        # the second attempt, every rank, from the last checkpoint to the end.
        attempt = _last_attempt(killed, rank)
        assert attempt >= 1, "the job was not restarted"
        assert _steps(killed, rank, attempt) == list(range(last_checkpoint, STEPS)), rank
        assert _steps(whole, rank, 0) == list(range(STEPS)), rank
        ours, reference = _weights(killed, rank), _weights(whole, rank)
        assert ours.keys() == reference.keys()
        for key in reference:
            assert torch.equal(ours[key], reference[key]), (rank, key)
