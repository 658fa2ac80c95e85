"""trec_pipelines.core.lifetime without a process group: threads and executors released."""

from __future__ import annotations

import gc
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import trec_pipelines
from tests.unit.fakes import TinyModel
from trec_pipelines.core import lifetime


def test_release_all_stops_and_joins_a_registered_thread() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    lifetime.own_thread(thread, stop.set)
    released = lifetime.release_all()
    assert not thread.is_alive() and released["threads"] >= 1
    # Nothing left: a second call releases nothing.
    assert lifetime.release_all() == {"threads": 0, "executors": 0, "groups": 0}


def test_an_executor_goes_with_its_owner_or_at_exit() -> None:
    class Owner:
        pass

    owner = Owner()
    owned = ThreadPoolExecutor(max_workers=1)
    lifetime.own_executor(owned, owner=owner)
    del owner
    gc.collect()
    with pytest.raises(RuntimeError, match="shutdown"):
        owned.submit(int)
    unowned = ThreadPoolExecutor(max_workers=1)
    lifetime.own_executor(unowned)
    assert unowned.submit(int, "3").result() == 3
    lifetime.release_all()
    with pytest.raises(RuntimeError, match="shutdown"):
        unowned.submit(int)


def test_the_data_loading_thread_is_stopped_at_exit() -> None:
    never_ends = iter(lambda: torch.zeros(1), None)
    loader = trec_pipelines.DataLoadingThread(torch.device("cpu"), never_ends, False)
    loader.start()
    assert loader.get_next_batch() is not None
    lifetime.release_all()
    assert not loader.is_alive()


def test_the_cpu_sparse_eval_executor_goes_with_its_pipeline() -> None:
    model = TinyModel()
    pipeline = trec_pipelines.EvalPipelineCPUSparse(
        model, None, torch.device("cpu"), multi_thread=True
    )
    executor = pipeline._sparse_executor
    assert executor is not None
    del pipeline
    gc.collect()
    with pytest.raises(RuntimeError, match="shutdown"):
        executor.submit(int)
