"""The emulated interconnect: ranks in a private network namespace with a rate-limited loopback.

``--link-gbit G`` runs torchrun inside ``unshare -n``: a new network namespace
whose only interface is its own loopback.  There, before torchrun starts,
``tc qdisc add dev lo root tbf rate G gbit`` caps that loopback, so every byte
the gloo ranks exchange crosses a link of ``G`` Gbit/s (both directions share
it, as on a half-duplex link).  The host's loopback is never touched: the
rate limit is applied by :func:`inside`, which refuses to run unless its
network namespace differs from the one the launcher started in.

Needs root (to create the namespace), ``unshare``, and ``ip``/``tc`` from
iproute2; a missing iproute2 is installed with apt-get, with a message.
``tbf`` is used because ``netem`` is not available in every kernel.

[Note: the link's queue]
tbf holds what waits for the link in one FIFO, and how much of it one TCP
socket may fill is the kernel's ``tcp_limit_output_bytes`` (TCP small
queues; 4 MiB on this kernel): a socket sending an all-to-all of 2 MiB puts
all of it in the queue at once, and a packet of any other connection, a
collective of another process group included, waits behind the whole of it.
A host NIC does not behave so: its default qdisc (``fq`` / ``fq_codel``,
absent from this kernel) serves flows in turn, and the NIC's byte queue
limits keep its own queue to a few packets, so flows share the link's rate.
The namespace therefore sets ``tcp_limit_output_bytes`` to
``socket_queue_bytes`` (256 KiB, about 2 ms at 1 Gbit/s): each socket keeps
at most that much in the queue and the flows interleave, as they would share
a real link.  Much less makes a flow's rate depend on how soon its sending
thread gets a core again on this busy 2-core machine: at 64 KiB
TrainPipelineBase, which overlaps nothing with the link, ran 13% below
torchrec's twin (1.03 at 256 KiB, 1.00 on the deep FIFO).  ``0`` keeps the
kernel's default: the deep FIFO the results before 2026-11-25 were measured
on (``--link-socket-queue-kb 0``).  Connections of one process group are
still served in issue order by gloo itself (one pair of sockets per peer).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence

# Environment variables the launcher passes into the namespace.
HOST_NETNS_ENV = "TREC_BENCH_HOST_NETNS"
QDISC_ENV = "TREC_BENCH_QDISC"

# tbf needs a bucket of at least one packet (loopback MTU is 64 KiB) and,
# to stay smooth, not much more: a bigger bucket lets short all-to-alls
# through at memory speed.
_MIN_BURST_BYTES = 128 * 1024
_QUEUE_LATENCY_MS = 200


class LinkUnavailable(RuntimeError):
    """The emulated link can't be set up here; the message says why."""


# The namespace's TCP small-queue limit (see [Note: the link's queue]).
TSQ_SYSCTL = "/proc/sys/net/ipv4/tcp_limit_output_bytes"
DEFAULT_SOCKET_QUEUE_BYTES = 256 * 1024


@dataclass(frozen=True)
class LinkPlan:
    gbit: float
    burst_bytes: int
    socket_queue_bytes: int = DEFAULT_SOCKET_QUEUE_BYTES  # 0: the kernel's default

    def tc_args(self) -> List[str]:
        return [
            "tc",
            "qdisc",
            "add",
            "dev",
            "lo",
            "root",
            "tbf",
            "rate",
            f"{self.gbit:g}gbit",
            "burst",
            str(self.burst_bytes),
            "latency",
            f"{_QUEUE_LATENCY_MS}ms",
        ]


def plan(gbit: float, socket_queue_bytes: int = DEFAULT_SOCKET_QUEUE_BYTES) -> LinkPlan:
    # About half a millisecond of traffic, but never less than two loopback packets.
    burst = max(_MIN_BURST_BYTES, int(gbit * 1e9 / 8 * 0.0005))
    return LinkPlan(gbit=gbit, burst_bytes=burst, socket_queue_bytes=socket_queue_bytes)


def netns_inode() -> int:
    return os.stat("/proc/self/ns/net").st_ino


