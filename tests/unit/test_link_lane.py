"""The link lanes of the timeline: each all-to-all from its issue to its completion.

Hand-made :class:`Transfer` lists against the boxes written out by hand; the
recorder's attribution of an all-to-all to the verb it was issued in; the
wrapper of ``all_to_all_single`` installed and removed with the recording; the
bench's stored timeline read back as it was recorded.  (A real all-to-all's
completion on two ranks: tests/distributed/test_link_recording.py.)
"""

from __future__ import annotations

import os
import weakref
from typing import Any, List, Tuple

import pytest
import torch
import torch.distributed as dist

from benchmarks.figures import timelines
from benchmarks.measuring import timeline_store
from trec_pipelines.observe import all_to_all_watch as links, schedule_view
from trec_pipelines.observe.action_records import Action, Transfer
from trec_pipelines.observe.recorder import ScheduleRecorder
from trec_pipelines.observe.schedule_view import LinkBox, link_boxes, link_lanes

IDS, MODEL = links.INPUT_DIST_GROUP, links.MODEL_GROUP
CPU = torch.device("cpu")


def _transfers() -> List[Transfer]:
    # Seconds from an origin of 10.0; the ids of batch 3 and the embeddings of
    # batch 2 overlap on two groups, two ids all-to-alls overlap on one.
    return [
        Transfer(1, "InputDistStart", 3, IDS, 64, 10.000, 10.002),
        Transfer(1, "InputDistWait", 3, IDS, 4096, 10.003, 10.010),
        Transfer(1, "InputDistWait", 3, IDS, 2048, 10.004, 10.008),
        Transfer(1, "Forward", 2, MODEL, 8192, 10.005, 10.020),
        Transfer(2, "InputDistStart", 4, IDS, 64, 10.012, 10.013),  # row 0 is free again
        Transfer(2, "Backward", 2, MODEL, 8192, 10.025, None),  # not completed: no box
        Transfer(3, None, None, MODEL, 8, 10.030, 10.031),
    ]


def test_link_boxes_are_the_recorded_issue_and_completion_times() -> None:
    boxes = link_boxes(_transfers(), origin=10.0)
    expected = [
        LinkBox(IDS, 0, 0.0, 2.0, 3, "InputDistStart i3"),
        LinkBox(IDS, 0, 3.0, 10.0, 3, "InputDistWait i3"),
        LinkBox(IDS, 1, 4.0, 8.0, 3, "InputDistWait i3"),
        LinkBox(MODEL, 0, 5.0, 20.0, 2, "Forward i2"),
        LinkBox(IDS, 0, 12.0, 13.0, 4, "InputDistStart i4"),
        LinkBox(MODEL, 0, 30.0, 31.0, None, "all-to-all"),
    ]
    assert [b.group for b in boxes] == [e.group for e in expected]
    assert [b.row for b in boxes] == [e.row for e in expected]
    assert [(b.batch, b.label) for b in boxes] == [(e.batch, e.label) for e in expected]
    assert [b.start for b in boxes] == pytest.approx([e.start for e in expected], abs=1e-9)
    assert [b.end for b in boxes] == pytest.approx([e.end for e in expected], abs=1e-9)


def test_link_boxes_keep_the_window_of_calls() -> None:
    boxes = link_boxes(_transfers(), origin=10.0, calls=(2, 3))
    assert [(b.label, b.row) for b in boxes] == [("InputDistStart i4", 0), ("all-to-all", 0)]


def test_link_lanes_put_the_input_dist_group_first() -> None:
    transfers = [Transfer(0, None, None, g, 0, 0.0, 1.0) for g in ("other", MODEL, IDS)]
    assert link_lanes(transfers) == [IDS, MODEL, "other"]
    assert link_lanes([]) == []


def _actions() -> List[Action]:
    return [
        Action(1, "InputDistStart", 3, "data_dist", "main", 10.0, 10.001, 10.0, 10.001),
        Action(1, "Forward", 2, "default", "main", 10.001, 10.02, 10.001, 10.02),
        Action(2, "Backward", 2, "default", "main", 10.02, 10.05, 10.02, 10.05),
        Action(3, "OptimizerStep", None, "default", "main", 10.05, 10.06, 10.05, 10.06),
    ]


def test_runs_on_cpu_is_read_from_the_device_times() -> None:
    actions = _actions()
    assert schedule_view.runs_on_cpu(actions)
    actions[1].device_end = 10.03  # a stream that ran past its issue: a device
    assert not schedule_view.runs_on_cpu(actions)


