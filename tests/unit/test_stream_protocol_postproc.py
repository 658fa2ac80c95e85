"""The stream protocol with a pipelined postproc, on the recording stand-in device.

The postproc runs in the input_dist stage, on the data_dist stream, one batch
ahead; its output (new memory, allocated there) feeds the input_dist and is
read again by the forward on the default stream.  So the forward's call must
wait for it (the event recorded after the postproc) and ``record_stream`` it
on the default stream, or the allocator could hand its memory to the next
batch's input_dist while the forward still reads it.  Every variant that takes
``pipeline_postproc`` is checked clean, then the hand-off is removed on purpose.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, Tuple

import pytest
import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.unit import (
    test_schedule,
    test_schedule_fused,
    test_schedule_lite_eval,
    test_schedule_prefetch,
    test_schedule_semi_sync,
)
from tests.unit.fakes import ROWS, Batch, make_batches, optimizer_for
from tests.unit.test_stream_protocol import (
    CPU,
    CachingEBC,
    StandIn,
    Variant,
    assert_clean,
    every,
    exact,
    lookup_on,
    record,
    semi_sync_steps,
    table_updated_in_backward,
)
from trec_pipelines.model import postproc as postproc_module
from trec_pipelines.model.args import ArgInfo, CallArgs, Noop
from trec_pipelines.model.context import TrainPipelineContext
from trec_pipelines.model.postproc import PipelinedPostproc
from trec_pipelines.pipelines.comp_autograd import TrainPipelineSparseDistCompAutograd
from trec_pipelines.pipelines.eval_fused_sparse_dist import EvalPipelineFusedSparseDist
from trec_pipelines.pipelines.eval_sparse_dist import EvalPipelineSparseDist
from trec_pipelines.pipelines.fused_sparse_dist import TrainPipelineFusedSparseDist
from trec_pipelines.pipelines.prefetch import PrefetchTrainPipelineSparseDist
from trec_pipelines.pipelines.semi_sync import TrainPipelineSemiSync
from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist
from trec_pipelines.pipelines.sparse_dist_lite import TrainPipelineSparseDistLite
from trec_pipelines.testing import StreamRecorder, check_stream_protocol


class ShiftIds(nn.Module):
    """A postproc making new memory: moved ids (read by input_dist) and doubled
    dense features (read only by the forward)."""

    def forward(self, batch: Batch) -> Batch:
        kjt = batch.sparse
        moved = KeyedJaggedTensor(
            keys=kjt.keys(), values=(kjt.values() + 1) % ROWS, lengths=kjt.lengths().clone()
        )
        return Batch(batch.dense * 2.0, moved, batch.labels)


class WithPostproc(StandIn):
    def __init__(self, ebc: Any = None) -> None:
        super().__init__() if ebc is None else super().__init__(ebc=ebc)
        self.shift = ShiftIds()

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        return super().forward(self.shift(batch))


def _caching() -> WithPostproc:
    return WithPostproc(ebc=CachingEBC)


def _fused_step() -> Tuple[str, ...]:
    return lookup_on("emb_lookup", test_schedule_fused.FUSED_STEP)


VARIANTS = {
    "SparseDist": Variant(
        WithPostproc,
        lambda m: TrainPipelineSparseDist(m, optimizer_for(m), CPU, pipeline_postproc=True),
        lambda n: exact(test_schedule.SPARSE_DIST_FILL, every(test_schedule.SPARSE_DIST_STEP), n),
        ("memcpy", "data_dist"),
    ),
    "SparseDistLite": Variant(
        WithPostproc,
        lambda m: TrainPipelineSparseDistLite(m, optimizer_for(m), CPU, pipeline_postproc=True),
        lambda n: exact(["P0 H2D[i0]@memcpy"], every(test_schedule_lite_eval.LITE_STEP), n),
        ("memcpy",),
    ),
    "Fused-new": Variant(
        WithPostproc,
        lambda m: TrainPipelineFusedSparseDist(
            m, table_updated_in_backward(m), CPU, emb_lookup_stream="new"
        ),
        lambda n: exact(lookup_on("emb_lookup", test_schedule_fused.FILL), every(_fused_step()), n),
        ("memcpy", "data_dist", "emb_lookup"),
    ),
    "SemiSync": Variant(
        WithPostproc,
        lambda m: TrainPipelineSemiSync(m, table_updated_in_backward(m), CPU, start_batch=2),
        lambda n: exact(test_schedule_semi_sync.FILL, semi_sync_steps, n),
        ("memcpy", "data_dist"),
    ),
    "Prefetch": Variant(
        _caching,
        lambda m: PrefetchTrainPipelineSparseDist(m, optimizer_for(m), CPU),
        lambda n: exact(test_schedule_prefetch.FILL, every(test_schedule_prefetch.STEP), n),
        ("memcpy", "data_dist", "prefetch"),
    ),
    "EvalSparseDist": Variant(
        WithPostproc,
        lambda m: EvalPipelineSparseDist(m.eval(), None, CPU, pipeline_postproc=True),
        lambda n: exact(
            test_schedule_lite_eval.EVAL_FILL, every(test_schedule_lite_eval.EVAL_STEP), n
        ),
        ("memcpy", "data_dist"),
    ),
    "EvalFused": Variant(
        WithPostproc,
        lambda m: EvalPipelineFusedSparseDist(m.eval(), None, CPU, emb_lookup_stream="new"),
        lambda n: exact(
            lookup_on("emb_lookup", test_schedule_fused.FILL),
            every(lookup_on("emb_lookup", test_schedule_fused.EVAL_STEP)),
            n,
        ),
        ("memcpy", "data_dist", "emb_lookup"),
    ),
}


def _compiled_autograd_model() -> WithPostproc:
    model = WithPostproc()
    # As in test_stream_protocol: compiled autograd run op by op, so the recorder sees every kernel.
    model._compiled_autograd_options = {"backend": "eager", "dynamic": True, "fullgraph": False}
    return model


VARIANTS["SparseDistCompAutograd"] = Variant(
    _compiled_autograd_model,
    lambda m: TrainPipelineSparseDistCompAutograd(m, optimizer_for(m), CPU, pipeline_postproc=True),
    VARIANTS["SparseDist"].schedule,
    ("memcpy", "data_dist"),
)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_with_a_postproc_follows_the_stream_protocol(name: str) -> None:
    variant = VARIANTS[name]
    recorder = record(variant)
    assert_clean(recorder, variant)
    assert [s.batch for s in recorder.spans if s.task == "InputDistStart"] == list(range(5))


def _without(name: str, value: Any) -> Callable[[Any], ContextManager[None]]:
    @contextlib.contextmanager
    def patch(pipeline: Any) -> Iterator[None]:
        original = getattr(postproc_module, name)
        setattr(postproc_module, name, value)
        try:
            yield
        finally:
            setattr(postproc_module, name, original)

    return patch


def test_postproc_output_without_record_stream_is_reported() -> None:
    violations = check_stream_protocol(
        record(
            VARIANTS["SparseDist"], patch=_without("record_stream_tree", lambda obj, stream: None)
        )
    )
    messages = [v.message for v in violations]
    assert messages and all(v.rule == "b" for v in violations), messages
    # The doubled dense features: made by the postproc on data_dist in the
    # input_dist stage, read by the forward on default.
    assert any(
        "allocated on stream 'data_dist' by aten.mul.Tensor at step P0 InputDistStart[i0]@data_dist"
        in m
        and "used on stream 'default'" in m
        for m in messages
    ), messages


def _hand_over_directly(without_wait: bool) -> Any:
    """A postproc run on data_dist, then its output read on default, with no
    other ordering between the two streams: only the postproc's event orders it."""
    batch = make_batches(1)[0]
    patch = _without("wait_event", lambda stream, event: None) if without_wait else None
    with StreamRecorder() as recorder:
        data_dist = recorder.device.Stream(name="data_dist")
        context = TrainPipelineContext(index=0)
        wrapper = PipelinedPostproc(
            ShiftIds(), "shift", CallArgs([ArgInfo([Noop()])], {}), context, None, data_dist
        )
        wrapper.output_for(batch)  # the input_dist stage
        with patch(None) if patch is not None else contextlib.nullcontext():
            output = wrapper(batch)  # the model's call in the forward, on default
        output.dense.sum()
        del output, context, wrapper
    return check_stream_protocol(recorder)


