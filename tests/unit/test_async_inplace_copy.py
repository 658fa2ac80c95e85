"""``async_inplace_copy`` (torchrec 1.9.2's flag): signature, CPU behaviour, the batch queue.

Its stream protocol on a device with streams is checked in
``test_stream_protocol.py`` (``test_async_inplace_copy_follows_the_protocol``).
"""

from __future__ import annotations

import inspect
import logging
import threading
from concurrent.futures import Future
from typing import Any, List, Tuple

import pytest
import torch

import trec_pipelines as tp
from tests.unit.fakes import (
    TinyModel,
    assert_same_training,
    drain,
    make_batches,
    optimizer_for,
    plain_loop,
)
from trec_pipelines.data.inplace_copy import BatchQueue

CPU = torch.device("cpu")
VARIANTS = [
    "TrainPipelineSparseDist",
    "TrainPipelineSparseDistLite",
    "PrefetchTrainPipelineSparseDist",
]

# torchrec 1.9.2's positional parameters, last ones first differing by class.
_COMMON_TAIL: List[Tuple[str, Any]] = [
    ("enable_inplace_copy_batch", False),
    ("free_features_storage_early", False),
    ("clear_data_dist_inputs", False),
    ("async_inplace_copy", False),
]
UPSTREAM_1_9_2 = {
    "TrainPipelineSparseDist": [
        ("execute_all_batches", True),
        ("apply_jit", False),
        ("context_type", tp.TrainPipelineContext),
        ("pipeline_postproc", False),
        ("custom_model_fwd", None),
        ("dmp_collection_sync_interval_batches", 1),
        ("enqueue_batch_after_forward", False),
    ],
    "TrainPipelineSparseDistLite": [
        ("apply_jit", False),
        ("context_type", tp.TrainPipelineContext),
        ("pipeline_postproc", False),
        ("custom_model_fwd", None),
    ],
    "PrefetchTrainPipelineSparseDist": [
        ("execute_all_batches", True),
        ("apply_jit", False),
        ("pipeline_postproc", True),
        ("custom_model_fwd", None),
    ],
}


def _positional(cls: Any) -> List[Tuple[str, Any]]:
    params = inspect.signature(cls.__init__).parameters.values()
    return [
        (p.name, p.default)
        for p in params
        if p.kind is not inspect.Parameter.KEYWORD_ONLY
        and p.name not in ("self", "model", "optimizer", "device")
    ]


@pytest.mark.parametrize("name", VARIANTS)
def test_async_inplace_copy_takes_torchrecs_position(name: str) -> None:
    ours = _positional(getattr(tp, name))
    expected = UPSTREAM_1_9_2[name] + _COMMON_TAIL
    assert [n for n, _ in ours] == [n for n, _ in expected]
    # Defaults by value; context_type's default is our TrainPipelineContext, not torchrec's.
    assert ours == expected
    keyword_only = [
        p.name
        for p in inspect.signature(getattr(tp, name).__init__).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    # Lite starts a batch's input_dist in the step that trains it: no group to choose.
    dedicated = [] if name == "TrainPipelineSparseDistLite" else ["input_dist_group"]
    assert keyword_only == [
        "rewrite_strategy",
        "on_unpipelined",
        "sync_exhaustion",
        "agree_ahead",
        "validate_batches",
    ] + dedicated + ["autocast_dtype", "grad_scaler"]


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", VARIANTS)
def test_on_cpu_it_is_logged_and_the_copy_stays_synchronous(
    name: str, inplace: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """As torchrec: no streams, no device copy to issue, so no worker; training unchanged."""
    batches = make_batches(5)
    model, ref = TinyModel(), TinyModel()
    cls = getattr(tp, name)
    before = threading.active_count()
    with caplog.at_level(logging.WARNING):
        pipeline = cls(
            model,
            optimizer_for(model),
            CPU,
            enable_inplace_copy_batch=inplace,
            async_inplace_copy=True,
        )
    assert "async_inplace_copy=True has no effect on cpu" in caplog.text
    assert pipeline._async_inplace_copy is False
    outputs = drain(pipeline, iter(batches))
    assert threading.active_count() == before  # no worker thread was started
    assert_same_training(outputs, plain_loop(ref, batches), model, ref)


def test_positional_call_reaches_async_inplace_copy(caplog: pytest.LogCaptureFixture) -> None:
    """torchrec 1.9.2 user code passing every argument positionally still works."""
    model = TinyModel()
    with caplog.at_level(logging.WARNING):
        tp.TrainPipelineSparseDist(
            model,
            optimizer_for(model),
            CPU,
            True,
            False,
            tp.TrainPipelineContext,
            False,
            None,
            1,
            False,
            False,
            False,
            False,
            True,
        )
    assert "async_inplace_copy=True has no effect" in caplog.text


def test_batch_queue_resolves_a_slot_once_when_first_read() -> None:
    resolved: List[int] = []

    class Counting(Future):  # type: ignore[type-arg]
        def result(self, timeout: Any = None) -> Any:
            resolved.append(1)
            return super().result(timeout)

    ready: Future[str] = Counting()
    ready.set_result("batch")
    queue = BatchQueue(["a"])
    queue.append(ready)
    assert len(queue) == 2 and resolved == []
    assert queue[1] == "batch" and queue[1] == "batch"
    assert resolved == [1]  # stored back in the slot: read once
    assert list(queue) == ["a", "batch"]
    failing: Future[str] = Future()
    failing.set_exception(OSError("copy failed"))
    queue.append(failing)
    with pytest.raises(OSError, match="copy failed"):
        queue.pop()
    assert queue.popleft() == "a" and queue.popleft() == "batch" and not queue
