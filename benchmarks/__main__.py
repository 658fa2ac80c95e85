"""``python -m benchmarks``: the entry point of ``make bench``.

Run directly, it launches itself under torchrun (``--nproc`` ranks, gloo,
CPU), inside a rate-limited private network namespace with ``--link-gbit``;
under torchrun (``RANK`` set) it is one rank of the benchmark.

    python -m benchmarks                      # the default run (2 ranks, table_wise)
    python -m benchmarks --link-gbit 2        # same over an emulated 2 Gbit/s link
    python -m benchmarks --variants TrainPipelineSparseDist --batch-sizes 4096
    python -m benchmarks --include-compiled   # also PT2 / CompAutograd
    python -m benchmarks replot benchmarks/results/<run>   # redraw a run's figure, nothing run
    python -m benchmarks sweep                # the regime map: dims x link speeds (benchmarks/running/sweep.py)
    python -m benchmarks --help
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List, Optional, Sequence

from benchmarks.settings import netns
from benchmarks.settings.config import BenchConfig, parse_args, to_argv


def torchrun_command(cfg: BenchConfig) -> List[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={cfg.nproc}",
        "-m",
        "benchmarks",
        *to_argv(cfg),
    ]


def launch(cfg: BenchConfig) -> int:
    from benchmarks.running.runner import LINK_REASON_ENV, REPO

    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = str(cfg.threads)
    # gloo must talk over the loopback: inside a private namespace it is the
    # only interface, and the one the emulated link limits.
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # c10d's C++ warnings (e.g. no hostname inside a private namespace) are noise here.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    command = torchrun_command(cfg)
    if cfg.link_gbit is not None:
        link = netns.plan(cfg.link_gbit, cfg.link_socket_queue_kb * 1024)
        try:
            netns.check(link)
        except netns.LinkUnavailable as why:
            print(
                f"--link-gbit {cfg.link_gbit:g}: cannot emulate the link ({why}); "
                "running WITHOUT it (results say so)",
                flush=True,
            )
            env[LINK_REASON_ENV] = str(why)
        else:
            env[netns.HOST_NETNS_ENV] = str(netns.netns_inode())
            command = netns.wrap(command, link)
            queue = (
                f"{cfg.link_socket_queue_kb} KiB queued per socket"
                if link.socket_queue_bytes
                else "the kernel's socket queue limit"
            )
            print(
                f"emulated interconnect: {cfg.link_gbit:g} Gbit/s (tbf, burst {link.burst_bytes} B, "
                f"{queue}) on the loopback of a private network namespace",
                flush=True,
            )
    print(f"launching {cfg.nproc} ranks under torchrun: {' '.join(command)}", flush=True)
    return subprocess.run(command, env=env, cwd=REPO).returncode


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["replot"]:
        from benchmarks.figures import replot

        return replot.main(args[1:])
    if args[:1] == ["sweep"]:
        from benchmarks.running import sweep

        return sweep.main(args[1:])
    cfg = parse_args(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from benchmarks.running.runner import worker

        return worker(cfg)
    return launch(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