def test_the_forward_waits_for_the_postproc_event_not_for_the_whole_stream() -> None:
    """In every variant the forward's stream has also waited for data_dist since
    (the batch hand-off), so the event is checked on its own: it alone orders
    the read, and without it the read is reported."""
    assert _hand_over_directly(without_wait=False) == []
    (violation,) = _hand_over_directly(without_wait=True)
    assert violation.rule == "a"
    assert violation.message.startswith("cross-stream read without a wait: tensor float32[3, 3]")
    assert "produced by aten.mul.Tensor on stream 'data_dist'" in violation.message
    assert "read by aten.sum.default on stream 'default'" in violation.message


def test_an_output_record_stream_cannot_reach_is_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Opaque:
        def __init__(self, dense: torch.Tensor) -> None:
            self.dense = dense

    class ToOpaque(nn.Module):
        def forward(self, batch: Batch) -> Opaque:
            return Opaque(batch.dense * 2.0)

    batch = make_batches(1)[0]
    with StreamRecorder() as recorder:
        data_dist = recorder.device.Stream(name="data_dist")
        wrapper = PipelinedPostproc(
            ToOpaque(),
            "opaque",
            CallArgs([ArgInfo([Noop()])], {}),
            TrainPipelineContext(),
            None,
            data_dist,
        )
        for index in range(2):
            context = TrainPipelineContext(index=index)
            wrapper.set_context(context)
            wrapper.output_for(batch)
            wrapper(batch)
    warnings = [
        r.getMessage() for r in caplog.records if "record_stream can reach" in r.getMessage()
    ]
    assert len(warnings) == 1 and "postproc 'opaque' returned a Opaque" in warnings[0]
