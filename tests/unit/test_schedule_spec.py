"""Each variant's recorded steady state against the reference document.

``shared/seeds/001`` gives, per upstream variant, a print_schedule table (which
batch, relative to the one in Forward, each task handles, and on which stream)
and the CPU submission order within one ``progress()`` call.  Both are written
out below as data and compared with what our pipelines actually recorded in a
steady-state call.  Where a variant deliberately differs, the entry says why.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

import trec_pipelines as tp
from tests.unit.fakes import TinyModel, drain, make_batches, optimizer_for
from trec_pipelines.pipelines.pt2 import TorchCompileConfig

CPU = torch.device("cpu")

# (task, offset from the Forward batch, stream), in CPU submission order.
Spec = List[Tuple[str, int, str]]

SPECS: Dict[str, Spec] = {
    "TrainPipelineBase": [
        ("ZeroGrad", 0, "default"),
        ("WaitBatch", 0, "default"),
        ("Forward", 0, "default"),
        ("H2D", 1, "memcpy"),
        ("Backward", 0, "default"),
        ("OptimizerStep", 0, "default"),
    ],
    "TrainPipelineSparseDist": [
        ("ZeroGrad", 0, "default"),
        ("WaitBatch", 0, "default"),
        ("InputDistStart", 1, "data_dist"),
        ("H2D", 2, "memcpy"),
        ("Forward", 0, "default"),
        ("InputDistWait", 1, "data_dist"),
        ("Backward", 0, "default"),
        ("OptimizerStep", 0, "default"),
    ],
    "TrainPipelineSparseDistLite": [
        ("ZeroGrad", 0, "default"),
        ("WaitBatch", 0, "default"),
        ("InputDistStart", 0, "default"),
        ("InputDistWait", 0, "default"),
        ("Forward", 0, "default"),
        ("Backward", 0, "default"),
        ("H2D", 1, "memcpy"),
        ("OptimizerStep", 0, "default"),
    ],
    # The document names the lookup stream "emb_lookup"; with the default
    # emb_lookup_stream="data_dist" that stream *is* data_dist, and we record
    # the stream the work really went to (see the "new" entry below).
    "TrainPipelineFusedSparseDist": [
        ("EmbLookup", 0, "data_dist"),
        ("ZeroGrad", 0, "default"),
        ("WaitBatch", 0, "default"),
        ("InputDistStart", 1, "data_dist"),
        ("H2D", 2, "memcpy"),
        ("Forward", 0, "default"),
        ("InputDistWait", 1, "data_dist"),
        ("Backward", 0, "default"),
        ("OptimizerStep", 0, "default"),
    ],
    "PrefetchTrainPipelineSparseDist": [
        ("ZeroGrad", 0, "default"),
        ("WaitBatch", 0, "default"),
        ("H2D", 2, "memcpy"),
        ("InputDistWait", 1, "data_dist"),
        ("Forward", 0, "default"),
        ("EmbPrefetch", 1, "prefetch"),
        ("Backward", 0, "default"),
        ("OptimizerStep", 0, "default"),
        ("InputDistStart", 2, "data_dist"),
    ],
    # The reference lists SemiSync in the declarative tool's stage order
    # (lookup last). Bit-identical results need upstream's real order: in
    # synchronous mode (before start_batch) the lookup of i+1 follows the step,
    # which must have updated the rows it reads.  ZeroGrad opens the step (upstream
    # closes it with zero_grad, which loses a micro-batch under gradient
    # accumulation).  Offsets and streams match the table.
    "TrainPipelineSemiSync": [
        ("InputDistStart", 2, "data_dist"),
        ("ZeroGrad", 0, "default"),
        ("WaitBatch", 0, "default"),
        ("Forward", 0, "default"),
        ("H2D", 3, "memcpy"),
        ("InputDistWait", 2, "data_dist"),
        ("Backward", 0, "default"),
        ("EmbBackward", 0, "default"),
        ("OptimizerStep", 0, "default"),
        ("EmbLookup", 1, "default"),
    ],
    # PT2 loads and copies synchronously on the default stream.
    "TrainPipelinePT2": [
        ("H2D", 0, "default"),
        ("ZeroGrad", 0, "default"),
        ("Forward", 0, "default"),
        ("Backward", 0, "default"),
        ("OptimizerStep", 0, "default"),
    ],
}


def _make(name: str) -> Callable[[torch.nn.Module], Any]:
    cls = getattr(tp, name)
    if name == "TrainPipelinePT2":
        # Eager throughout: the schedule, not the compiler, is under test.
        return lambda m: cls(
            m, optimizer_for(m), CPU, compile_configs=TorchCompileConfig(compile_on_iter=10**6)
        )
    return lambda m: cls(m, optimizer_for(m), CPU)


def steady_state(pipeline: Any, call: int = 3) -> List[Tuple[str, int, str]]:
    actions = [a for a in pipeline.schedule_actions if a.call == call]
    (forward,) = [a for a in actions if a.task == "Forward"]
    return [(a.task, a.batch - forward.batch, a.stream) for a in actions]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_steady_state_matches_reference(name: str) -> None:
    model = TinyModel()
    pipeline = _make(name)(model)
    pipeline.enable_schedule_recording()
    assert len(drain(pipeline, iter(make_batches(8)))) == 8
    assert steady_state(pipeline) == SPECS[name]


def test_semi_sync_mode_issues_the_lookup_before_the_backward() -> None:
    model = TinyModel()
    pipeline = tp.TrainPipelineSemiSync(model, optimizer_for(model), CPU, start_batch=0)
    pipeline.enable_schedule_recording()
    drain(pipeline, iter(make_batches(8)))
    tasks = [task for task, _, _ in steady_state(pipeline)]
    assert tasks.index("EmbLookup") < tasks.index("Backward")
    assert ("EmbLookup", 1, "default") in steady_state(pipeline)


def test_fused_new_lookup_stream_is_recorded_as_emb_lookup() -> None:
    model = TinyModel()
    pipeline = tp.TrainPipelineFusedSparseDist(
        model, optimizer_for(model), CPU, emb_lookup_stream="new"
    )
    pipeline.enable_schedule_recording()
    drain(pipeline, iter(make_batches(6)))
    assert steady_state(pipeline)[0] == ("EmbLookup", 0, "emb_lookup")


def test_schedule_table_and_views(tmp_path: Any) -> None:
    model = TinyModel()
    pipeline = tp.TrainPipelineSparseDist(model, optimizer_for(model), CPU)
    pipeline.enable_schedule_recording()
    drain(pipeline, iter(make_batches(6)))
    rows = {(task, stream): cells for task, stream, cells in pipeline.schedule()}
    # The first call includes the fill, as it really happens.
    assert rows[("H2D", "memcpy")][:3] == [(0, 1, 2), 3, 4]
    assert rows[("InputDistStart", "data_dist")][:3] == [(0, 1), 2, 3]
    assert rows[("Forward", "default")][:3] == [0, 1, 2]
    assert rows[("H2D", "memcpy")][-1] is None
    text = pipeline.print_schedule(5)
    assert "InputDistStart" in text and "i0+i1" in text and "P4" in text and "P5" not in text
    exposed = pipeline.exposed_time()
    assert exposed["Forward"] > 0 and exposed["step"] >= sum(
        v for k, v in exposed.items() if k != "step"
    )
    trace = tmp_path / "trace.json"
    pipeline.export_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"CPU thread", "stream: data_dist", "stream: memcpy"} <= tracks
    assert sum(1 for e in events if e["ph"] == "X" and e["name"].startswith("Forward")) == 12
    png = tmp_path / "timeline.png"
    pipeline.save_timeline(str(png), calls=(2, 4))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_views_accept_stream_roles_named_after_stages(tmp_path: Any) -> None:
    from trec_pipelines.observe.recorder import Action
    from trec_pipelines.observe.schedule_view import draw_timeline, stream_lanes, write_trace

    actions = [
        Action(
            0,
            "data_copy",
            0,
            "data_copy",
            cpu_start=0.0,
            cpu_end=0.001,
            device_start=0.0,
            device_end=0.001,
        ),
        Action(
            0,
            "Forward",
            0,
            "default",
            cpu_start=0.001,
            cpu_end=0.002,
            device_start=0.001,
            device_end=0.002,
        ),
    ]
    assert stream_lanes(actions) == ["default", "data_copy"]
    draw_timeline(actions, str(tmp_path / "t.png"))
    write_trace(actions, str(tmp_path / "t.json"))
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {"stream: data_copy", "stream: default"} <= {
        e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"
    }


@pytest.mark.parametrize("recording", [False, True])
def test_tasks_are_labelled_for_the_pytorch_profiler(recording: bool) -> None:
    model = TinyModel()
    pipeline = tp.TrainPipelineSparseDist(model, optimizer_for(model), CPU)
    if recording:
        pipeline.enable_schedule_recording()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        drain(pipeline, iter(make_batches(4)))
    names = {event.name for event in prof.events()}
    assert {
        "trec_pipelines::Forward",
        "trec_pipelines::InputDistStart",
        "trec_pipelines::H2D",
    } <= names
