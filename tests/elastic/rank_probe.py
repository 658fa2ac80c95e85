"""What a rank server's child sees and how it ends: the rank server's own tests run it.

``python -m tests.elastic.rank_probe ACTION [ARG]``: prints one JSON line (its
arguments, working directory, an environment variable and what its streams are),
writes a line to stderr, then by ACTION: ``exit CODE`` ends with that status,
``raise`` raises, ``sleep`` waits for a signal (at most a minute), ``signal N``
kills itself with signal N.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import List


def main(argv: List[str]) -> None:
    action = argv[0]
    print(
        json.dumps(
            {
                "argv": argv,
                "pid": os.getpid(),
                "cwd": os.getcwd(),
                "probe_env": os.environ.get("RANK_PROBE"),
                "main": __name__,
                "stdin": sys.stdin.readline().strip() if action == "read" else None,
            }
        ),
        flush=True,
    )
    print("to stderr", file=sys.stderr, flush=True)
    if action == "exit":
        sys.exit(int(argv[1]))
    if action == "raise":
        raise RuntimeError("raised by the probe")
    if action == "sleep":
        time.sleep(60)
    if action == "signal":
        os.kill(os.getpid(), int(argv[1]))
        time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1:])
