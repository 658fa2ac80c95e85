"""A step that raises on one rank only ends the other ranks within seconds.

tests/elastic/one_rank_fails.py under torchrun (its ranks forked from the test
process's rank server, tests/elastic/rank_server.py), on 2 and 4 gloo ranks, with
SparseDist, Fused, SemiSync, Base, Staged and the eval pipelines (EvalPipelineSparseDist
inline and on its loader thread, EvalPipelineFusedSparseDist): rank 0's forward raises at batch 2
and rank 0 stays alive (``stay``), or retries alone (``retry``).  The model's
process group would time out after 120 s; the other ranks must instead exit
with status 1 once the grace has passed, their log naming rank 0 and batch 2,
and a lone retry must raise OutOfStepError.  Each launch has its own time limit, so a hang fails the test.

The default grace (10 s) is kept in one case; the others set 1 s (the watcher
polls every second) through the environment, which is also the documented way
to change it.

Below them, the watcher in this process, on two ranks' news sharing one store,
with the order of events set by the test: a failure published while the waiting
rank is between two steps, or in the step before the one it waits in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple

import pytest
from torch.distributed import HashStore

from tests.elastic.rank_server import RankServer
from trec_pipelines.core import peer_failure
from trec_pipelines.core.peer_failure import FailureNews, Watch

REPO = Path(__file__).resolve().parents[2]


def _launch(
    server: RankServer,
    out: Path,
    ranks: int,
    then: str,
    grace: Optional[float],
    pipeline: str,
    *extra: str,
) -> tuple[subprocess.CompletedProcess, float]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        *server.entry_point("tests.elastic.one_rank_fails"),
        "--out",
        str(out),
        "--then",
        then,
        "--pipeline",
        pipeline,
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("TREC_PIPELINES_PEER_FAILURE_GRACE", None)
    if grace is not None:
        env["TREC_PIPELINES_PEER_FAILURE_GRACE"] = str(grace)
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    return done, time.monotonic() - started


# (ranks, then, grace, pipeline).  The lone retry keeps the default grace: it
# needs the others alive until it has raised (torchrun ends every rank once one
# exits).  A data iterator's error is in tests/distributed/test_peer_failure.py:
# there the others raise PeerFailedError, in process.
CASES = [
    (2, "stay", 1.0, "TrainPipelineSparseDist"),
    (2, "retry", None, "TrainPipelineSparseDist"),
    (4, "stay", 1.0, "TrainPipelineSparseDist"),
    (2, "stay", 1.0, "TrainPipelineFusedSparseDist"),
    (2, "stay", 1.0, "TrainPipelineSemiSync"),
    (2, "stay", 1.0, "TrainPipelineBase"),
    (2, "stay", 1.0, "StagedTrainPipeline"),
    # The eval pipelines' forwards fail the same way (see [Note: a failed eval step]).
    (2, "stay", 1.0, "EvalPipelineSparseDist"),
    (2, "stay", 1.0, "EvalPipelineSparseDist+thread"),
    (2, "stay", 1.0, "EvalPipelineFusedSparseDist"),
    (2, "retry", None, "EvalPipelineSparseDist"),
]


@pytest.mark.parametrize("ranks,then,grace,pipeline", CASES)
def test_the_other_ranks_end_within_seconds_naming_the_failed_rank(
    rank_server: RankServer,
    tmp_path: Path,
    ranks: int,
    then: str,
    grace: Optional[float],
    pipeline: str,
) -> None:
    done, _ = _launch(rank_server, tmp_path, ranks, then, grace, pipeline)
    log = done.stdout + done.stderr
    assert done.returncode != 0, log[-3000:]
    first = json.loads((tmp_path / "rank0.json").read_text())
    assert first["steps"] == 2 and first["error"].startswith("Fault"), first
    # Its note says what the others do, and why they exit rather than raise.
    assert "ends its process with status 1" in first["notes"], first
    assert "last resort" in first["notes"], first
    if then == "retry":
        assert first["retry"].startswith("OutOfStepError"), first
    for rank in range(1, ranks):
        # Ended by the watcher (os._exit): they never reached the end of their loop.
        assert not (tmp_path / f"rank{rank}.json").exists(), log[-3000:]
    assert "rank 0 failed at batch 2" in log, log[-3000:]
    assert "stops" in log and "waited" in log and "last resort" in log, log[-3000:]
    # The store is polled every second: a rank ends a few seconds after the
    # grace, never at the model group's 120 s timeout; within 15 s of the failure
    # (it noticed the failure at most a poll after it was published).
    waited = [float(w) for w in _waits(log)]
    least = 10.0 if grace is None else grace
    # At least one waiting rank says so (torchrun ends the rest once one exits).
    assert waited, log[-3000:]
    assert least <= min(waited) and max(waited) + 1 < 15, waited


def test_a_peer_whose_first_step_failed_before_this_rank_began_ends_it(
    rank_server: RankServer, tmp_path: Path
) -> None:
    """Rank 0's first step fails in its copy, before any collective, and rank 1
    begins its first step (starting its watcher) only after that: rank 1 waits
    in a step rank 0 will not join, and must end as in the cases above."""
    done, _ = _launch(
        rank_server, tmp_path, 2, "stay", 1.0, "TrainPipelineSparseDist", "--first-step-copy"
    )
    log = done.stdout + done.stderr
    assert done.returncode != 0, log[-3000:]
    first = json.loads((tmp_path / "rank0.json").read_text())
    assert first["steps"] == 0 and "copy of batch 0" in first["error"], first
    assert not (tmp_path / "rank1.json").exists(), log[-3000:]
    assert "rank 0 failed at batch 0" in log, log[-3000:]
    waited = [float(w) for w in _waits(log)]
    assert waited and 1.0 <= min(waited) and max(waited) + 1 < 15, (waited, log[-3000:])


def _waits(log: str) -> list[str]:
    marker = "This rank has waited "
    return [
        line.split(marker, 1)[1].split(" ", 1)[0] for line in log.splitlines() if marker in line
    ]


# ------------------------------------------- the watcher, whatever the order of events
#
# Two ranks' failure news on one store, in this process.  The order of events is
# set by the test: each look at the store is one call (Watch.look, with the time it
# is made), or, with the watcher's own thread, one look the test lets through a
# semaphore.  No sleep decides an order; every wait has a time limit.

GRACE = 5.0


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Tuple[Any, FailureNews, FailureNews]]:
    """(store, rank 0's news, rank 1's news), with a grace of GRACE seconds."""
    monkeypatch.setenv("TREC_PIPELINES_PEER_FAILURE_GRACE", str(GRACE))
    store = HashStore()
    yield store, FailureNews(store, 0, 2, None), FailureNews(store, 1, 2, None)


def test_a_failure_published_between_two_steps_ends_the_next_step(
    ranks: Tuple[Any, FailureNews, FailureNews],
) -> None:
    store, rank0, rank1 = ranks
    watch = Watch(rank1, store)
    rank1.begin_step()
    rank1.end_step()  # rank 1's step 1 went through; it is between two progress() calls
    rank0.failed("TrainPipelineBase.progress() raised Fault: boom", 2)
    assert watch.look(0.0) is None  # not in a step: left alone, but the failure is not forgotten
    rank1.begin_step()  # step 2, which rank 0 will not join
    assert watch.look(1.0) is None  # its wait starts
    assert watch.look(1.0 + GRACE - 0.5) is None
    assert watch.look(1.0 + GRACE) == GRACE


def test_a_failure_published_in_the_step_before_ends_the_step_that_waits(
    ranks: Tuple[Any, FailureNews, FailureNews],
) -> None:
    store, rank0, rank1 = ranks
    watch = Watch(rank1, store)
    rank1.begin_step()  # step 1: its collectives all met, it completes
    rank0.failed("TrainPipelineBase.progress() raised Fault: boom", 2)
    assert watch.look(0.0) is None
    rank1.end_step()
    rank1.begin_step()  # step 2 cannot complete
    assert watch.look(GRACE - 1.0) is None  # step 2's wait starts here, not at step 1's
    assert watch.look(2 * GRACE - 1.5) is None
    assert watch.look(2 * GRACE - 1.0) == GRACE


def test_a_failure_published_before_the_watcher_started_ends_the_first_step(
    ranks: Tuple[Any, FailureNews, FailureNews],
) -> None:
    """Rank 0's first step failed before its first collective, while rank 1 had not
    begun its own: rank 1's first step cannot complete."""
    store, rank0, rank1 = ranks
    rank0.failed("TrainPipelineSparseDist.progress() raised Fault: boom", 0)
    watch = Watch(rank1, store)  # rank 1's first progress() starts its watcher
    rank1.begin_step()
    assert watch.look(0.0) is None  # its wait starts
    assert watch.look(GRACE - 0.5) is None
    assert watch.look(GRACE) == GRACE


