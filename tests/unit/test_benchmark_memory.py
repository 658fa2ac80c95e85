"""The benchmark's memory measurement and its tables, without a process group."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

import trec_pipelines as tp
from benchmarks.contenders.build import PipelineContender
from benchmarks.contenders.variants import Variant
from benchmarks.measuring import memory
from benchmarks.tables import memory_report, results
from tests.unit.fakes import TinyModel, optimizer_for
from tests.unit.test_memory_ledger import _tensors, ledger_batches

CPU = torch.device("cpu")
MiB = 2**20


def _contender() -> PipelineContender:
    variant = Variant("TrainPipelineSparseDist", tp.TrainPipelineSparseDist, None)
    contender = PipelineContender(variant, "ours")
    contender.model = TinyModel()
    contender.optimizer = optimizer_for(contender.model)
    contender.pipeline = tp.TrainPipelineSparseDist(contender.model, contender.optimizer, CPU)
    return contender


def test_held_epoch_sees_the_two_batches_sparse_dist_keeps_between_steps() -> None:
    batches = ledger_batches(7)
    sizes = [sum(t.numel() * t.element_size() for t in _tensors(b)) for b in batches]
    # After step k SparseDist holds nxt (k+1) and new (k+2); the fake's input_dist
    # output is the batch's own KJT, and nothing else stays between steps.
    expected = max(sum(sizes[k + 1 : k + 3]) for k in range(len(batches)))
    measured = memory.held_epoch(_contender(), batches)
    assert measured["held_peak"] == expected
    assert measured["held_by_kind"]["batch"] == expected
    assert measured["max_batches"] == 2 and measured["steps"] == 7
    assert measured["rss_peak"] > 0


def test_ledger_epoch_sees_the_third_batch_within_a_step() -> None:
    contender = _contender()
    result = memory.ledger_epoch(contender, ledger_batches(7))
    assert result is not None and result["max_batches"] == 3
    assert contender.pipeline.memory_samples == []  # recording is off again


def _entry(held: List[int], rss: List[int], ledger_peak: int = 0) -> Dict[str, Any]:
    ranks = []
    for h, r in zip(held, rss, strict=True):
        rank: Dict[str, Any] = {
            "held_peak": h,
            "held_by_kind": {"batch": h, "context": 0, "embeddings": 0, "other": 0},
            "max_batches": 2,
            "rss_peak": r,
            "rss_before": r - MiB,
        }
        if ledger_peak:
            rank["ledger"] = {"peak": ledger_peak, "steady": ledger_peak // 2, "max_batches": 3}
        ranks.append(rank)
    return {"status": "ok", "reason": "", "ranks": ranks}


def _raw() -> Dict[str, Any]:
    contenders = {
        "ours:TrainPipelineSparseDist": {
            "variant": "TrainPipelineSparseDist",
            "side": "ours",
            "mode": "train",
            "shimmed": False,
            "status": "ok",
            "reason": "",
            "seconds": [1.0],
        },
        "torchrec:TrainPipelineSparseDist": {
            "variant": "TrainPipelineSparseDist",
            "side": "torchrec",
            "mode": "train",
            "shimmed": False,
            "status": "ok",
            "reason": "",
            "seconds": [1.0],
        },
    }
    block = {
        "batch_size": 4,
        "steps": 2,
        "contenders": contenders,
        "stages": [],
        "memory": {
            "ours:TrainPipelineSparseDist": _entry(
                [3 * MiB, 5 * MiB], [100 * MiB, 90 * MiB], ledger_peak=6 * MiB
            ),
            "torchrec:TrainPipelineSparseDist": _entry([4 * MiB, 2 * MiB], [80 * MiB, 120 * MiB]),
        },
        "memory_options": [
            {
                "side": "ours",
                "label": "none",
                "options": {},
                "status": "ok",
                "reason": "",
                "ranks": _entry([8 * MiB], [1])["ranks"],
            },
            {
                "side": "ours",
                "label": "clear_data_dist_inputs",
                "options": {"clear_data_dist_inputs": True},
                "status": "ok",
                "reason": "",
                "ranks": _entry([6 * MiB], [1])["ranks"],
            },
            {
                "side": "torchrec",
                "label": "none",
                "options": {},
                "status": "n/a",
                "reason": "boom",
                "ranks": [],
            },
        ],
    }
    return {"world": 2, "throughput": [block], "overhead": None, "peak_rss": [200 * MiB, 300 * MiB]}


def test_columns_next_to_qps_take_the_largest_rank() -> None:
    text = results.format_report(_raw(), repeats=1)
    line = next(ln for ln in text.splitlines() if ln.startswith("TrainPipelineSparseDist "))
    # held ours 5 MiB (rank 1), torchrec 4 MiB (rank 0); RSS ours 100, torchrec 120
    assert line.split()[-4:] == ["5.00", "4.00", "100.00", "120.00"]
    assert "process peak RSS per rank" in text and "200.00 MiB, 300.00 MiB" in text


def test_memory_and_options_tables() -> None:
    text = results.format_report(_raw(), repeats=1)
    memory_line = next(
        ln
        for ln in text.splitlines()
        if ln.startswith("TrainPipelineSparseDist") and "/" in ln and "1.25" in ln
    )
    assert "6.00" in memory_line and "3.00" in memory_line  # ledger peak and steady
    assert memory_line.split()[-1] == "1.00/1.00"  # RSS rose 1 MiB over each epoch
    options = [ln for ln in text.splitlines() if ln.startswith(("ours ", "torchrec "))]
    assert options[0].split()[:4] == ["ours", "none", "8.00", "0.00"]
    assert options[1].split()[:4] == ["ours", "clear_data_dist_inputs", "6.00", "2.00"]
    assert "n/a: boom" in options[2]


def test_summary_carries_memory() -> None:
    summary = results.summary(_raw())
    mem = summary["throughput"][0]["memory"]
    (row,) = mem["variants"]
    assert row["ours_held_peak"] == 5 * MiB and row["torchrec_held_peak"] == 4 * MiB
    assert [o["held_peak"] for o in mem["options"]] == [8 * MiB, 6 * MiB, None]
    assert memory_report.held_peak(None) is None


def test_stash_table_lists_ours_stash_variants_per_rank() -> None:
    def plan(opt: int, emb: int, tables: List[str]) -> Dict[str, Any]:
        return {
            "optimizer_state_bytes": opt,
            "optimizer_state_tensors": 1 if opt else 0,
            "embedding_weight_bytes": emb,
            "embedding_tables": tables,
            "moved": False,
        }

    def entry(*plans: Dict[str, Any]) -> Dict[str, Any]:
        return {
            "status": "ok",
            "reason": "",
            "ranks": [{"held_peak": 1, "stash": p} for p in plans],
        }

    table = memory_report.format_stash(
        {
            "ours:TrainPipelineSparseDistEmbStash": entry(
                plan(0, 2 * 2**20, ["t2"]), plan(0, 3 * 2**20, ["t0", "t1"])
            ),
            "ours:TrainPipelineSparseDistOptStash": entry(plan(2**20, 0, []), plan(2**20, 0, [])),
            "ours:TrainPipelineSparseDist": {
                "status": "ok",
                "reason": "",
                "ranks": [{"held_peak": 1}],
            },
        },
        [
            "TrainPipelineSparseDist",
            "TrainPipelineSparseDistEmbStash",
            "TrainPipelineSparseDistOptStash",
        ],
    )
    assert table is not None
    rows = {line.split()[0]: line for line in table.splitlines()[3:5]}
    assert set(rows) == {"TrainPipelineSparseDistEmbStash", "TrainPipelineSparseDistOptStash"}
    assert "2.00 / 3.00" in rows["TrainPipelineSparseDistEmbStash"]
    assert "t2 / t0,t1" in rows["TrainPipelineSparseDistEmbStash"]
    assert "1.00 / 1.00" in rows["TrainPipelineSparseDistOptStash"]
    assert memory_report.format_stash({}, ["TrainPipelineSparseDist"]) is None