def test_draw_timeline_with_link_lanes_writes_a_png(tmp_path: "os.PathLike[str]") -> None:
    path = os.path.join(tmp_path, "timeline.png")
    schedule_view.draw_timeline(_actions(), path, title="t", transfers=_transfers())
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_recorder_notes_an_all_to_all_under_the_innermost_open_verb() -> None:
    recorder = ScheduleRecorder()
    recorder.begin_call()
    with recorder.span("Forward", 2, "default"):
        with recorder.span("InputDistWait", 3, "data_dist"):
            inner = recorder.note_transfer(IDS, 16, 1.0, CPU)
        outer = recorder.note_transfer(MODEL, 32, 2.0, CPU)
    outside = recorder.note_transfer(MODEL, 8, 3.0, CPU)
    assert recorder.transfers == [
        Transfer(0, "InputDistWait", 3, IDS, 16, 1.0),
        Transfer(0, "Forward", 2, MODEL, 32, 2.0),
        Transfer(0, None, None, MODEL, 8, 3.0),
    ]
    assert (inner, outer, outside) == tuple(recorder.transfers)
    assert recorder.enclosing() is None


def test_the_wrapper_lives_as_long_as_a_recorder_watches(monkeypatch: pytest.MonkeyPatch) -> None:
    # From torch's own function with nobody watching, whatever an earlier test in
    # this process left (a spy that put our wrapper back after the last recorder
    # stopped leaves the wrapper in place, passing calls straight through; a
    # pipeline not yet collected still watches).
    original = torch.distributed.distributed_c10d.all_to_all_single
    monkeypatch.setattr(dist, "all_to_all_single", original)
    monkeypatch.setattr(links, "_original", None)
    monkeypatch.setattr(links, "_watching", weakref.WeakValueDictionary())
    first, second = ScheduleRecorder(), ScheduleRecorder()
    links.watch(first)
    links.watch(second)
    try:
        assert dist.all_to_all_single is not original and links.watched()
        links.unwatch(first)
        assert dist.all_to_all_single is not original
    finally:
        links.unwatch(first)
        links.unwatch(second)
    assert dist.all_to_all_single is original and not links.watched()


def test_a_wrapper_left_under_a_spy_removes_itself_once_back_on_top(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A spy wraps ours while a recorder watches and puts ours back only after the
    # recorder stopped: ours stays until its next call, which goes straight to
    # torch's function (here a stand-in) and puts that back.
    calls: List[Tuple[Any, ...]] = []

    def torch_function(*args: Any, **kwargs: Any) -> None:
        calls.append(args)

    monkeypatch.setattr(dist, "all_to_all_single", torch_function)
    monkeypatch.setattr(links, "_original", None)
    monkeypatch.setattr(links, "_watching", weakref.WeakValueDictionary())
    recorder = ScheduleRecorder()
    links.watch(recorder)
    ours = dist.all_to_all_single
    spy = lambda *args, **kwargs: ours(*args, **kwargs)  # noqa: E731
    dist.all_to_all_single = spy
    links.unwatch(recorder)
    assert dist.all_to_all_single is spy and links._original is torch_function
    dist.all_to_all_single = ours  # the spy puts back what it found
    dist.all_to_all_single("out", "in")
    assert calls == [("out", "in")]
    assert dist.all_to_all_single is torch_function and links._original is None


def test_the_stored_timeline_reads_back_as_recorded() -> None:
    actions, transfers = _actions(), _transfers()
    stored = timeline_store.timeline_json(actions, transfers, origin=10.0, on_cpu=True)
    read_actions, read_transfers = timeline_store.timeline_from_json(stored)
    assert stored["calls"] == list(timeline_store.TIMELINE_CALLS) and stored["on_cpu"] is True
    for read, recorded in zip(read_actions, actions, strict=True):
        assert (read.call, read.task, read.batch, read.stream, read.thread) == (
            recorded.call,
            recorded.task,
            recorded.batch,
            recorded.stream,
            recorded.thread,
        )
        assert read.cpu_start == pytest.approx(recorded.cpu_start - 10.0)
        assert read.device_end == pytest.approx(recorded.device_end - 10.0)
    assert len(read_transfers) == len(transfers)
    for got, want in zip(read_transfers, transfers, strict=True):
        assert (got.call, got.task, got.batch, got.group, got.nbytes) == (
            want.call,
            want.task,
            want.batch,
            want.group,
            want.nbytes,
        )
        assert got.issued == pytest.approx(want.issued - 10.0)
        assert (got.completed is None) == (want.completed is None)


def test_redraw_timelines_draws_each_stored_one(tmp_path: "os.PathLike[str]") -> None:
    stored = timeline_store.timeline_json(_actions(), _transfers(), origin=10.0, on_cpu=True)
    stored["calls"] = [1, 3]
    results = {
        "raw": {
            "throughput": [
                {
                    "batch_size": 512,
                    "recorded": {
                        "TrainPipelineSparseDist [shared]": [{"timeline": stored}, {}],
                        "TrainPipelineBase": [{}, {}],  # stored before timelines were
                    },
                }
            ]
        }
    }
    written = timelines.redraw_timelines(results, str(tmp_path))
    assert written == [os.path.join(str(tmp_path), "TrainPipelineSparseDist_shared_b512.png")]
    assert os.path.getsize(written[0]) > 0
