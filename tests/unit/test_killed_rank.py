"""Issue #22, item 4: a rank killed mid-epoch under torchrun; the restarted job resumes exactly.

Two runs of tests/elastic/train_with_checkpoints.py on 2 gloo ranks under
``torchrun --max-restarts`` (the ranks forked from the test process's rank
server, tests/elastic/rank_server.py): one that never stops, and one whose rank 1 dies
(``os._exit``) before step 5, after the checkpoint of step 3.  torchrun
restarts both ranks, which load the last checkpoint and train to the end.  The final weights must
be the uninterrupted run's, bit for bit, and the restarted attempt must train
exactly the steps from the checkpoint on.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch

from tests.elastic.rank_server import RankServer

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY, DIE_AT = 12, 3, 5


def _run(server: RankServer, out: Path, variant: str, die_at: int) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        # One restart: the rank killed on purpose.  The script drops its model after
        # destroying the group, so torch's teardown has no gloo thread left to abort on.
        "--max-restarts=1",
        *server.entry_point("tests.elastic.train_with_checkpoints"),
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


def _attempts(out: Path, rank: int) -> Dict[int, dict]:
    """What each attempt of ``rank`` that reached the end wrote: resumed_from, trained_steps."""
    found = {}
    for p in out.glob(f"steps_rank_{rank}_attempt_*.json"):
        found[int(p.stem.rsplit("_", 1)[1])] = json.loads(p.read_text())
    return dict(sorted(found.items()))


def _training_attempt(out: Path, rank: int) -> int:
    """The attempt that trained the last step; any later one (torchrun restarting a job
    whose rank aborted at exit) resumed from the final checkpoint and trained nothing."""
    attempts = _attempts(out, rank)
    trainers = [a for a, record in attempts.items() if record["trained_steps"]]
    assert trainers, f"no attempt of rank {rank} trained: {attempts}"
    last = trainers[-1]
    assert attempts[last]["trained_steps"][-1] == STEPS - 1, attempts
    for later in (a for a in attempts if a > last):
        assert attempts[later] == {"resumed_from": STEPS, "trained_steps": []}, attempts
    return last


@pytest.mark.parametrize("variant", ["TrainPipelineSparseDist", "TrainPipelineSemiSync"])
def test_killed_rank_resumes_from_the_last_checkpoint_exactly(
    rank_server: RankServer, tmp_path: Path, variant: str
) -> None:
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    whole.mkdir()
    killed.mkdir()
    done = _run(rank_server, whole, variant, die_at=-1)
    assert done.returncode == 0, done.stderr[-3000:]
    restarted = _run(rank_server, killed, variant, die_at=DIE_AT)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    # The dying rank leaves a file just before os._exit(17).  torchrun logs only the
    # failure it timed first ("failed (exitcode: N)"): rank 1's 17, or rank 0's own
    # error when rank 0 raised on the lost peer and wrote its error file first.
    assert [p.name for p in killed.glob("died_*")] == [f"died_rank_1_at_step_{DIE_AT}"], (
        "rank 1 did not die as planned: " + restarted.stderr[-2000:]
    )
    assert "failed (exitcode: " in restarted.stderr, restarted.stderr[-2000:]
    last_checkpoint = (DIE_AT // EVERY) * EVERY
    for rank in (0, 1):
        # The uninterrupted run trained every step in its first attempt.
        assert _training_attempt(whole, rank) == 0, rank
        assert _attempts(whole, rank)[0] == {"resumed_from": 0, "trained_steps": list(range(STEPS))}
        # The killed run: a restarted attempt resumed from a checkpoint (the one before the
        # kill, or a later one if torchrun restarted once more) and trained exactly the
        # steps from there on.
        attempt = _training_attempt(killed, rank)
        assert attempt >= 1, "the job was not restarted"
        record = _attempts(killed, rank)[attempt]
        start = record["resumed_from"]
        assert start % EVERY == 0 and last_checkpoint <= start < STEPS, record
        if attempt == 1:
            assert start == last_checkpoint, record
        assert record["trained_steps"] == list(range(start, STEPS)), (rank, record)
        ours, reference = _weights(killed, rank), _weights(whole, rank)
        assert ours.keys() == reference.keys()
        for key in reference:
            assert torch.equal(ours[key], reference[key]), (rank, key)


def test_a_rank_whose_peer_was_killed_is_told_to_restart_not_to_retry(
    rank_server: RankServer, tmp_path: Path
) -> None:
    """tests/elastic/peer_killed.py: rank 1 is SIGKILLed in its step 2; rank 0's step
    fails on the closed connection, and its note names the peer gone and says to
    restart from the last checkpoint, offering no retry (none can succeed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = []
    for rank in (0, 1):
        env = dict(
            os.environ,
            PYTHONPATH=str(REPO),
            OMP_NUM_THREADS="1",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        command = rank_server.command("tests.elastic.peer_killed", "--out", str(tmp_path))
        ranks.append(
            subprocess.Popen(
                command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    try:
        logs = [process.communicate(timeout=240)[0].decode() for process in ranks]
    finally:
        for process in ranks:
            process.kill()
    # Killed (its stand-in ends with status 1: SIGKILL cannot be passed on to it).
    assert ranks[1].returncode != 0 and not (tmp_path / "rank1.json").exists(), logs[1][-3000:]
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["steps"] == 2 and record["error"], (record, logs[0][-3000:])
    notes = record["notes"]
    assert "while training batch 2 because the peer at [" in notes, record
    assert "is gone" in notes and "no retry can succeed in this job" in notes, record
    assert "Restart the job from the last checkpoint" in notes, record
    assert "retries batch" not in notes and "A retry goes on" not in notes, record
