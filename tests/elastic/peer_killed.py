"""A peer's process is SIGKILLed in the middle of a step; what the surviving rank reads.

Run as two processes (``RANK`` 0 and 1, ``WORLD_SIZE=2``, ``MASTER_ADDR`` and
``MASTER_PORT`` set), not under torchrun: torchrun would end rank 0 as soon as
rank 1 died, before it could raise.  Rank 1 kills itself in its model's
forward at batch ``--die-at``, after that step's embedding lookup met rank 0's;
rank 0's step then fails in a collective rank 1 will never join, and rank 0
writes its error and notes to ``--out``/rank0.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import trec_pipelines
from trec_pipelines.testing.dlrm import DLRM, make_batches, make_sharded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--die-at", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # The time limit of a collective that waits for the dead rank in vain.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=1)
    calls = {"n": 0}

    def die(*_: object) -> None:
        calls["n"] += 1
        if rank == 1 and calls["n"] == args.die_at + 1:
            os.kill(os.getpid(), signal.SIGKILL)

    dmp.module.over_arch.register_forward_pre_hook(die)
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))
    it = iter(make_batches(8, seed=3))
    record: dict = {"rank": rank, "steps": 0, "error": None, "notes": ""}
    try:
        while True:
            pipeline.progress(it)
            record["steps"] += 1
    except StopIteration:
        pass
    except Exception as error:  # noqa: BLE001  what a user's loop would catch
        record["error"] = f"{type(error).__name__}: {error}"
        record["notes"] = "".join(getattr(error, "__notes__", []))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    os._exit(0)  # the group cannot be torn down with a rank gone


if __name__ == "__main__":
    main()
