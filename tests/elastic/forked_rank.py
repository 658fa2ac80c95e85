"""What torchrun starts as a rank when the test runs it from a rank server: a stand-in process.

Usage (torchrun's entry point, or any command line)::

    python tests/elastic/forked_rank.py SOCKET MODULE [ARGS...]

It imports nothing but the standard library, so it starts in milliseconds.  It
hands its command line, environment, working directory and standard streams to
the rank server listening on ``SOCKET`` (``tests/elastic/rank_server.py``), which
forks a child that has torch, torchrec and trec_pipelines imported already and
runs ``python -m MODULE ARGS`` there.  This process then stands in for that
child: it passes on the signals it gets (torchrun stops its ranks with
SIGTERM) and ends as the child ended, with its exit status or by its signal,
so torchrun sees what it would have seen of the rank itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from typing import Any, List

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def main(argv: List[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: forked_rank.py SOCKET MODULE [ARGS...]")
    path, module, args = argv[0], argv[1], argv[2:]
    # The child may be up (and the launcher may signal this process) before its pid
    # arrives here: hold the signals until they can be passed on, so none ends
    # this process with the child left running.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.connect(path)
    request = {"module": module, "args": args, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(server, [json.dumps(request).encode()], [0, 1, 2])
    reply = server.recv(64)
    if not reply:
        sys.exit("forked_rank.py: the rank server went away before it started the rank")
    child = int(reply)

    def forward(signum: int, _frame: Any) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass  # already ended: its status is on its way

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # those held are passed on now
    reply = server.recv(64)
    if not reply:
        sys.exit("forked_rank.py: the rank server went away before the rank ended")
    status = int(reply)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main(sys.argv[1:])
