"""Run order of the unit tier under ``pytest -n 2 --dist worksteal``, and its rank server.

A handful of tests launch whole jobs (torchrun with 2 or 4 ranks): each takes
seconds to tens of seconds where the rest take well under one.  Their ranks fork
from a rank server that has imported torch, torchrec and trec_pipelines once per
test process (``rank_server``; tests/elastic/rank_server.py), except the docs'
examples and the advisor's command line, which run as a user runs them.
xdist's work stealing moves only tests that have not started, so a long test that
starts last keeps one worker busy while the other has nothing left to take.  These
tests are moved to the front of the run (longest first, the classic rule for filling
workers evenly); every other test keeps its place.  Nothing is skipped or changed.
"""

from __future__ import annotations

from typing import Iterator, List

import pytest
import torch

from tests.elastic.rank_server import RankServer

# Two xdist workers share two cores: with torch's default of one intra-op thread
# per core, each worker's small kernels wake a second thread that has no core of
# its own.  One thread a worker: the pinned tier's CPU time fell from 348 s to 299 s
# (wall 195 s to 169 s, a quiet machine), every test passing as before.  The launched jobs' ranks
# set their own (OMP_NUM_THREADS=1 in their environment).
torch.set_num_threads(1)

# The launchers and the other long tests, longest first (measured on the pinned stack, a
# --durations run): path within tests/unit,
# optionally with a test name.  A test not listed keeps its collection order after them.
LAUNCHERS = (
    "test_advise.py::test_the_command_line_end_to_end",
    "test_docs.py::test_example_script_runs_on_two_ranks_and_prints_what_its_page_shows",
    # Their ranks fork from the rank server (the fixture below), which the first of
    # them on a worker starts: about 6 s, then 6 to 16 s a launch.
    "test_killed_rank.py",
    "test_peer_failure.py",
    "test_one_rank_group.py",
    # Not launchers, but as long: compiling (inductor, compiled autograd) and a fresh
    # interpreter's import.
    "test_public_surface.py::test_import_paths_users_and_docs_use_still_work",
    "test_pt2.py",
    "test_postproc.py::test_compiled_autograd_variant_pipelines_the_postprocs",
    "test_upstream_base_pt2.py",
    "test_memory_ledger.py::test_timeline_gains_a_memory_track",
)


def _rank(item: pytest.Item) -> int:
    nodeid = item.nodeid.split("tests/unit/", 1)[-1]
    for place, prefix in enumerate(LAUNCHERS):
        if nodeid == prefix or nodeid.startswith(prefix + "::") or nodeid.startswith(prefix + "["):
            return place
    return len(LAUNCHERS)


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: the rest keep their order


# What the launch tests' ranks run; the rank server imports them once, with torch,
# torchrec and trec_pipelines (tests/elastic/rank_server.py).
RANK_MODULES = (
    "tests.elastic.one_rank_fails",
    "tests.elastic.peer_killed",
    "tests.elastic.train_with_checkpoints",
    "tests.unit.one_rank_group",
)


@pytest.fixture(scope="session")
def rank_server() -> Iterator[RankServer]:
    """A rank server for this test process: the launch tests' ranks fork from it."""
    with RankServer(RANK_MODULES) as server:
        yield server
