"""Run order of the unit tier under ``pytest -n 2 --dist worksteal``.

A handful of tests launch whole jobs (torchrun with 2 or 4 ranks, each rank importing
torch and torchrec): each takes tens of seconds where the rest take well under one.
xdist's work stealing moves only tests that have not started, so a long test that
starts last keeps one worker busy while the other has nothing left to take.  These
tests are moved to the front of the run (longest first, the classic rule for filling
workers evenly); every other test keeps its place.  Nothing is skipped or changed.
"""

from __future__ import annotations

from typing import List

import pytest

# The launchers and the other long tests, longest first (measured on the pinned stack, a
# --durations run): path within tests/unit,
# optionally with a test name.  A test not listed keeps its collection order after them.
LAUNCHERS = (
    "test_killed_rank.py",
    "test_one_rank_group.py",
    "test_peer_failure.py",
    "test_docs.py::test_example_script_runs_on_two_ranks_and_prints_what_its_page_shows",
    "test_advise.py::test_the_command_line_end_to_end",
    # Not launchers, but as long: compiling (inductor, compiled autograd) and a fresh
    # interpreter's import.
    "test_postproc.py::test_compiled_autograd_variant_pipelines_the_postprocs",
    "test_public_surface.py::test_import_paths_users_and_docs_use_still_work",
    "test_pt2.py",
    "test_memory_ledger.py::test_timeline_gains_a_memory_track",
    "test_upstream_base_pt2.py",
)


def _rank(item: pytest.Item) -> int:
    nodeid = item.nodeid.split("tests/unit/", 1)[-1]
    for place, prefix in enumerate(LAUNCHERS):
        if nodeid == prefix or nodeid.startswith(prefix + "::") or nodeid.startswith(prefix + "["):
            return place
    return len(LAUNCHERS)


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: the rest keep their order
