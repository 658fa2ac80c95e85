"""The read path of one steady-state step stays short: written-out ceilings, on 2 ranks.

:mod:`benchmarks.measuring.read_path` runs the 4th ``progress()`` of a class on
the sharded test DLRM and counts the distinct functions of trec_pipelines that
ran and the files they live in; it also reads the class's private names and
MRO length.  Each ceiling below is the number the class has now: a change that
makes a step run more of our code, or the class carry more private names,
fails here and has to say why in the ceiling it raises.  torchrec 1.8.0's
numbers, for scale (functions / files / private names / MRO): Base 7 / 2 / 8 / 5,
SparseDist 29 / 5 / 16 / 5, Fused 30 / 5 / 16 / 6, SemiSync 33 / 5 / 20 / 6.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Any, Dict, Iterator, Tuple

import pytest

from benchmarks.measuring.read_path import measure_ours

# class -> (functions, files, private names, MRO length)
CEILINGS: Dict[str, Tuple[int, int, int, int]] = {
    "TrainPipelineBase": (30, 8, 25, 6),
    "TrainPipelineSparseDist": (59, 12, 39, 6),
    "TrainPipelineFusedSparseDist": (73, 14, 43, 7),
    # DDP's all-reduce waited after the embedding backward adds 3 functions and
    # 1 file (core/all_reduce_wait.py: the hook, the deferring block and the wait).
    "TrainPipelineSemiSync": (83, 16, 49, 7),
    "PrefetchTrainPipelineSparseDist": (70, 14, 42, 7),
    # The model's forward wrapped by the peer-failure watch (WatchedForward.__call__)
    # rather than hooked, so the model carries only torchrec's hook: 1 function more.
    "StagedTrainPipeline": (79, 15, 36, 6),
}


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Fail the test (TimeoutError) if the block takes longer than ``seconds``."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"over the test's time limit of {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("name", sorted(CEILINGS))
def test_read_path_within_ceiling(name: str) -> None:
    with time_limit(120):  # a hang guard: a few seconds on two busy cores
        path = measure_ours(name)
    assert path.functions is not None, f"{name}: its step did not run"
    got = (path.functions, path.files, path.private_names, path.mro)
    assert all(g <= c for g, c in zip(got, CEILINGS[name], strict=True)), (
        f"{name}: (functions, files, private names, MRO) = {got}, over the ceiling "
        f"{CEILINGS[name]}; the functions run:\n" + "\n".join(path.function_names)
    )