def test_a_failure_that_no_longer_stands_or_was_answered_ends_nothing(
    ranks: Tuple[Any, FailureNews, FailureNews],
) -> None:
    store, rank0, rank1 = ranks
    rank0.failed("a failure retried on every rank before rank 1's watcher started", 0)
    rank0.retract()
    watch = Watch(rank1, store)
    rank1.begin_step()
    assert watch.look(0.0) is None and watch.look(2 * GRACE) is None  # it no longer stands
    # Rank 0 fails, fails again (a reset, a new epoch), then its next step goes
    # through: neither failure stands any more.
    rank0.failed("TrainPipelineBase.progress() raised Fault: boom", 1)
    rank0.failed("TrainPipelineBase.progress() raised Fault: boom", 0)
    assert watch.look(3 * GRACE) is None and len(watch.pending) == 2
    rank0.retract()
    assert watch.look(5 * GRACE) is None and not watch.pending
    # Rank 0 fails, and rank 1 fails after it (its collective was cut): rank 1's own
    # failure answers rank 0's, also once a later step of rank 1 went through.
    rank0.failed("TrainPipelineBase.progress() raised Fault: boom", 2)
    rank1.end_step()
    rank1.failed("TrainPipelineBase.progress() raised RuntimeError: Connection reset", 2)
    rank1.begin_step()
    assert watch.look(6 * GRACE) is None and watch.look(8 * GRACE) is None  # it failed too
    rank1.retract()
    assert watch.look(9 * GRACE) is None and watch.look(11 * GRACE) is None


