"""A model sharded over a one-rank group: no splits all-to-all, same training.

With one rank there is nothing to exchange: a ``KJTAllToAll``'s own forward
skips its splits collective, and our pipelines leave it that way instead of
fusing it into a splits all-to-all of one rank per step (which torchrec's
pipelines run).  The run is in a process of its own (one_rank_group.py, forked
from the rank server, tests/elastic/rank_server.py), so the one-rank gloo world
never meets this process's state.  SemiSync there keeps DDP's own wait for its
dense all-reduce: with one rank there is no one to wait for.
"""

from __future__ import annotations

import json
import os
import subprocess

from tests.elastic.rank_server import RankServer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = [
    "TrainPipelineSparseDist",
    "TrainPipelineSparseDistLite",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "PrefetchTrainPipelineSparseDist",
    "TrainPipelinePEC",
]


def test_one_rank_group_skips_the_splits_collective_and_trains_as_before(
    rank_server: RankServer,
) -> None:
    done = subprocess.run(
        rank_server.command("tests.unit.one_rank_group", *VARIANTS),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = {r["run"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert records["torchrec"]["matches"], "torchrec's pipeline differs from the plain loop"
    for name in VARIANTS:
        record = records[name]
        assert record["matches"], f"{name} differs from its oracle on a one-rank group"
        assert record["steps"] > 3
        assert record["splits_only_overrides"] == 0, record
        # Every module's splits request is waited on its own: no fused collective.
        assert record["awaited"] == ["_Single"], record
    # One rank: DDP's own all-reduce, waited as DDP waits (nothing to overlap it with).
    assert records["TrainPipelineSemiSync"]["all_reduce"] == "NoAllReduceWait"
