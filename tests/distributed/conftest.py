"""Process-group setup for the distributed tier.

These tests are meant to be launched by torchrun, one pytest process per rank:

    .venv/bin/torchrun --standalone --nproc_per_node=2 \
        -m pytest -q -p no:cacheprovider tests/distributed

Every rank runs the same tests in the same order, so collectives line up.
"""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

# A collective that never completes (e.g. one rank failed an assert before an
# all-to-all) turns into an error after this long instead of hanging CI.
PG_TIMEOUT = timedelta(seconds=120)

_LAUNCH_HINT = (
    "tests/distributed must be run under torchrun with 2 ranks, e.g.\n"
    "    .venv/bin/torchrun --standalone --nproc_per_node=2 "
    "-m pytest -q -p no:cacheprovider tests/distributed\n"
)


@pytest.fixture(scope="session", autouse=True)
def process_group():
    """Initialise the default gloo process group from torchrun's env vars."""
    missing = [
        v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        if v not in os.environ
    ]
    if missing:
        pytest.fail(
            f"not launched by torchrun (missing env vars {missing}). " + _LAUNCH_HINT,
            pytrace=False,
        )
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size < 2:
        pytest.fail(
            f"WORLD_SIZE={world_size}: need at least 2 ranks to exercise "
            "the all-to-alls. " + _LAUNCH_HINT,
            pytrace=False,
        )
    # Two ranks share two cores: one intra-op thread each avoids
    # oversubscription and keeps CPU kernels on a single, stable code path.
    torch.set_num_threads(1)
    created = False
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", init_method="env://", timeout=PG_TIMEOUT)
        created = True
    yield dist.group.WORLD
    if created and dist.is_initialized():
        dist.destroy_process_group()