def test_rank_1_retries_first_and_waits_for_rank_0s_retry(
    ranks: Tuple[Any, FailureNews, FailureNews],
) -> None:
    """Both ranks failed at batch 2, rank 0 publishing after rank 1: rank 1's retry
    found both failures, so rank 0's, still standing until rank 0 retries, does not
    end rank 1's retry step."""
    store, rank0, rank1 = ranks
    watch = Watch(rank1, store)
    rank1.failed("TrainPipelineBase.progress() raised Fault: boom", 2)
    rank0.failed("TrainPipelineBase.progress() raised RuntimeError: Connection reset", 2)
    rank1.retry_allowed(2)
    rank1.begin_step()
    assert watch.look(0.0) is None and watch.look(2 * GRACE) is None


def test_a_publication_read_before_its_record_is_written_is_read_at_the_next_look(
    ranks: Tuple[Any, FailureNews, FailureNews],
) -> None:
    store, _, rank1 = ranks
    watch = Watch(rank1, store)
    rank1.begin_step()
    store.add("trec_pipelines/peer_failure/published", 1)  # rank 0 numbered it ...
    assert watch.look(0.0) is None and watch.seen == 0
    store.set("trec_pipelines/peer_failure/published1", "0|1")  # ... and now names it
    assert watch.look(1.0) is None and watch.seen == 1
    assert watch.look(1.0 + GRACE) == GRACE


class _Gate:
    """Lets the watcher thread look at the store only when the test says so."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.go = threading.Semaphore(0)
        self.looked = threading.Semaphore(0)
        self.open = False
        self.ended = threading.Event()
        self.ended_in: List[Optional[int]] = []
        look = Watch.look

        def gated(watch: Watch, now: float) -> Optional[float]:
            if not self.open:
                assert self.go.acquire(timeout=30), "the test never let this look through"
            try:
                return look(watch, now)
            finally:
                self.looked.release()

        def end(news: FailureNews, waited: float) -> None:  # instead of os._exit(1)
            if not self.ended.is_set():
                self.ended_in.append(news.step)
                self.ended.set()

        monkeypatch.setattr(peer_failure, "_POLL_SECONDS", 0.01)
        monkeypatch.setattr(Watch, "look", gated)
        monkeypatch.setattr(FailureNews, "_end", end)

    def one_look(self) -> None:
        self.go.release()
        assert self.looked.acquire(timeout=30), "the watcher did not look"

    def let_go(self) -> None:
        self.open = True
        self.go.release()


@pytest.mark.parametrize("between_steps", [True, False])
def test_the_watcher_thread_ends_the_step_that_waits_whatever_the_order(
    monkeypatch: pytest.MonkeyPatch, between_steps: bool
) -> None:
    monkeypatch.setenv("TREC_PIPELINES_PEER_FAILURE_GRACE", "0.2")
    gate = _Gate(monkeypatch)
    store = HashStore()
    rank0, rank1 = FailureNews(store, 0, 2, None), FailureNews(store, 1, 2, None)
    rank1.start_watcher()
    try:
        rank1.begin_step()
        if between_steps:
            rank1.end_step()
        rank0.failed("TrainPipelineBase.progress() raised Fault: boom", 2)
        gate.one_look()  # the watcher reads the failure in step 1, or between steps
        if not between_steps:
            rank1.end_step()  # step 1 completes after all
        rank1.begin_step()  # step 2: rank 0 will not join it
        gate.let_go()
        assert gate.ended.wait(timeout=30), "rank 1 was left waiting in step 2"
        assert gate.ended_in == [2]
    finally:
        gate.let_go()
        rank1.stop()
