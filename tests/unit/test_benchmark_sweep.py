"""The regime map (``python -m benchmarks sweep``): its plan, its records, its JSON and figure (nothing run)."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

import pytest

from benchmarks.figures import replot, sweep_chart
from benchmarks.running import sweep
from benchmarks.settings.config import parse_args as bench_args

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_plan_is_the_grid_and_each_point_a_bench_command_line() -> None:
    cfg, dry_run = sweep.parse_args(["--dims", "128,8,32", "--link-gbits", "10,1"])
    assert not dry_run
    points = sweep.plan(cfg)
    assert [p.name for p in points] == [
        "dim8-10gbit",
        "dim32-10gbit",
        "dim128-10gbit",
        "dim8-1gbit",
        "dim32-1gbit",
        "dim128-1gbit",
    ]
    point = points[1]
    bench = bench_args(sweep.point_argv(cfg, point))
    assert bench.dims == (32,) * 26 and bench.link_gbit == 10.0
    assert bench.variants == sweep.SWEEP_VARIANTS and not bench.torchrec
    assert bench.stages and not bench.timelines and not bench.memory and not bench.overhead
    assert bench.poolings == bench_args(["--preset", "dlrm-dcnv2"]).poolings
    assert bench.run_name() == "dim32-10gbit"
    assert bench.out_dir.endswith("sweep/points")
    assert sweep.plan(sweep.SweepConfig(dims=(8, 8), link_gbits=(1.0,))) == [
        sweep.SweepPoint(8, 1.0)
    ]


def test_defaults_and_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    cfg, _ = sweep.parse_args([])
    assert cfg == sweep.SweepConfig()
    assert cfg.dims == (8, 32, 128) and cfg.link_gbits == (1.0, 10.0) and len(cfg.variants) == 4
    assert sweep.parse_args(["--dry-run"])[1]
    for argv, fragment in (
        (["--dims", "0,8"], "--dims needs positive"),
        (["--link-gbits", "0"], "--link-gbits needs positive"),
        (["--preset", "nope"], "--preset must be one of"),
        (["--steps", "1"], "--steps >= 2"),
    ):
        with pytest.raises(SystemExit):
            sweep.parse_args(argv)
        assert fragment in capsys.readouterr().err


def test_dry_run_prints_the_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert sweep.main(["--dims", "8,128", "--link-gbits", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 points x 4 variants" in out
    assert "dim8-1gbit: python -m benchmarks --preset dlrm-dcnv2" in out and "dim128-1gbit" in out


def _results(
    plain: float,
    ours: Dict[str, float],
    bound: float,
    ids: float,
    model: float,
    dependency: Optional[Dict[str, float]] = None,
) -> Dict[str, Any]:
    """A point's results.json, as far as the sweep reads it."""
    rows = [
        {
            "variant": v,
            "mode": "staged" if v.startswith("Staged") else "train",
            "ours": {"median": q},
            "ours_vs_plain": q / plain,
        }
        for v, q in ours.items()
    ]
    rows.append({"variant": "EvalPipelineSparseDist", "mode": "eval", "ours": {"median": 1.0}})
    return {
        "link": {"emulated": True},
        "summary": {
            "throughput": [
                {
                    "plain": {"train": {"median": plain}},
                    "variants": rows,
                    "bound": {
                        "any_schedule": {"bound_qps": bound, "binding": "link"},
                        "costs_ms_per_step": {"link_input_dist": 3.0, "link_compute": 100.0},
                        "link_bytes_per_step": {"input_dist": ids, "compute": model},
                        "stage_ms_per_step": {"compute": 80.0},
                        # the plain loop's share of each semantics' dependency bound
                        "dependency": {
                            "semantics": {
                                s: {"plain_of_bound": share}
                                for s, share in (dependency or {}).items()
                            }
                        },
                    },
                }
            ]
        },
    }


