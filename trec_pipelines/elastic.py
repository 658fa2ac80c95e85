"""A process group for a job that torchrun restarts (``torchrun --max-restarts``).

When a rank fails, torchrun stops the others and starts every rank again,
keeping its own store (the one ``MASTER_ADDR``/``MASTER_PORT`` name) across
the restarts.  A process group writes its keys under the group's name, the
same in every attempt, so a rank of the new attempt can read an address that
a rank of the dead attempt published, and wait on it: in
``init_process_group`` ("Connection refused"), or in a later ``new_group``
until the group's timeout.  :func:`attempt_store` is torchrun's store under a
prefix naming the attempt (``TORCHELASTIC_RESTART_COUNT``), which keeps every
attempt's keys apart.  It is needed by any restarted job, pipeline or not.

Example::

    import os
    import torch.distributed as dist
    from trec_pipelines.elastic import attempt_store

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=attempt_store(), rank=rank, world_size=world)

The *Checkpoint and resume* guide has a whole job (``docs/examples/checkpoint.py``).
"""

from __future__ import annotations

import os
from datetime import timedelta

# torch.distributed re-exports these without marking them so; the stubs are here.
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

# What torchrun sets in every rank's environment, and attempt_store reads.
_NEEDED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def attempt_store(timeout: timedelta = timedelta(minutes=5)) -> Store:
    """torchrun's store, under a prefix naming this restart attempt: pass it to
    ``torch.distributed.init_process_group(backend, store=..., rank=..., world_size=...)``.

    Args:
        timeout: how long a rank waits on the store for the others (to connect, or
            for a key).

    Raises:
        RuntimeError: outside torchrun (one of ``MASTER_ADDR``, ``MASTER_PORT``,
            ``RANK``, ``WORLD_SIZE`` is not set).
    """
    missing = [name for name in _NEEDED if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"attempt_store() reads the variables torchrun sets in each rank; "
            f"{', '.join(missing)} not set: launch the job with torchrun, or give "
            "init_process_group a store of your own"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # Under torchrun the agent hosts the store (TORCHELASTIC_USE_AGENT_STORE) and
    # every rank is a client; otherwise rank 0 hosts it, as env:// would.
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent_hosts_it and rank == 0,
        timeout=timeout,
    )
    return PrefixStore(f"attempt_{attempt}", store)  # keys: attempt_N/KEY


__all__ = ["attempt_store"]
