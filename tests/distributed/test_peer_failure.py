"""One rank's data iterator raises and that rank stays alive: the other ranks
raise PeerFailedError in the same progress() call, not wait (torchrec #4270).

The last rank's iterator raises ``OSError`` at its ``next()`` number 3; its
loop catches it and stays out of progress() (neither retrying nor exiting)
until every other rank has seen a retry of its own raise (each says so with a
key in torchrun's store).  Every other rank must raise :class:`PeerFailedError`
naming that rank, batch 3 and the error's first line, in the progress() call
where the failed rank raised; a retry it makes alone must raise
``PeerFailedError`` again, having issued nothing; once the failed rank calls
``progress()`` again, every rank
trains on, and training equals the plain loop over every batch (nothing lost
nor trained twice).  The model's group times out after 30 s and each test has
a time limit, so a rank left waiting fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from datetime import timedelta
from typing import Any, Iterator, List, Tuple

import pytest
import torch
import torch.distributed as dist

import trec_pipelines
from tests.distributed.test_staged_faults import _staged, _train_step
from tests.time_limits import time_limit
from trec_pipelines import PeerFailedError
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    Run,
    _snapshot,
    assert_runs_equal,
    make_batches,
    make_sharded,
    weights,
)
from trec_pipelines.testing.references import plain_loop_of

DEVICE = devices.device()
SEED, DATA_SEED = 1234, 11
GRACE = 1.0  # TREC_PIPELINES_PEER_FAILURE_GRACE here
# How long the failed rank waits for the others' lone retries to raise: a hang
# guard (each takes its step's time and one grace), within the test's time limit.
LONE_WAIT_S = 60
_runs = itertools.count()  # every rank runs the tests in the same order: one key per run
FAIL_AT = 3
ERROR = "OSError: disk gone: shard-1.parquet"
VARIANTS = [
    "TrainPipelineSparseDist",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "TrainPipelineBase",
    "StagedTrainPipeline",
]


class FailsOnce:
    """Iterates ``items``; on ``fails``, ``next()`` number ``at`` raises OSError and
    takes nothing (the next call yields that item)."""

    def __init__(self, items: List[Any], at: int, fails: bool) -> None:
        self._it: Iterator[Any] = iter(items)
        self._at, self._fails, self.calls = at, fails, 0

    def __iter__(self) -> "FailsOnce":
        return self

    def __next__(self) -> Any:
        call, self.calls = self.calls, self.calls + 1
        if self._fails and call == self._at:
            raise OSError(ERROR.split(": ", 1)[1] + "\nsecond line, not in the peers' message")
        return next(self._it)


class LoneRetries:
    """The failed rank stays out of progress() until every other rank has seen a
    retry of its own raise: each says so with a key in torchrun's store (not a
    group: the test's group is what the failure holds up)."""

    def __init__(self, test: str, failed: int) -> None:
        self._store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=LONE_WAIT_S),
        )
        run = next(_runs)
        self._prefix = f"trec_pipelines_tests/peer_failure/{run}/{test}/lone_retry_raised/"
        self._others = [r for r in range(dist.get_world_size()) if r != failed]

    def raised(self) -> None:
        """On another rank: its first lone retry has raised."""
        self._store.set(self._prefix + str(dist.get_rank()), "1")

    def wait(self) -> None:
        """On the failed rank: until every other rank's has (or the hang guard
        expires: the others' checks then say what they saw)."""
        keys = [self._prefix + str(r) for r in self._others]
        with contextlib.suppress(RuntimeError):  # the store's timeout (DistStoreError)
            self._store.wait(keys, timedelta(seconds=LONE_WAIT_S))


def _step(name: str, pipeline: Any, dmp: Any, optimizer: Any, it: Iterator[Any]) -> Any:
    """One progress() (and, for Staged, the caller's training of its batch)."""
    if name != "StagedTrainPipeline":
        return _snapshot(pipeline.progress(it))
    batch = pipeline.progress(it)
    if batch is None:
        raise StopIteration
    return _train_step(dmp, optimizer, batch)


def _train(
    name: str, pipeline: Any, dmp: Any, optimizer: Any, it: Iterator[Any], lone: LoneRetries
) -> Tuple[Run, List[Tuple[BaseException, float]]]:
    """The user's ``try: progress() except Exception`` loop: after its error the
    failed rank waits until the others' lone retries have raised, then goes on;
    the others call again at once."""
    outputs: List[torch.Tensor] = []
    errors: List[Tuple[BaseException, float]] = []
    while len(errors) < 20:
        started = time.monotonic()
        try:
            outputs.append(_step(name, pipeline, dmp, optimizer, it))
        except StopIteration:
            break
        except Exception as error:  # noqa: BLE001  what a user's loop catches
            errors.append((error, time.monotonic() - started))
            if isinstance(error, OSError):
                lone.wait()  # alive, in no step, not retrying
            elif len(errors) == 2:
                lone.raised()  # the first retry after the peer's failure
    return Run(outputs, weights(dmp)), errors


@pytest.mark.parametrize("name", VARIANTS)
def test_a_loader_error_on_one_rank_raises_peer_failed_on_the_others(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TREC_PIPELINES_PEER_FAILURE_GRACE", str(GRACE))
    rank, failed = dist.get_rank(), dist.get_world_size() - 1
    lone = LoneRetries(name, failed)
    short = dist.new_group(backend=devices.backend(), timeout=timedelta(seconds=30))
    batches = make_batches(8, seed=DATA_SEED)
    ref = plain_loop_of(DLRM, "table_wise", batches, seed=SEED, pg=short)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED, pg=short)
    if name == "StagedTrainPipeline":
        pipeline: Any = _staged(dmp)
    else:
        extra = {"start_batch": 100} if name == "TrainPipelineSemiSync" else {}
        pipeline = getattr(trec_pipelines, name)(dmp, optimizer, DEVICE, **extra)
    with time_limit(90):
        ours, errors = _train(
            name, pipeline, dmp, optimizer, FailsOnce(batches, FAIL_AT, rank == failed), lone
        )
    first, seconds = errors[0]
    if rank == failed:
        assert [type(e) for e, _ in errors] == [OSError], errors
        notes = "".join(getattr(first, "__notes__", []))
        assert f"rank {rank}: the data iterator raised this while pulling batch {FAIL_AT}" in notes
        assert "raised PeerFailedError naming this rank" in notes, notes
        assert "call progress() again on every rank" in notes, notes
    else:
        assert isinstance(first, PeerFailedError), errors
        assert (first.rank, first.batch, first.error) == (failed, FAIL_AT, ERROR), first
        assert f"rank {failed} failed at batch {FAIL_AT}: {ERROR}." in str(first), first
        assert "second line" not in str(first)
        assert seconds < 15, f"the peer waited {seconds:.1f} s for the failed rank"
        # Its lone retries, while the failed rank sleeps, raise again, issuing nothing.
        lone = errors[1:]
        assert lone and all(isinstance(e, PeerFailedError) for e, _ in lone), lone
        assert all(e.rank == failed for e, _ in lone), lone  # type: ignore[attr-defined]
        assert all("did not call progress() again within" in str(e) for e, _ in lone), lone
    assert_runs_equal(ref, ours, ("plain loop over every batch", f"{name}, a loader error"))
