"""An eval step that raises is rolled back: the next progress() evaluates its batch again.

Both eval pipelines (EvalPipelineSparseDist loading inline or on its thread,
EvalPipelineFusedSparseDist in order or with the lookup prefetched) against
the plain forward of every batch, in order: a forward that raises once (before
or after the embedding lookup, at the first, a middle or the last batch) costs
one exception and nothing else; each batch is pulled from the iterator once.
Before, such a failure left the pipeline unable to go on ("called twice",
"no pipelined input").  See [Note: a failed eval step].
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch

import trec_pipelines as tp
from tests.fault_injection import Fault
from tests.time_limits import exit_after
from tests.unit.fakes import TinyModel, make_batches
from tests.unit.test_step_guard import Counting, FaultyModel

CPU = torch.device("cpu")

# (class name, its options): every loading mode and schedule of the two classes.
EVAL_VARIANTS: List[Tuple[str, Dict[str, Any]]] = [
    ("EvalPipelineSparseDist", {"loader_thread": False}),
    ("EvalPipelineSparseDist", {"loader_thread": True}),
    ("EvalPipelineFusedSparseDist", {}),
    ("EvalPipelineFusedSparseDist", {"enable_embedding_lookup_prefetch": True}),
]
IDS = ["inline", "thread", "fused", "fused-prefetch"]


def _expected(batches: List[Any]) -> List[torch.Tensor]:
    """The plain forward's predictions (TinyModel's weights, as FaultyModel's)."""
    model = TinyModel()
    model.eval()
    with torch.no_grad():
        return [model(batch)[1] for batch in batches]


def _evaluate(pipeline: Any, iterator: Iterator[Any], limit: int = 50) -> List[Any]:
    """Call progress() until StopIteration: each output, or the exception's type
    and notes in place of the output it did not give."""
    events: List[Any] = []
    for _ in range(limit):
        try:
            events.append(pipeline.progress(iterator))
        except StopIteration:
            return events
        except Exception as error:  # noqa: BLE001  what the test looks at
            events.append((type(error), "".join(getattr(error, "__notes__", []))))
    raise AssertionError(f"the pipeline did not stop after {limit} calls")


def _make(name: str, options: Dict[str, Any], model: torch.nn.Module) -> Any:
    model.eval()
    return getattr(tp, name)(model, None, CPU, **options)


@pytest.mark.parametrize("name,options", EVAL_VARIANTS, ids=IDS)
@pytest.mark.parametrize("where", ["before_lookup", "after_lookup"])
@pytest.mark.parametrize("at", [0, 2, 5])
def test_a_forward_that_raises_once_is_evaluated_again_by_the_next_call(
    name: str, options: Dict[str, Any], where: str, at: int
) -> None:
    batches = make_batches(6)
    expected = _expected(batches)
    pipeline = _make(name, options, FaultyModel(where, at))
    iterator = Counting(batches)
    with exit_after(120):  # a loader thread that never hands over would hang
        events = _evaluate(pipeline, iterator)
    failures = [k for k, event in enumerate(events) if isinstance(event, tuple)]
    assert failures == [at], events
    kind, notes = events[at]
    assert kind is Fault
    assert f"raised while evaluating batch {at}" in notes, notes
    assert f"the next progress() retries batch {at}" in notes, notes
    outputs = events[:at] + events[at + 1 :]
    assert len(outputs) == len(expected), f"{len(outputs)} outputs, expected {len(expected)}"
    for k, (ours, want) in enumerate(zip(outputs, expected, strict=True)):
        assert torch.equal(ours, want), f"batch {k} differs from the plain forward"
    assert iterator.pulls == len(batches) + 1, "a batch was pulled twice, or one was lost"


@pytest.mark.parametrize("name,options", EVAL_VARIANTS, ids=IDS)
def test_skip_failed_batch_goes_on_with_the_next_batch(name: str, options: Dict[str, Any]) -> None:
    batches = make_batches(5)
    expected = _expected(batches)
    pipeline = _make(name, options, FaultyModel("after_lookup", 2))
    it = iter(batches)
    with exit_after(120):
        outputs = [pipeline.progress(it) for _ in range(2)]
        with pytest.raises(Fault):
            pipeline.progress(it)
        assert pipeline.skip_failed_batch() == 2
        while True:
            try:
                outputs.append(pipeline.progress(it))
            except StopIteration:
                break
    want = expected[:2] + expected[3:]
    assert len(outputs) == len(want)
    for k, (ours, ref) in enumerate(zip(outputs, want, strict=True)):
        assert torch.equal(ours, ref), f"output {k} differs from the plain forward without batch 2"


class _RaisesAt:
    """The batches, except that ``next()`` raises OSError at position ``at``."""

    def __init__(self, batches: List[Any], at: int) -> None:
        self._batches, self._at, self._pos = batches, at, 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        pos, self._pos = self._pos, self._pos + 1
        if pos == self._at:
            raise OSError("the data went away")
        if pos >= len(self._batches):
            raise StopIteration
        return self._batches[pos]


@pytest.mark.parametrize("thread", [False, True], ids=["inline", "thread"])
def test_a_loader_error_met_before_a_failed_step_still_comes_where_it_was(thread: bool) -> None:
    """Batch 2's forward raises while the loader thread has already met the
    iterator's error for batch 4 (it loads one batch ahead); the rollback keeps
    that error for the next loader: both modes give the same outputs and errors,
    in the same order, as inline loading (which pulls batch 4 later)."""
    batches = make_batches(4)
    expected = _expected(batches)
    pipeline = _make(
        "EvalPipelineSparseDist", {"loader_thread": thread}, FaultyModel("after_lookup", 2)
    )
    with exit_after(120):
        events = _evaluate(pipeline, _RaisesAt(batches, 4))
    kinds = [event[0] if isinstance(event, tuple) else "output" for event in events]
    # batches 0 and 1, batch 2's forward raises, batch 2 again, the iterator's error
    # where batch 4 was to be loaded (loading ends there), batch 3 still comes out.
    assert kinds == ["output", "output", Fault, "output", OSError, "output"], events
    outputs = [event for event in events if not isinstance(event, tuple)]
    for k, (ours, want) in enumerate(zip(outputs, expected, strict=True)):
        assert torch.equal(ours, want), f"batch {k} differs from the plain forward"