def _ensure_iproute2() -> None:
    if shutil.which("tc") and shutil.which("ip"):
        return
    if not shutil.which("apt-get"):
        raise LinkUnavailable(
            "`tc`/`ip` (iproute2) are missing and apt-get is not available to install them"
        )
    print(
        "--link-gbit needs `tc` and `ip` from iproute2; installing it with apt-get ...", flush=True
    )
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "iproute2"]):
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise LinkUnavailable(f"`{' '.join(cmd)}` failed: {result.stderr.strip()[-300:]}")
    if not (shutil.which("tc") and shutil.which("ip")):
        raise LinkUnavailable("iproute2 installed but `tc`/`ip` are still not on PATH")


def check(link: LinkPlan) -> None:
    """Raise :class:`LinkUnavailable` unless a namespace with a tbf loopback can be made here."""
    if os.geteuid() != 0:
        raise LinkUnavailable(
            "creating a network namespace needs root (run as root or drop --link-gbit)"
        )
    if not shutil.which("unshare"):
        raise LinkUnavailable("`unshare` (util-linux) is not installed")
    _ensure_iproute2()
    probe = f"ip link set lo up && {' '.join(link.tc_args())}"
    result = subprocess.run(["unshare", "-n", "sh", "-c", probe], capture_output=True, text=True)
    if result.returncode != 0:
        raise LinkUnavailable(
            "network namespaces or the tbf qdisc are not permitted here: "
            + (result.stderr.strip() or f"exit code {result.returncode}")
        )


def wrap(command: Sequence[str], link: LinkPlan) -> List[str]:
    """``command`` run inside a new network namespace whose loopback is limited to ``link``."""
    return [
        "unshare",
        "-n",
        "--",
        sys.executable,
        "-m",
        "benchmarks.settings.netns",
        f"{link.gbit:g}",
        str(link.burst_bytes),
        str(link.socket_queue_bytes),
        "--",
        *command,
    ]


def inside(argv: Sequence[str]) -> int:
    """Entry point inside the namespace: rate-limit this namespace's loopback, then exec ``command``."""
    if "--" not in argv or len(argv) < 4:
        print(
            "usage: python -m benchmarks.settings.netns GBIT BURST_BYTES [SOCKET_QUEUE_BYTES] -- COMMAND ...",
            file=sys.stderr,
        )
        return 2
    split = list(argv).index("--")
    gbit, burst = float(argv[0]), int(argv[1])
    socket_queue = int(argv[2]) if split > 2 else 0
    command = list(argv[split + 1 :])
    host = os.environ.get(HOST_NETNS_ENV)
    if host is None or int(host) == netns_inode():
        print(
            "refusing to rate-limit loopback: not inside a private network namespace "
            f"(expected one different from the launcher's, {HOST_NETNS_ENV}={host})",
            file=sys.stderr,
        )
        return 3
    link = LinkPlan(gbit=gbit, burst_bytes=burst, socket_queue_bytes=socket_queue)
    for cmd in (["ip", "link", "set", "lo", "up"], link.tc_args()):
        subprocess.run(cmd, check=True)
    if link.socket_queue_bytes:
        with open(TSQ_SYSCTL, "w") as f:  # this namespace's own copy of the setting
            f.write(str(link.socket_queue_bytes))
    shown = subprocess.run(
        ["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True
    ).stdout.strip()
    with open(TSQ_SYSCTL) as f:
        shown += f"; tcp_limit_output_bytes {f.read().strip()}"
    env = dict(os.environ)
    env[QDISC_ENV] = shown
    os.execvpe(command[0], command, env)
    return 0  # unreachable


def loopback_tx_bytes() -> int:
    """Bytes sent so far on the loopback of this process's network namespace.

    Read from ``/proc/net/dev``, which shows the reader's namespace (unlike
    ``/sys/class/net``, which shows the namespace sysfs was mounted in).
    Inside the benchmark's namespace every byte the ranks exchange crosses
    the emulated link once, so differences of this counter are link traffic.
    """
    with open("/proc/net/dev") as f:
        for line in f:
            name, sep, counters = line.partition(":")
            if sep and name.strip() == "lo":
                return int(counters.split()[8])  # receive has 8 columns; transmit bytes come next
    raise RuntimeError("no 'lo' interface in /proc/net/dev")


def qdisc_in_effect() -> Optional[str]:
    """The loopback qdisc the namespace was set up with (None outside one)."""
    return os.environ.get(QDISC_ENV)


if __name__ == "__main__":
    raise SystemExit(inside(sys.argv[1:]))
