"""The bench's memory report by place: ours never holds more host or device
batches than torchrec's same class, but for the one documented host batch the
ranks' agreement pulls ahead (synthetic results, as the bench's results.json)."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from benchmarks.measuring import memory_places
from benchmarks.tables import memory_report

MiB = 2**20
BATCH = MiB  # the bytes of one batch in these results
VARIANTS = ["TrainPipelineSparseDist", "TrainPipelineBase"]


def _rank(host: int, device: int, agree_ahead: bool) -> Dict[str, Any]:
    """One rank's held_epoch entry holding ``host`` and ``device`` batches at its peak."""
    by_place = {
        "host batch": host * BATCH,
        "device batch": device * BATCH,
        "context": MiB // 2,
        "embeddings": 0,
        "other": 0,
    }
    total = sum(by_place.values())
    return {
        "held_peak": total,
        "held_by_kind": {"batch": (host + device) * BATCH, "context": MiB // 2, "embeddings": 0},
        "held_by_place": by_place,
        "place_peaks": by_place,
        "max_batches": host + device,
        "max_host_batches": host,
        "max_device_batches": device,
        "agree_ahead": agree_ahead,
        "rss_peak": 100 * MiB,
        "rss_before": 99 * MiB,
    }


def _entry(*ranks: Dict[str, Any]) -> Dict[str, Any]:
    return {"status": "ok", "reason": "", "ranks": list(ranks)}


def _memory(ours: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """Torchrec's SparseDist holds 2 device batches, its Base 1; ours as given."""
    theirs = {"TrainPipelineSparseDist": 2, "TrainPipelineBase": 1}
    memory: Dict[str, Any] = {}
    for variant, device in theirs.items():
        memory[f"torchrec:{variant}"] = _entry(*[_rank(0, device, False)] * 2)
        memory[f"ours:{variant}"] = _entry(*ours[variant])
    return memory


def _within() -> Dict[str, Any]:
    """Ours as the default: the same device batches, one agreement host batch more."""
    return _memory(
        {
            "TrainPipelineSparseDist": [_rank(1, 2, True), _rank(1, 2, True)],
            "TrainPipelineBase": [_rank(1, 1, True), _rank(0, 1, True)],
        }
    )


def test_the_agreement_batch_is_allowed_and_shown_with_its_bytes() -> None:
    memory = _within()
    assert memory_places.above_torchrec(memory, VARIANTS) == {}
    text = memory_report.format_memory(memory, VARIANTS, batch_size=4, world=2)
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("TrainPipeline")}
    assert "1/0" in rows["TrainPipelineSparseDist"] and "2/2" in rows["TrainPipelineSparseDist"]
    assert "+1 host (agreement)" in rows["TrainPipelineSparseDist"]
    assert "+1 host (agreement)" in rows["TrainPipelineBase"]
    assert "agree_ahead=False drops it" in text and "1.00 MiB" in text


@pytest.mark.parametrize(
    "variant, ranks, found",
    [
        # One more device batch than torchrec's class, on one rank.
        (
            "TrainPipelineSparseDist",
            [_rank(1, 2, True), _rank(1, 3, True)],
            "device batches 3 > 2",
        ),
        # Two host batches ahead: one more than the agreement's.
        ("TrainPipelineBase", [_rank(2, 1, True), _rank(1, 1, True)], "host batches 2 > 0 + 1"),
        # The agreement's host batch without the agreement pulling ahead (agree_ahead=False).
        ("TrainPipelineBase", [_rank(1, 1, False), _rank(0, 1, False)], "host batches 1 > 0 + 0"),
    ],
)
def test_more_than_torchrec_in_a_place_is_found(
    variant: str, ranks: List[Dict[str, Any]], found: str
) -> None:
    memory = _within()
    memory[f"ours:{variant}"] = _entry(*ranks)
    above = memory_places.above_torchrec(memory, VARIANTS)
    assert list(above) == [variant] and any(found in f for f in above[variant])
    text = memory_report.format_memory(memory, VARIANTS, batch_size=4, world=2)
    row = next(line for line in text.splitlines() if line.startswith(variant + " "))
    assert "ABOVE: " + found in row


def test_device_bytes_above_with_equal_counts_are_found() -> None:
    memory = _within()
    bigger = _rank(1, 2, True)
    bigger["place_peaks"] = {**bigger["place_peaks"], "device batch": 3 * BATCH}
    memory["ours:TrainPipelineSparseDist"] = _entry(bigger, _rank(1, 2, True))
    above = memory_places.above_torchrec(memory, VARIANTS)
    assert above == {"TrainPipelineSparseDist": [f"device batch bytes {3 * BATCH} > {2 * BATCH}"]}


def test_results_without_places_give_no_figures() -> None:
    memory = _within()
    old = _rank(1, 2, True)
    for key in ("held_by_place", "place_peaks", "max_host_batches", "max_device_batches"):
        del old[key]
    memory["ours:TrainPipelineSparseDist"] = _entry(old, old)
    assert memory_places.figures(memory["ours:TrainPipelineSparseDist"]) is None
    assert memory_places.above_torchrec(memory, VARIANTS) == {}
    text = memory_report.format_memory(memory, VARIANTS, batch_size=4, world=2)
    row = next(line for line in text.splitlines() if line.startswith("TrainPipelineSparseDist "))
    assert "by kind" in row and "-/0" in row


def test_the_summary_carries_places_and_what_is_above() -> None:
    memory = _within()
    memory["ours:TrainPipelineBase"] = _entry(_rank(2, 1, True), _rank(0, 1, True))
    block = {"batch_size": 4, "steps": 2, "contenders": {}, "stages": [], "memory": memory}
    out = memory_report.summary(block, VARIANTS)
    rows = {r["variant"]: r for r in out["variants"]}
    assert rows["TrainPipelineSparseDist"]["above_torchrec"] == []
    assert rows["TrainPipelineSparseDist"]["ours_by_place"]["host_batches"] == 1
    assert rows["TrainPipelineSparseDist"]["torchrec_by_place"]["device_batches"] == 2
    assert rows["TrainPipelineBase"]["above_torchrec"] == ["host batches 2 > 0 + 1"]
