"""The rank server's child behaves as ``python -m MODULE`` would, seen from outside.

Each case runs tests/elastic/rank_probe.py twice, as a fresh interpreter (the
reference) and forked from the rank server through its stand-in, and compares
what a launcher sees: the exit status, the streams, the arguments, the working
directory and the environment.  Then the signals: torchrun stops a rank with
SIGTERM, and a stand-in killed outright takes its child with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.elastic.rank_server import REPO, RankServer

PROBE = "tests.elastic.rank_probe"
LIMIT_S = 120


def _run(command: List[str], cwd: Path, stdin: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK_PROBE="seen")
    return subprocess.run(
        command, cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=LIMIT_S
    )


def _seen(done: subprocess.CompletedProcess) -> Dict[str, Any]:
    record = json.loads(done.stdout.splitlines()[0])
    record.pop("pid")
    return record


@pytest.mark.parametrize(
    "args,stdin",
    [
        (["exit", "0"], ""),
        (["exit", "3"], ""),
        (["raise"], ""),
        (["read"], "a line from the launcher\n"),
        (["signal", str(int(signal.SIGTERM))], ""),
    ],
)
def test_the_child_is_what_a_fresh_interpreter_is(
    rank_server: RankServer, args: List[str], stdin: str
) -> None:
    fresh = _run([sys.executable, "-m", PROBE, *args], REPO, stdin)
    forked = _run(rank_server.command(PROBE, *args), REPO, stdin)
    assert forked.returncode == fresh.returncode, (forked.stderr, fresh.stderr)
    assert _seen(forked) == _seen(fresh)
    assert _seen(forked)["probe_env"] == "seen" and _seen(forked)["main"] == "__main__"
    assert "to stderr" in forked.stderr and "to stderr" in fresh.stderr
    if args == ["raise"]:
        assert "RuntimeError: raised by the probe" in forked.stderr, forked.stderr
        assert "RuntimeError: raised by the probe" in fresh.stderr


def _started(rank_server: RankServer) -> "tuple[subprocess.Popen, int]":
    stand_in = subprocess.Popen(
        rank_server.command(PROBE, "sleep"),
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert stand_in.stdout is not None
    child = json.loads(stand_in.stdout.readline())["pid"]
    assert child != stand_in.pid
    return stand_in, child


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_sigterm_to_the_stand_in_ends_the_child_by_sigterm(rank_server: RankServer) -> None:
    stand_in, child = _started(rank_server)
    stand_in.send_signal(signal.SIGTERM)
    assert stand_in.wait(timeout=LIMIT_S) == -signal.SIGTERM
    assert _gone(child)


def test_a_stand_in_killed_outright_takes_its_child_with_it(rank_server: RankServer) -> None:
    stand_in, child = _started(rank_server)
    stand_in.kill()
    assert stand_in.wait(timeout=LIMIT_S) == -signal.SIGKILL
    assert _gone(child)
