"""The benchmark's CLI/config parsing and its result tables, without running anything."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
import torch

from benchmarks.contenders.variants import COMPILED, SHIMMED, Variant, discover
from benchmarks.figures import qps_chart
from benchmarks.settings import netns
from benchmarks.settings.config import PRESETS, BenchConfig, build_parser, parse_args, to_argv
from benchmarks.tables import report, results

# --------------------------------------------------------------------------
# Config and command line
# --------------------------------------------------------------------------


def test_defaults_are_the_issue_s_default_run() -> None:
    cfg = parse_args([])
    assert cfg == BenchConfig()
    assert (cfg.nproc, cfg.sharding_type, cfg.batch_sizes) == (2, "table_wise", (512, 4096))
    assert len(cfg.dims) == 8 and min(cfg.dims) == 16 and max(cfg.dims) == 64
    assert cfg.rows == 100_000 and cfg.pooling == 8
    assert cfg.link_gbit is None and not cfg.include_compiled
    assert cfg.run_name() == "default"
    # Per-step timeline pictures are drawn on demand: --timelines.
    assert not cfg.timelines and parse_args(["--timelines"]).timelines
    assert to_argv(parse_args(["--timelines"])) == ["--timelines"]
    assert (cfg.steps_for(512), cfg.steps_for(4096)) == (24, 8)
    assert (
        parse_args(["--batch-sizes", "64,8192,1024"]).steps_for(8192) == 8
    )  # auto steps follow the sizes


def test_overrides_of_every_kind() -> None:
    cfg = parse_args(
        [
            "--batch-sizes",
            "64,128,256",
            "--steps",
            "5",
            "--link-gbit",
            "2",
            "--variants",
            "TrainPipelineSparseDist,TrainPipelineBase",
            "--no-torchrec",
            "--include-compiled",
            "--emb-lr",
            "0.5",
            "--sharding-type",
            "column_wise",
        ]
    )
    assert cfg.batch_sizes == (64, 128, 256)
    assert [cfg.steps_for(b) for b in cfg.batch_sizes] == [5, 5, 5]
    assert cfg.link_gbit == 2.0 and cfg.run_name() == "link-2gbit"
    assert cfg.variants == ("TrainPipelineSparseDist", "TrainPipelineBase")
    assert cfg.torchrec is False and cfg.include_compiled is True
    assert cfg.emb_lr == 0.5 and cfg.sharding_type == "column_wise"
    assert parse_args(["--name", "mine", "--link-gbit", "0.5"]).run_name() == "mine"
    assert parse_args(["--link-gbit", "0.5"]).run_name() == "link-0.5gbit"


def test_to_argv_round_trips() -> None:
    cfg = parse_args(
        [
            "--batch-sizes",
            "32,64",
            "--steps",
            "3,4",
            "--no-overhead",
            "--link-gbit",
            "1.5",
            "--repeats",
            "2",
        ]
    )
    argv = to_argv(cfg)
    assert parse_args(argv) == cfg
    assert to_argv(BenchConfig()) == []  # the default run needs no arguments


def test_preset_sets_its_fields_and_names_the_run() -> None:
    cfg = parse_args(["--preset", "pipelining"])
    assert cfg.preset == "pipelining" and cfg.run_name() == "pipelining"
    for name, value in PRESETS["pipelining"].items():
        assert getattr(cfg, name) == value, name
    assert cfg.link_gbit == 1.0 and len(cfg.dims) == 16 and not cfg.memory and not cfg.overhead
    assert cfg.torchrec and cfg.stages  # what it is for stays on
    assert not cfg.timelines  # per-step pictures only on demand
    assert parse_args(to_argv(cfg)) == cfg
    assert "pipelining = --dims 8,8" in " ".join(build_parser().format_help().split())


def test_help_says_each_default_once_and_its_quick_look_parses() -> None:
    import dataclasses
    import re
    import shlex

    text = " ".join(build_parser().format_help().split())
    options = dataclasses.fields(BenchConfig)
    # One "(default: ...)" per option, none for -h.
    assert text.count("(default:") == len(options)
    assert "(default: 512,4096)" in text and "(default: (512, 4096))" not in text
    assert "(default: on)" in text and "(default: True)" not in text
    assert "about 20 minutes" in text
    # The quick look it shows is a command line that parses.
    quick = re.search(r"python -m benchmarks (--preset pipelining [^\n]*?) make bench", text)
    assert quick is not None
    cfg = parse_args(shlex.split(quick.group(1).replace("\\ ", "")))
    assert cfg.preset == "pipelining" and cfg.repeats == 3 and len(cfg.variants) == 2


def test_options_next_to_a_preset_win() -> None:
    cfg = parse_args(
        [
            "--batch-sizes",
            "512",
            "--preset",
            "pipelining",
            "--repeats",
            "1",
            "--memory",
            "--name",
            "mine",
        ]
    )
    assert (
        cfg.repeats == 1 and cfg.batch_sizes == (512,) and cfg.memory and cfg.run_name() == "mine"
    )
    assert cfg.pooling == 32 and cfg.steps == (12,)  # the rest from the preset
    assert parse_args(to_argv(cfg)) == cfg


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--steps", "4,4,4"], "--steps takes one value or one per batch size"),
        (["--sharding-type", "diagonal"], "--sharding-type must be one of"),
        (["--link-gbit", "0"], "--link-gbit must be > 0"),
        (["--batch-sizes", "12,x"], "--batch-sizes takes comma-separated int values"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--timeline-steps", "3"], "--timeline-steps must be >= 6"),
        (["--preset", "fast"], "--preset must be one of pipelining"),
    ],
)
def test_bad_values_exit_with_a_message(
    argv: List[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_discover_takes_pipelnclasses_exported_by_the_root() -> None:
    import trec_pipelines

    variants, notes = discover()
    names = [v.name for v in variants]
    assert {"TrainPipelineBase", "TrainPipelineSparseDist"} <= set(names)
    assert set(names) <= set(trec_pipelines.__all__)
    assert not COMPILED & set(names)  # compiled variants need --include-compiled
    assert "TrainPipelinePT2" in " ".join(notes)
    assert "ScheduleRecorder" not in names and "TrainPipelineContext" not in names
    by_name = {v.name: v for v in variants}
    assert by_name["TrainPipelineSparseDist"].theirs is not None
    assert by_name["TrainPipelineSparseDist"].theirs.__module__.startswith("torchrec.")
    assert by_name["TrainPipelineSparseDist"].ours.__module__.startswith("trec_pipelines.")
    with_compiled, _ = discover(include_compiled=True)
    assert "TrainPipelinePT2" in [v.name for v in with_compiled]
    with pytest.raises(ValueError, match="not a pipeline class exported by trec_pipelines"):
        discover(["ScheduleRecorder"])


def test_variant_modes_and_shim() -> None:
    assert Variant("EvalPipelineFusedSparseDist", None, None).mode == "eval"
    assert Variant("EvalPipelineFusedSparseDist", None, None).plain_mode == "eval"
    assert Variant("StagedTrainPipeline", None, None).mode == "staged"
    assert Variant("StagedTrainPipeline", None, None).plain_mode == "train"
    assert Variant("TrainPipelineSparseDist", None, None).shimmed is False
    assert Variant("TrainPipelineSemiSync", None, None).shimmed is True
    assert "TrainPipelineBase" not in SHIMMED


def test_link_plan_limits_only_the_namespace_loopback() -> None:
    plan = netns.plan(2)
    assert plan.tc_args()[:7] == ["tc", "qdisc", "add", "dev", "lo", "root", "tbf"]
    assert "2gbit" in plan.tc_args() and plan.burst_bytes >= 128 * 1024
    command = netns.wrap(["torchrun", "x"], plan)
    assert command[:3] == ["unshare", "-n", "--"]  # the tc call only ever runs inside
    assert command[-3:] == ["--", "torchrun", "x"]


def test_namespace_entry_refuses_the_launcher_s_own_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: List[Any] = []
    monkeypatch.setattr(netns.subprocess, "run", lambda *a, **k: ran.append(a))
    monkeypatch.setenv(netns.HOST_NETNS_ENV, str(netns.netns_inode()))
    assert netns.inside(["2", "131072", "--", "true"]) == 3
    monkeypatch.delenv(netns.HOST_NETNS_ENV)
    assert netns.inside(["2", "131072", "--", "true"]) == 3
    assert ran == []  # never reached tc


# --------------------------------------------------------------------------
# Result tables
# --------------------------------------------------------------------------


def new_entry(
    variant: str,
    side: str,
    seconds: List[float],
    mode: str = "train",
    shimmed: bool = False,
    reason: Optional[str] = None,
) -> Dict[str, Any]:
    return {
        "variant": variant,
        "side": side,
        "mode": mode,
        "shimmed": shimmed,
        "status": report.NA if reason else report.OK,
        "reason": reason or "",
        "seconds": [] if reason else seconds,
    }


def _raw() -> Dict[str, Any]:
    sd, fused = "TrainPipelineSparseDist", "TrainPipelineFusedSparseDist"
    return {
        "world": 2,
        "throughput": [
            {
                "batch_size": 100,
                "steps": 10,
                # examples per epoch: 10 steps x 100 x 2 ranks = 2000
                "contenders": {
                    f"ours:{sd}": new_entry(
                        sd, "ours", [1.0, 2.0, 1.0]
                    ),  # 2000, 1000, 2000 -> median 2000
                    f"torchrec:{sd}": new_entry(sd, "torchrec", [2.0, 2.0, 4.0]),  # median 1000
                    f"ours:{fused}": new_entry(fused, "ours", [1.0]),
                    f"torchrec:{fused}": new_entry(
                        fused, "torchrec", [], shimmed=True, reason="boom on CPU"
                    ),
                    "ours:EvalPipelineSparseDist": new_entry(
                        "EvalPipelineSparseDist", "ours", [0.5], mode="eval"
                    ),
                    "plain:train": new_entry("plain", "plain", [4.0, 4.0]),  # 500
                    "plain:eval": new_entry("plain", "plain", [1.0], mode="eval"),  # 2000
                },
                # per epoch: compute 0.8 s -> 80 ms/step is the slowest stage
                "stages": [{"h2d": 0.01, "input_dist": 0.2, "compute": 0.8}] * 3,
            }
        ],
        "overhead": {
            "batch_size": 8,
            "steps": 100,
            "contenders": {
                f"ours:{sd}": new_entry(sd, "ours", [0.3]),  # 3 ms/step
                f"torchrec:{sd}": new_entry(sd, "torchrec", [0.4]),  # 4 ms/step
                "plain:train": new_entry("plain", "plain", [0.2]),  # 2 ms/step
            },
        },
    }


def test_throughput_medians_ratios_and_bound() -> None:
    (table,) = report.throughput_tables(_raw())
    rows = {r.variant: r for r in table.rows}
    sd = rows["TrainPipelineSparseDist"]
    assert sd.ours.samples == [2000.0, 1000.0, 2000.0]
    assert sd.ours.median == 2000.0 and sd.torchrec.median == 1000.0 and sd.plain.median == 500.0
    assert sd.ours_vs_torchrec == 2.0 and sd.ours_vs_plain == 4.0 and sd.torchrec_vs_plain == 2.0
    assert sd.paired == 2.0  # per round: 2000/1000, 1000/1000, 2000/500 -> 2, 1, 4
    fused = rows["TrainPipelineFusedSparseDist"]
    assert fused.torchrec.median is None and fused.torchrec.reason == "boom on CPU"
    assert fused.ours_vs_torchrec is None
    eval_row = rows["EvalPipelineSparseDist"]
    assert eval_row.plain.median == 2000.0  # compared with the plain eval loop
    assert table.bound is not None
    assert table.bound.costs.stage_ms() == pytest.approx(
        {"h2d": 1.0, "input_dist": 20.0, "compute": 80.0}
    )
    # Stages only (an old result: no CPU times, no recorded epochs): fwd+bwd+opt binds.
    assert table.bound.bound_qps == pytest.approx(2500.0)  # 200 examples per 80 ms step
    bounds = {v.variant: v for v in table.bound.variants}
    assert "EvalPipelineSparseDist" not in bounds  # no bound for eval steps
    assert bounds["TrainPipelineSparseDist"].ours_of_bound == pytest.approx(0.8)
    assert bounds["TrainPipelineSparseDist"].hidden is None


def test_console_tables_show_values_shim_and_reasons() -> None:
    text = results.format_report(_raw(), repeats=3, header=["HEADER"])
    assert text.startswith("HEADER")
    line = next(ln for ln in text.splitlines() if ln.startswith("TrainPipelineSparseDist "))
    assert line.split()[1:] == ["2,000", "±25%", "1,000", "±25%", "2.00", "2.00", "4.00", "2.00"]
    fused = next(ln for ln in text.splitlines() if ln.startswith("TrainPipelineFusedSparseDist"))
    assert "n/a [1]" in fused
    assert "[1] boom on CPU" in text
    assert "EvalPipelineSparseDist (eval)" in text
    assert "plain loop (train)" in text and "plain loop (eval)" in text
    assert "1/max of these = 2,500 ex/s" in text and "-> 2,500 ex/s" in text
    bound = next(
        ln
        for ln in text.splitlines()
        if ln.startswith("TrainPipelineSparseDist ") and "(fwd+bwd+opt)" in ln
    )
    assert "2,000 (80%)" in bound and "1,000 (40%)" in bound
    overhead = next(
        ln for ln in text.splitlines() if ln.startswith("TrainPipelineSparseDist") and "3.00" in ln
    )
    # ms/step 3 and 4, overhead 1 and 2 over the plain loop's 2 ms, ratio 0.5
    assert overhead.split()[1:] == ["3.00", "4.00", "train", "1.00", "2.00", "0.50"]


def test_shimmed_values_are_marked() -> None:
    raw = _raw()
    block = raw["throughput"][0]["contenders"]
    block["torchrec:TrainPipelineFusedSparseDist"] = new_entry(
        "TrainPipelineFusedSparseDist", "torchrec", [1.0], shimmed=True
    )
    text = results.format_report(raw, repeats=1)
    fused = next(ln for ln in text.splitlines() if ln.startswith("TrainPipelineFusedSparseDist"))
    assert "2,000 (shimmed)" in fused


def test_summary_is_plain_json_and_the_chart_is_written(tmp_path: Any) -> None:
    import json

    summary = results.summary(_raw())
    text = json.dumps(summary)  # only JSON types
    assert json.loads(text)["throughput"][0]["variants"][0]["ours_vs_torchrec"] == 2.0
    assert summary["overhead"]["variants"][0]["ours_over_torchrec_overhead"] == pytest.approx(0.5)
    path = tmp_path / "qps.png"
    qps_chart.write_chart(_raw(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_host_facts_and_versions() -> None:
    facts = results.host_facts()
    assert facts["cores"] and facts["cpu_model"]
    versions = results.versions(".")
    assert versions["torch"] and versions["torchrec"] and versions["fbgemm_gpu"]
    assert versions["trec_pipelines"]


def test_rounds_keep_each_pair_back_to_back_and_rotate() -> None:
    from benchmarks.contenders.build import PlainLoop, make_contender
    from benchmarks.running.phase import round_order

    a, b = (
        Variant("TrainPipelineBase", object, object),
        Variant("TrainPipelineSparseDist", object, object),
    )
    contenders = [
        make_contender(a, "ours"),
        make_contender(a, "torchrec"),
        make_contender(b, "ours"),
        make_contender(b, "torchrec"),
        PlainLoop("train"),
    ]
    keys = lambda r: [c.key for c in round_order(contenders, r)]  # noqa: E731
    assert keys(0) == [c.key for c in contenders]
    assert keys(1) == [
        "torchrec:TrainPipelineSparseDist",
        "ours:TrainPipelineSparseDist",
        "plain:train",
        "torchrec:TrainPipelineBase",
        "ours:TrainPipelineBase",
    ]
    for r in range(6):
        order = keys(r)
        assert sorted(order) == sorted(c.key for c in contenders)
        for v in ("TrainPipelineBase", "TrainPipelineSparseDist"):
            assert abs(order.index(f"ours:{v}") - order.index(f"torchrec:{v}")) == 1


# --------------------------------------------------------------------------
# Batch validation's cost
# --------------------------------------------------------------------------


def _with_validation(
    us_per_batch: List[List[float]], status: str = report.OK, reason: str = ""
) -> Dict[str, Any]:
    raw = _raw()
    raw["throughput"][0]["validation"] = {
        "status": status,
        "reason": reason,
        "passes": 3,
        "batches": 10,
        "us_per_batch": us_per_batch,
    }
    return raw


def _validation_lines(raw: Dict[str, Any]) -> List[str]:
    lines = results.format_report(raw, repeats=3).splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("batch validation"))
    return lines[first : first + 2]


def test_validation_cost_lntakes_the_slowest_rank_against_sparse_dist_s_step() -> None:
    # Rank medians 20 and 50 us; ours SparseDist: epochs of 1, 2, 1 s over 10 steps -> 100 ms/step.
    raw = _with_validation([[10.0, 30.0, 20.0], [40.0, 50.0, 60.0]])
    (table,) = report.throughput_tables(raw)
    cost = table.validation
    assert cost is not None and cost.rank_us == [20.0, 50.0] and cost.us_per_batch == 50.0
    assert cost.step_ms == pytest.approx(100.0) and cost.percent_of_step == pytest.approx(0.05)
    line, how = _validation_lines(raw)
    assert line == (
        "batch validation (validate_batches=True): 50.0 us/batch = 0.05% of "
        "TrainPipelineSparseDist's step (100.00 ms)"
    )
    assert how == (
        "  batch_problem alone on the epoch's 10 batches, median of 3 passes outside the timed "
        "epochs, slowest of 2 ranks"
    )
    # Under the throughput table (after its bound line), before the overhead table.
    text = results.format_report(raw, repeats=3)
    assert (
        text.index("Throughput at batch")
        < text.index("batch validation")
        < text.index("Per-step overhead")
    )
    entry = results.summary(raw)["throughput"][0]["batch_validation"]
    assert entry["us_per_batch"] == 50.0 and entry["us_per_batch_per_rank"] == [20.0, 50.0]
    assert entry["percent_of_sparse_dist_step"] == pytest.approx(0.05)
    assert entry["sparse_dist_ms_per_step"] == pytest.approx(100.0)
    assert (entry["passes"], entry["batches"], entry["status"]) == (3, 10, report.OK)


def test_validation_cost_above_target_tiny_missing_or_failed() -> None:
    above = _validation_lines(_with_validation([[2000.0]]))[0]  # 2 ms of a 100 ms step
    assert above.endswith(
        "= 2.00% of TrainPipelineSparseDist's step (100.00 ms), ABOVE the 1% target"
    )
    tiny = _validation_lines(_with_validation([[5.0]]))[0]
    assert "5.0 us/batch = <0.01% of" in tiny
    no_step = _with_validation([[5.0]])
    del no_step["throughput"][0]["contenders"]["ours:TrainPipelineSparseDist"]
    assert _validation_lines(no_step)[0].endswith(
        "5.0 us/batch (TrainPipelineSparseDist's step not measured, so no share of it)"
    )
    assert (
        results.summary(no_step)["throughput"][0]["batch_validation"]["percent_of_sparse_dist_step"]
        is None
    )
    failed = _with_validation([], status=report.NA, reason="ValueError: boom (rank 1)")
    assert (
        _validation_lines(failed)[0]
        == "batch validation (validate_batches=True): n/a (ValueError: boom (rank 1))"
    )
    assert "batch validation" not in results.format_report(
        _raw(), repeats=3
    )  # results from before it was measured


def test_time_batch_validation_times_good_batches_and_refuses_bad_ones() -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from benchmarks.running.block_probes import time_batch_validation
    from trec_pipelines.testing.dlrm_sharded import make_spec_batches
    from trec_pipelines.testing.dlrm_spec import tiny_spec

    batches = make_spec_batches(tiny_spec(), 3, 4, seed=0, rank=0)
    per_pass = time_batch_validation(batches, passes=4)
    assert len(per_pass) == 4 and all(us > 0 for us in per_pass)
    bad = batches[1]
    bad.sparse = KeyedJaggedTensor(
        keys=["f0", "f1"], values=torch.arange(3), lengths=torch.tensor([1, 1, 1, 1])
    )
    with pytest.raises(ValueError, match="benchmark batch 1 is malformed: .*1 missing"):
        time_batch_validation(batches, passes=1)


def test_the_overhead_phase_adds_an_unvalidated_twin_of_each_of_our_pipelines() -> None:
    from benchmarks.contenders.build import PlainLoop, make_contender
    from benchmarks.running.runner import _unvalidated_twins

    variants, _ = discover(["TrainPipelineBase", "StagedTrainPipeline"])
    contenders = [make_contender(v, side) for v in variants for side in ("ours", "torchrec")]
    contenders.append(PlainLoop("train"))
    twins = _unvalidated_twins(contenders)
    assert [t.key for t in twins] == [
        "ours:TrainPipelineBase" + report.UNVALIDATED,
        "ours:StagedTrainPipeline" + report.UNVALIDATED,
    ]
    assert all(t.extra_kwargs == {"validate_batches": False} and t.side == "ours" for t in twins)


def test_staged_contender_passes_its_extra_arguments_to_the_pipeline() -> None:
    from benchmarks.contenders.build import make_contender

    (variant,), _ = discover(["StagedTrainPipeline"])
    contender = make_contender(variant, "ours")
    contender.extra_kwargs = {"validate_batches": False}
    contender.model = torch.nn.Linear(1, 1)  # nothing sharded: the rewrite finds no module
    contender._build()
    assert (
        contender.pipeline is not None and contender.pipeline._options["validate_batches"] is False
    )


def test_the_link_queues_little_per_socket_unless_told_otherwise() -> None:
    plan = netns.plan(1)
    assert plan.socket_queue_bytes == 256 * 1024
    command = netns.wrap(["torchrun", "x"], plan)
    assert command[-6:] == ["1", str(plan.burst_bytes), str(256 * 1024), "--", "torchrun", "x"]
    assert netns.plan(1, 0).socket_queue_bytes == 0


def test_input_dist_groups_are_checked_and_the_pipelining_preset_runs_both() -> None:
    assert parse_args(["--preset", "pipelining"]).input_dist_groups == ("dedicated", "shared")
    assert parse_args([]).input_dist_groups == ("dedicated",)
    for bad in (["--input-dist-groups", "own"], ["--input-dist-groups", "shared,shared"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    with pytest.raises(SystemExit):
        parse_args(["--link-socket-queue-kb", "-1"])
