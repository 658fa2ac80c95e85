"""The rank server's child behaves as ``python -m MODULE`` would, seen from outside.

Each case runs tests/elastic/rank_probe.py twice, as a fresh interpreter (the
reference) and forked from the rank server through its stand-in, and compares
what a launcher sees: the exit status, the streams, the arguments, the working
directory and the environment.  Then the signals: torchrun stops a rank with
SIGTERM, even one sent before the stand-in knows its child, and a stand-in killed
outright, even before it learnt its child's pid, takes its child with it while the
server goes on serving the others.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.elastic.rank_server import REPO, STAND_IN, RankServer

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


def test_a_signal_sent_before_the_stand_in_knows_its_child_is_passed_on(tmp_path: Path) -> None:
    # This test plays the server: it holds its reply (the child's pid) until the
    # stand-in has been sent SIGTERM.
    path = str(tmp_path / "socket")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(LIMIT_S)
    stand_in = subprocess.Popen([sys.executable, str(STAND_IN), path, PROBE, "sleep"])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        connection, _ = listener.accept()
        _, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
        for fd in fds:
            os.close(fd)
        stand_in.send_signal(signal.SIGTERM)  # it has asked for its child: its pid is unknown yet
        connection.sendall(str(child.pid).encode())
        assert child.wait(timeout=LIMIT_S) == -signal.SIGTERM
        connection.sendall(str(int(signal.SIGTERM)).encode())  # the child's wait status
        assert stand_in.wait(timeout=LIMIT_S) == -signal.SIGTERM
    finally:
        for process in (stand_in, child):
            process.kill()
            process.wait()
        listener.close()


def test_a_stand_in_gone_before_its_child_s_pid_takes_the_child_not_the_server(
    rank_server: RankServer,
) -> None:
    # A stand-in that asks for a child and is gone at once (as one ended by a
    # signal before it could pass it on): the server's reply finds no one.
    read_end, write_end = os.pipe()
    request = {
        "module": PROBE,
        "args": ["sleep"],
        "env": dict(os.environ, PYTHONPATH=str(REPO)),
        "cwd": str(REPO),
    }
    with open(os.devnull, "rb") as nothing_in, open(os.devnull, "wb") as nothing_out:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stand_in:
            stand_in.connect(rank_server.socket)
            fds = [nothing_in.fileno(), write_end, nothing_out.fileno()]
            socket.send_fds(stand_in, [json.dumps(request).encode()], fds)
    os.close(write_end)
    # The child's stdout is the pipe: it reaches its end once the child is gone
    # (the probe sleeps a minute when left alone).
    seen = b""
    deadline = time.monotonic() + 30
    with os.fdopen(read_end, "rb", buffering=0) as out:
        while True:
            assert time.monotonic() < deadline, f"the child still runs; it wrote {seen!r}"
            if select.select([out], [], [], 1)[0]:
                chunk = out.read(4096)
                if not chunk:
                    break
                seen += chunk
    assert rank_server._process.poll() is None, "the rank server ended"
    done = _run(rank_server.command(PROBE, "exit", "0"), REPO)
    assert done.returncode == 0, done.stderr
