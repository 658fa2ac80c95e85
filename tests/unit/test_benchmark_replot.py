"""``python -m benchmarks replot`` draws every figure a run writes: QPS, timelines and memory figures.

A hand-made ``results.json`` holding one throughput block with a stored
timeline and a stored memory figure is replotted into ``tmp_path``; each
picture a run would have written must be there, as a PNG, and nothing else.
The memory figure's samples are read back as they were stored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List

from benchmarks.figures import replot, timelines
from benchmarks.measuring import timeline_store
from benchmarks.tables import report
from trec_pipelines.observe.action_records import Action, Transfer
from trec_pipelines.observe.ledger import MemorySample
from trec_pipelines.observe.memory import DeviceMemory, Footprint

SD = "TrainPipelineSparseDist"
PNG = b"\x89PNG\r\n\x1a\n"


def _actions() -> List[Action]:
    return [
        Action(call, task, call, "default", "main", 10.0 + call, 10.5 + call, None, None)
        for call in range(1, 6)
        for task in ("Forward",)
    ]


def _samples() -> List[MemorySample]:
    return [
        MemorySample(
            call,
            "Forward",
            call,
            "default",
            10.5 + call,
            Footprint(
                bytes_by_kind={"batch": 1000 * call, "context": 0, "embeddings": 0, "other": 16},
                storages=3,
                batches=2,
                host_batch_bytes=400 * call,
                host_batches=1,
            ),
            DeviceMemory(1, 2, 3) if call == 2 else None,
        )
        for call in range(1, 6)
    ]


def _entry(variant: str, side: str) -> Dict[str, Any]:
    return {
        "variant": variant,
        "side": side,
        "mode": "train",
        "shimmed": False,
        "status": report.OK,
        "reason": "",
        "seconds": [1.0, 1.1, 0.9],
    }


def _results() -> Dict[str, Any]:
    transfers = [Transfer(2, "Forward", 2, "input_dist", 64, 12.0, 12.2)]
    recorded = timeline_store.timeline_json(_actions(), transfers, origin=10.0, on_cpu=True)
    memory = timeline_store.timeline_json(
        _actions(), [], origin=10.0, on_cpu=True, calls=(1, 4), memory=_samples()
    )
    memory.update(title=SD, variant=SD)
    held = {"status": report.OK, "reason": "", "ranks": [{"memory_timeline": memory}, {}]}
    block = {
        "batch_size": 512,
        "steps": 4,
        "rounds": 3,
        "contenders": {
            f"ours:{SD}": _entry(SD, "ours"),
            f"torchrec:{SD}": _entry(SD, "torchrec"),
            "plain:train": _entry("plain", "plain"),
        },
        "stages": [],
        "recorded": {SD: [{"timeline": recorded}, {}]},
        "memory": {f"ours:{SD}": held, f"torchrec:{SD}": {"status": report.OK, "ranks": [{}]}},
    }
    return {"raw": {"world": 2, "throughput": [block], "overhead": None}, "summary": {}}


def test_replot_writes_every_figure_of_the_run(tmp_path: Path) -> None:
    folder, out = tmp_path / "run", tmp_path / "out"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(_results()))
    assert replot.main([str(folder), "--out", str(out)]) == 0
    expected = {
        replot.CHART,
        os.path.join(replot.TIMELINES, timelines.picture_name(SD, 512)),
        os.path.join(replot.TIMELINES, timelines.memory_picture_name(SD, 512)),
    }
    found = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert found == expected
    for name in expected:
        assert (out / name).read_bytes()[:8] == PNG
    assert sorted(os.listdir(folder)) == ["results.json"]  # --out leaves the folder alone


def test_the_memory_samples_read_back_as_stored() -> None:
    stored = timeline_store.timeline_json(
        _actions(), [], origin=10.0, on_cpu=True, memory=_samples()
    )
    read = timeline_store.memory_from_json(json.loads(json.dumps(stored)))
    assert len(read) == len(_samples())
    for got, want in zip(read, _samples(), strict=True):
        assert (got.call, got.task, got.batch, got.stream) == (
            want.call,
            want.task,
            want.batch,
            want.stream,
        )
        assert abs(got.time - (want.time - 10.0)) < 1e-6
        assert got.held.bytes_by_place == want.held.bytes_by_place
        assert got.device == want.device


def test_a_timeline_without_memory_stores_none() -> None:
    stored = timeline_store.timeline_json(_actions(), [], origin=10.0, on_cpu=True)
    assert "memory" not in stored and timeline_store.memory_from_json(stored) == []