def test_a_point_s_record() -> None:
    point = sweep.SweepPoint(128, 1.0)
    shares = {"sync": 0.8, "one-step-stale": 0.5}
    record = sweep.point_record(
        point, _results(1000.0, {"TrainPipelineSparseDist": 1100.0}, 1500.0, 1e5, 9e5, shares)
    )
    # The plain loop at 80% and 50% of the bounds: they are 1.25x and 2x its rate.
    assert record["dependency_vs_plain"] == {
        "sync": pytest.approx(1.25),
        "one-step-stale": pytest.approx(2.0),
    }
    older = sweep.point_record(point, _results(1000.0, {}, 1500.0, 1e5, 9e5))
    assert older["dependency_vs_plain"] == {}  # a point from before the dependency bound
    assert record["status"] == "ok" and record["name"] == "dim128-1gbit"
    assert record["variants"] == {
        "TrainPipelineSparseDist": {"ours_qps": 1100.0, "ours_vs_plain": pytest.approx(1.1)}
    }
    assert record["bound_vs_plain"] == pytest.approx(1.5) and record["bound_binding"] == "link"
    assert record["link_bytes"] == {"input_dist": 1e5, "model": 9e5}
    assert record["link_ms"] == {"input_dist": 3.0, "model": 100.0}
    failed = sweep.point_record(point, {"summary": {"throughput": []}})
    assert failed["status"] == "failed" and "no throughput" in failed["reason"]


def _document() -> Dict[str, Any]:
    cfg = sweep.SweepConfig(dims=(8, 128), link_gbits=(1.0, 10.0))
    records: List[Dict[str, Any]] = []
    for point in sweep.plan(cfg):
        ratio = 1.3 if point.dim == 8 else 1.02
        ours = {v: 1000.0 * ratio for v in sweep.SWEEP_VARIANTS}
        ids, model = (4e5, 1e5) if point.dim == 8 else (4e5, 1.3e7)
        shares = {"sync": 1 / (ratio + 0.3), "one-step-stale": 1 / (ratio + 0.4)}
        records.append(
            sweep.point_record(
                point, _results(1000.0, ours, 1000.0 * (ratio + 0.2), ids, model, shares)
            )
        )
    records[-1] = {
        "dim": 128,
        "link_gbit": 10.0,
        "name": "dim128-10gbit",
        "status": "failed",
        "reason": "x",
    }
    return sweep.sweep_document(cfg, records)


def test_panels_are_what_is_drawn() -> None:
    slow, fast = sweep_chart.panels(_document())
    assert (slow.link_gbit, fast.link_gbit) == (1.0, 10.0)
    assert slow.dims == [8, 128] and fast.failed == [128]
    assert slow.variants["TrainPipelineSparseDist"] == [
        (8, pytest.approx(1.3)),
        (128, pytest.approx(1.02)),
    ]
    assert slow.bound == [(8, pytest.approx(1.5)), (128, pytest.approx(1.22))]
    assert slow.dependency == {
        "sync": [(8, pytest.approx(1.6)), (128, pytest.approx(1.32))],
        "one-step-stale": [(8, pytest.approx(1.7)), (128, pytest.approx(1.42))],
    }
    share: Optional[float] = slow.input_dist_share[8]
    assert share == pytest.approx(0.8) and slow.input_dist_share[128] == pytest.approx(4e5 / 1.34e7)
    assert list(fast.variants["TrainPipelineSparseDist"]) == [(8, pytest.approx(1.3))]
    assert set(slow.variants) == set(sweep.SWEEP_VARIANTS)  # Staged's rows are training rows too


def test_write_and_replot(tmp_path: Any) -> None:
    document = _document()
    folder = tmp_path / "sweep"
    written = sweep.write(document, str(folder))
    assert [p.rsplit("/", 1)[1] for p in written] == [sweep.SWEEP_JSON, sweep.SWEEP_FIGURE]
    assert json.loads((folder / sweep.SWEEP_JSON).read_text()) == json.loads(json.dumps(document))
    assert (folder / sweep.SWEEP_FIGURE).read_bytes()[:8] == PNG
    out = tmp_path / "again"
    assert replot.main([str(folder), "--out", str(out)]) == 0
    assert (out / sweep.SWEEP_FIGURE).read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match="no points to draw"):
        sweep_chart.write_chart({"points": []}, str(tmp_path / "empty.png"))
