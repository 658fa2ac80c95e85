"""The benchmark's per-step overhead: paired within each round, so drift between rounds cancels."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from benchmarks.settings import variants
from benchmarks.tables import overhead, report

STEPS = 100


def _entry(side: str, variant: str, mode: str, ms_per_step: List[float]) -> Dict[str, Any]:
    return {
        "side": side,
        "variant": variant,
        "mode": mode,
        "status": report.OK,
        "seconds": [ms * STEPS / 1e3 for ms in ms_per_step],
    }


def _raw(ours: List[float], theirs: List[float], plain: List[float]) -> Dict[str, Any]:
    return {
        "overhead": {
            "batch_size": 32,
            "steps": STEPS,
            "contenders": {
                "ours:TrainPipelineBase": _entry("ours", "TrainPipelineBase", "train", ours),
                "torchrec:TrainPipelineBase": _entry(
                    "torchrec", "TrainPipelineBase", "train", theirs
                ),
                "plain:train": _entry("plain", "plain", "train", plain),
            },
        }
    }


def test_overhead_is_the_median_of_per_round_differences() -> None:
    # The machine slows down round by round: the three contenders drift together.
    plain = [1.0, 1.5, 2.0, 2.5, 3.0]
    ours = [p + 0.1 for p in plain]
    theirs = [p + 0.4 for p in plain]
    table = overhead.overhead_table(_raw(ours, theirs, plain))
    assert table is not None
    (row,) = table.rows
    assert row.ours_overhead == pytest.approx(0.1)
    assert row.torchrec_overhead == pytest.approx(0.4)
    assert row.overhead_ratio == pytest.approx(0.25)
    # One disturbed plain-loop round: the difference of medians goes negative
    # (3.1 - 4.0), the paired median does not move.
    noisy_plain = [1.0, 1.5, 9.0, 2.5, 3.0]
    table = overhead.overhead_table(_raw(ours, theirs, noisy_plain))
    assert table is not None
    assert table.rows[0].ours_ms - table.plain_ms["train"] < 0  # type: ignore[operator]
    assert table.rows[0].ours_overhead == pytest.approx(0.1)


def test_without_aligned_rounds_the_medians_are_compared() -> None:
    table = overhead.overhead_table(_raw([1.2, 1.3], [1.5, 1.6], [1.0, 1.1, 1.2]))
    assert table is not None
    assert table.rows[0].ours_overhead == pytest.approx(1.25 - 1.1)
    assert "minus the plain loop's in the same round" in overhead.format_overhead(table, 3)


def test_compiled_variants_report_their_recompilations() -> None:
    raw = {
        "world": 2,
        "throughput": [
            {
                "batch_size": 512,
                "steps": 4,
                "stages": [],
                "contenders": {
                    "ours:TrainPipelinePT2": dict(
                        _entry("ours", "TrainPipelinePT2", "train", [1.0]), compiles=0
                    ),
                    "torchrec:TrainPipelinePT2": dict(
                        _entry("torchrec", "TrainPipelinePT2", "train", [1.0]), compiles=2
                    ),
                    "ours:TrainPipelineBase": dict(
                        _entry("ours", "TrainPipelineBase", "train", [1.0]), compiles=0
                    ),
                    "plain:train": _entry("plain", "plain", "train", [1.0]),
                },
            }
        ],
    }
    (table,) = report.throughput_tables(raw)
    lines = report.format_recompiles(table)
    assert lines == [
        "  TrainPipelinePT2: graphs compiled during the timed epochs (after warm-up): ours 0, torchrec 2"
    ]


def test_a_compiled_variant_is_also_measured_against_the_loop_running_its_compiled_code() -> None:
    """Against the eager plain loop, the compiled code's own per-call cost (the
    same in both libraries) is counted as overhead; a second row takes it
    against the plain loop over the same compiled model, leaving the pipeline's work."""
    compiled_plain = "plain:train+" + variants.COMPILED_PLAIN["TrainPipelinePT2"]
    raw = {
        "overhead": {
            "batch_size": 32,
            "steps": STEPS,
            "contenders": {
                "ours:TrainPipelinePT2": _entry("ours", "TrainPipelinePT2", "train", [1.30, 1.40]),
                "torchrec:TrainPipelinePT2": _entry(
                    "torchrec", "TrainPipelinePT2", "train", [1.40, 1.50]
                ),
                "plain:train": _entry("plain", "plain", "train", [1.0, 1.1]),
                compiled_plain: _entry("plain", "plain", "train", [1.2, 1.3]),
            },
        }
    }
    table = overhead.overhead_table(raw)
    assert table is not None
    eager, compiled = table.rows
    assert (eager.reference, compiled.reference) == ("train", "train+compiled model")
    assert eager.ours_overhead == pytest.approx(0.3) and eager.torchrec_overhead == pytest.approx(
        0.4
    )
    assert compiled.ours_overhead == pytest.approx(
        0.1
    ) and compiled.torchrec_overhead == pytest.approx(0.2)
    assert compiled.overhead_ratio == pytest.approx(0.5)
    text = overhead.format_overhead(table, 2)
    assert any(
        line.startswith("TrainPipelinePT2") and "train, compiled model" in line
        for line in text.splitlines()
    )
    # Base has no compiled reference: one row.
    assert len(overhead.overhead_table(_raw([1.1], [1.2], [1.0])).rows) == 1  # type: ignore[union-attr]


def test_our_pipeline_without_batch_validation_is_a_row_of_its_own() -> None:
    """validate_batches=True (the default) does work torchrec's classes do not: the
    twin run with it off shows the pipeline's other work against the same torchrec run."""
    raw = _raw([1.3, 1.3], [1.4, 1.4], [1.0, 1.0])
    raw["overhead"]["contenders"]["ours:TrainPipelineBase" + report.UNVALIDATED] = _entry(
        "ours", "TrainPipelineBase", "train", [1.1, 1.1]
    )
    table = overhead.overhead_table(raw)
    assert table is not None
    validated, unvalidated = table.rows
    assert validated.variant == "TrainPipelineBase" and validated.overhead_ratio == pytest.approx(
        0.75
    )
    assert unvalidated.variant == "TrainPipelineBase, validate_batches=False"
    assert unvalidated.ours_overhead == pytest.approx(0.1)
    assert unvalidated.torchrec_overhead == pytest.approx(0.4)
    assert unvalidated.overhead_ratio == pytest.approx(0.25)


def test_a_side_without_a_figure_says_why_under_the_table() -> None:
    raw = _raw([1.1, 1.2], [1.4, 1.5], [1.0, 1.1])
    failed = dict(raw["overhead"]["contenders"]["torchrec:TrainPipelineBase"])
    failed.update(status=report.NA, reason="failed to build: RuntimeError: no CUDA", seconds=[])
    raw["overhead"]["contenders"]["torchrec:TrainPipelineBase"] = failed
    table = overhead.overhead_table(raw)
    assert table is not None
    text = overhead.format_overhead(table, 2)
    (row,) = [line for line in text.splitlines() if line.startswith("TrainPipelineBase")]
    assert "n/a [1]" in row
    assert text.splitlines()[-1] == "  [1] failed to build: RuntimeError: no CUDA"
