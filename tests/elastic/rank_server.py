"""A process that has imported torch, torchrec and trec_pipelines once, and forks a rank on request.

The unit tier's launch tests (a rank that fails, a rank killed and restarted,
a one-rank group) start jobs under torchrun, each rank a fresh interpreter that
imports torch, torchrec and this package: about 8.5 s of CPU on the pinned
stack and 12.5 s on Python 3.10, most of what such a test costs.  A rank server
pays that once per test process: torchrun's entry point is
``tests/elastic/forked_rank.py`` (standard library only), which asks the
server to fork a child with everything imported and run ``python -m MODULE
ARGS`` there, with the stand-in's environment, working directory and
standard streams, and then ends as the child ends.  torchrun still starts,
watches, signals and restarts the ranks; only the import is shared.  A fork
of a process that has only imported modules is what a DataLoader worker is.

    with RankServer(["tests.elastic.one_rank_fails"]) as server:
        command = ["torchrun", "--nproc_per_node=2", *server.entry_point("tests.elastic.one_rank_fails")]

``python -m tests.elastic.rank_server SOCKET MODULE...`` is the server itself:
it imports the MODULEs, listens on SOCKET, and ends when its parent does.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import Dict, List, Optional, Sequence, Type

REPO = Path(__file__).resolve().parents[2]
STAND_IN = Path(__file__).with_name("forked_rank.py")
# What a rank of the launch tests imports first; the server imports these before it listens.
COMMON = ("torch", "torch.distributed", "torchrec", "trec_pipelines")
START_LIMIT_S = 180.0


class RankServer:
    """A rank server run from the test process; ``entry_point`` gives torchrun what to start."""

    def __init__(self, preload: Sequence[str] = ()) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="rank-server-")
        self.socket = os.path.join(self._folder.name, "socket")
        # The ranks' environment at import time, as the tests launch them (OpenMP
        # reads its thread count when torch is imported).
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        command = [sys.executable, "-u", "-m", "tests.elastic.rank_server", self.socket]
        self._process = subprocess.Popen([*command, *COMMON, *preload], cwd=REPO, env=env)
        deadline = time.monotonic() + START_LIMIT_S
        while not os.path.exists(self.socket):
            if self._process.poll() is not None:
                raise RuntimeError(f"the rank server ended with status {self._process.returncode}")
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the rank server did not listen within {START_LIMIT_S:.0f} s")
            time.sleep(0.1)

    def entry_point(self, module: str, *args: str) -> List[str]:
        """The script and arguments that run ``python -m module args`` forked from this server."""
        return [str(STAND_IN), self.socket, module, *args]

    def command(self, module: str, *args: str) -> List[str]:
        """One such process, outside torchrun."""
        return [sys.executable, *self.entry_point(module, *args)]

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._folder.cleanup()

    def __enter__(self) -> "RankServer":
        return self

    def __exit__(
        self,
        kind: Optional[Type[BaseException]],
        error: Optional[BaseException],
        trace: Optional[TracebackType],
    ) -> None:
        self.close()


# --------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------


def _run_child(request: Dict[str, object], fds: List[int]) -> int:
    """In the forked child: become ``python -m module args`` with the stand-in's streams."""
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(str(request["cwd"]))
    os.environ.clear()
    os.environ.update(request["env"])  # type: ignore[arg-type]
    random.seed()  # a fresh interpreter's random state, not the server's
    module = str(request["module"])
    sys.argv = [module, *request["args"]]  # type: ignore[misc]
    # Preloaded for its imports; run afresh as __main__, as ``python -m`` runs it
    # (runpy warns about a module already imported).
    sys.modules.pop(module, None)
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            code = exit.code or 0
        else:
            print(exit.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    return code


def _fork(
    connection: socket.socket,
    held: Sequence[socket.socket],
    children: Dict[int, socket.socket],
) -> int:
    """Fork the child ``connection`` asks for and enter it in ``children``; ``held``: the
    server's sockets, which the child closes."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    try:
        request = json.loads(message)
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
                signal.signal(signum, signal.SIG_DFL)
            for own in (*held, connection):
                own.close()
            code = _run_child(request, fds)
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    children[child] = connection  # from here on the server ends it, whatever happens
    for fd in fds:
        os.close(fd)
    return child


def _kill(child: int) -> None:
    try:
        os.kill(child, signal.SIGKILL)
    except ProcessLookupError:
        pass  # ended and reaped already


def serve(path: str) -> None:
    """Fork a child per connection; tell its stand-in how it ended; end with the parent."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".binding")
    listener.listen(64)
    os.rename(path + ".binding", path)  # the socket appears once it accepts
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    # A child's end wakes the loop at once (not at its next poll): its stand-in
    # must end when the child does, as a rank torchrun watches would.
    wake, woken = socket.socketpair()
    for end in (wake, woken):
        end.setblocking(False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake.fileno())
    selector.register(woken, selectors.EVENT_READ)
    children: Dict[int, socket.socket] = {}
    try:
        _serve(parent, listener, woken, selector, children, [wake, woken])
    finally:
        for child in children:
            _kill(child)


def _start(
    connection: socket.socket,
    held: Sequence[socket.socket],
    selector: selectors.BaseSelector,
    children: Dict[int, socket.socket],
) -> None:
    """Fork the child a new connection asks for and tell its stand-in the pid.  What
    goes wrong with one connection ends that connection (and its child), not the
    server the other stand-ins share."""
    try:
        child = _fork(connection, held, children)
    except Exception:  # noqa: BLE001 -- a bad request or a stand-in gone mid-request
        traceback.print_exc()
        for child, own in children.items():
            if own is connection:
                _kill(child)  # reaped with the others
        connection.close()
        return
    selector.register(connection, selectors.EVENT_READ, child)
    try:
        connection.sendall(str(child).encode())
    except OSError:
        # The stand-in is gone before it could pass a signal on: its child goes too
        # (it is reaped, and its connection closed, with the others).
        _kill(child)


def _serve(
    parent: int,
    listener: socket.socket,
    woken: socket.socket,
    selector: selectors.BaseSelector,
    children: Dict[int, socket.socket],
    own: List[socket.socket],
) -> None:
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is woken:
                try:
                    woken.recv(4096)  # a signal arrived: children are reaped below
                except BlockingIOError:
                    pass
            elif key.fileobj is listener:
                connection, _ = listener.accept()
                _start(connection, [listener, *own, *children.values()], selector, children)
            else:
                # A stand-in only ever closes its end: it was killed (SIGKILL
                # cannot be passed on), so its child goes too.
                _kill(key.data)
                selector.unregister(key.fileobj)
        while children:
            child, status = os.waitpid(-1, os.WNOHANG)
            if child == 0:
                break
            connection = children.pop(child)
            try:
                connection.sendall(str(status).encode())
            except OSError:
                pass  # the stand-in is gone
            if connection in (k.fileobj for k in selector.get_map().values()):
                selector.unregister(connection)
            connection.close()


def main(argv: List[str]) -> None:
    path, modules = argv[0], argv[1:]
    for module in modules:
        __import__(module)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    serve(path)


if __name__ == "__main__":
    main(sys.argv[1:])
