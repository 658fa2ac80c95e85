"""advise without a process group: the helpers, the table, the PNG, the CLI (the verdict: test_advise_verdict)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, List, Optional

import pytest

from tests.unit.test_advise_verdict import STEPS, at, measured, plain
from trec_pipelines.advise.advice import Advice, VariantReport, not_applicable_line, parse_bytes
from trec_pipelines.advise.cli import _without_nproc, load_build, parser
from trec_pipelines.advise.measure import BuildError, Taken, _exposed_per_step, call_build, take
from trec_pipelines.advise.run import _round_order
from trec_pipelines.advise.variants import Variant, iterable_problem, not_applicable, resolve
from trec_pipelines.advise.verdict import Answer, band, judge, typical_spread

MIB = 2**20


def test_parse_bytes() -> None:
    assert parse_bytes("64MiB") == 64 * MIB
    assert parse_bytes("1.5 GiB") == int(1.5 * 2**30)
    assert parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes(1234) == 1234 and parse_bytes(None) is None
    with pytest.raises(ValueError, match="give bytes as a number, or with a unit"):
        parse_bytes("64 parsecs")
    with pytest.raises(ValueError, match=">= 0"):
        parse_bytes(-1)


def test_round_order_rotates_and_alternates() -> None:
    names = ["plain", "A", "B"]
    assert _round_order(names, 0) == ["plain", "A", "B"]
    assert _round_order(names, 1) == ["plain", "B", "A"]
    assert _round_order(names, 2) == ["B", "plain", "A"]


def test_resolve_names_and_classes() -> None:
    from trec_pipelines import TrainPipelineSemiSync, TrainPipelineSparseDist

    class Mine(TrainPipelineSparseDist):
        pass

    variants = resolve(["TrainPipelineSemiSync", Mine])
    assert [v.name for v in variants] == ["TrainPipelineSemiSync", "Mine"]
    assert variants[0].kwargs == {"start_batch": 0} and variants[0].cls is TrainPipelineSemiSync
    with pytest.raises(ValueError, match="not a pipeline of trec_pipelines"):
        resolve(["TrainPipelineNope"])
    with pytest.raises(ValueError, match="listed twice"):
        resolve(["TrainPipelineSemiSync", TrainPipelineSemiSync])


def test_not_applicable_reasons_without_a_sharded_model() -> None:
    import torch

    model = torch.nn.Linear(2, 2)
    reasons = {v.name: not_applicable(v, model, include_compiled=False) for v in resolve(None)}
    assert reasons["TrainPipelineSparseDist"] is None
    assert "prefetchable cache" in str(reasons["PrefetchTrainPipelineSparseDist"])
    assert "no PEC module" in str(reasons["TrainPipelinePEC"])
    assert "include_compiled=True" in str(reasons["TrainPipelinePT2"])
    assert "eval pipeline" in str(reasons["EvalPipelineSparseDist"])
    assert reasons["StagedTrainPipeline"] is None  # timed with the bench's two stages
    for name in (
        "TrainPipelineSparseDistT",
        "TrainPipelineSparseDistBwdOpt",
        "EvalPipelineCPUSparse",
    ):
        assert "not timed unless named in variants=" in str(reasons[name])
    (bwd_opt,) = resolve(["TrainPipelineSparseDistBwdOpt"])
    assert not_applicable(bwd_opt, model, include_compiled=False, named=True) is None
    pt2 = next(v for v in resolve(None) if v.name == "TrainPipelinePT2")
    assert not_applicable(pt2, model, include_compiled=True) is None


class OneShot:
    def __init__(self) -> None:
        self.items: List[int] = [1, 2, 3]

    def __iter__(self) -> Any:
        items, self.items = self.items, []
        return iter(items)


def test_batches_checks() -> None:
    assert "iterator" in str(iterable_problem(iter([1, 2])))
    assert "not an iterable" in str(iterable_problem(5))
    one_shot = OneShot()
    assert iterable_problem(one_shot) is None and one_shot.items == [
        1,
        2,
        3,
    ]  # checking did not start it
    assert take([1, 2, 3, 4], 1, 2, "timed") == Taken([2, 3], None)
    take(one_shot, 0, 3, "warm-up")
    with pytest.raises(BuildError, match="batches gave 0 of the 2 timed batches"):
        take(one_shot, 0, 2, "timed")
    with pytest.raises(BuildError, match="with at least one batch"):
        take([], 0, 1, "warm-up")


class Counting:
    """A list that counts how often it is walked."""

    def __init__(self, items: List[int]) -> None:
        self.items, self.walks = items, 0

    def __iter__(self) -> Any:
        self.walks += 1
        return iter(self.items)


def test_a_pass_that_ends_first_is_cycled_in_order() -> None:
    batches = Counting(list(range(24)))
    # Warm-up 5, then an epoch of 40: items 5..23, then 0..20, a pass walked once.
    warm, timed = take(batches, 0, 5, "warm-up"), take(batches, 5, 40, "timed")
    assert warm == Taken([0, 1, 2, 3, 4], None) and batches.walks == 2
    assert timed.items == list(range(5, 24)) + list(range(0, 21)) and timed.pass_length == 24
    # The reference: the pass repeated, sliced where the epoch starts and ends.
    assert timed.items == (list(range(24)) * 3)[5:45]
    # Shorter than the warm-up alone: it cycles too, and the epoch goes on where it ends.
    three = [10, 11, 12]
    assert take(three, 0, 5, "warm-up") == Taken([10, 11, 12, 10, 11], 3)
    assert take(three, 5, 4, "timed") == Taken([12, 10, 11, 12], 3)
    # The same objects, not copies: every contender trains the same batches.
    objects = [object(), object()]
    assert all(a is b for a, b in zip(take(objects, 0, 4, "timed").items, objects * 2, strict=True))
    # A pass exactly as long as asked is not cycled.
    assert take(list(range(6)), 1, 5, "timed") == Taken([1, 2, 3, 4, 5], None)


def test_call_build_says_what_to_return() -> None:
    import torch

    def raising() -> Any:
        raise KeyError("tables")

    with pytest.raises(BuildError, match=r"build\(\) raised KeyError: 'tables'"):
        call_build(raising)
    with pytest.raises(
        BuildError,
        match=r"returned tuple of 2; it must return a tuple \(model, optimizer, batches\)",
    ):
        call_build(lambda: (1, 2))  # type: ignore[arg-type,return-value]
    with pytest.raises(BuildError, match="must be an nn.Module"):
        call_build(lambda: ("model", None, []))  # type: ignore[arg-type,return-value]
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert call_build(lambda: (model, optimizer, [1]))[0] is model


def test_exposed_input_dist_counts_steady_calls_only() -> None:
    # Three calls starting at 0, 10, 20 (end 30); issues in calls 0 and 1 only.
    intervals = [
        ("issue", 1.0, 3.0),
        ("wait", 2.0, 4.0),
        ("issue", 11.0, 12.0),
        ("wait", 15.0, 16.0),
        ("wait", 21.0, 22.0),
    ]
    # Call 0 is the fill; call 2 issues nothing: only call 1 counts (1 + 1 seconds).
    assert _exposed_per_step(intervals, [0.0, 10.0, 20.0], 30.0) == pytest.approx(2.0)
    # The median over steady calls: one stalled call does not move it.
    steady = [
        ("issue", 11.0, 12.0),
        ("issue", 21.0, 29.0),
        ("issue", 31.0, 32.0),
        ("issue", 1.0, 2.0),
    ]
    assert _exposed_per_step(steady, [0.0, 10.0, 20.0, 30.0], 40.0) == pytest.approx(1.0)
    assert _exposed_per_step([("issue", 1.0, 2.0)], [0.0], 5.0) is None


def advice(budget: Optional[int] = 4 * MIB, seconds: float = 1.0) -> Advice:
    """Hand-written rounds: B is clearly the fastest of those that pipeline every module."""
    base = (seconds,) * 3
    rows = (
        measured("A", base, at((1.09, 1.10, 1.11), base), 2 * MIB),
        measured("B", base, at((1.19, 1.20, 1.21), base), 3 * MIB),
        measured(
            "E",
            base,
            at((1.24, 1.25, 1.26), base),
            MIB,
            (("ebc", "postproc 'neg' modifies its input"),),
        ),
        VariantReport(name="C", applicable=False, reason="needs a cache: the model has none"),
        VariantReport(name="F", applicable=False, reason="needs a cache: none here either"),
        VariantReport(name="G", applicable=False, reason="compiled, not timed unless asked: slow"),
        VariantReport(name="D", error="RuntimeError: boom (rank 1, round 1)"),
    )
    rows = tuple(replace(r, band=band(r, typical_spread(rows))) for r in rows)
    return Advice(
        judge(plain(base), rows, budget), rows, plain(base), None, 0.01, 3, 1, STEPS, 2
    ).for_budget(budget)


def test_for_budget_judges_the_same_measurements_again() -> None:
    a = advice(budget=None)
    assert a.recommended == "B" and a.verdict.answer is Answer.RECOMMEND
    assert a.reason == str(a.verdict) and a.reason.startswith("recommend B: 1.20x plain ±0.01")
    tight = a.for_budget("2.5MiB")
    assert tight.recommended == "A" and tight["B"].within_budget is False
    assert tight["A"].within_budget is True and tight["E"].within_budget is True
    assert "B is 9% faster but exceeds the budget by 512.0 KiB" in tight.reason
    assert tight["C"].within_budget is None and tight["A"].qps == a["A"].qps
    assert a.for_budget(None)["A"].within_budget is None
    nothing = a.for_budget(1)
    assert nothing.recommended is None and nothing.verdict.answer is Answer.KEEP_PLAIN_LOOP


def test_table_lists_the_applicable_and_the_rest_in_one_line(tmp_path: Any) -> None:
    a = advice()
    text = a.table()
    lines = text.splitlines()
    assert lines[2].startswith("  plain loop") and any(line.startswith("* B ") for line in lines)
    assert "1.20 ±0.01" in text
    for name in ("C", "F", "G"):  # not in the table: in the one footer line
        assert not any(line.startswith(f"  {name} ") for line in lines)
    assert "not applicable: C, F (needs a cache); G (compiled, not timed unless asked)" in lines
    assert "  D: failed: RuntimeError: boom" in text and "  D " in text  # applicable, failed: a row
    assert "  E: ebc not pipelined: postproc 'neg' modifies its input" in text
    assert "(shortest epoch 0.800 s)" in text
    assert lines[-1] == f"verdict: {a.verdict}"
    assert a["A"].held_peak == 2 * MIB and a["plain loop"].vs_plain == 1.0
    with pytest.raises(KeyError, match="no variant 'Z'"):
        a["Z"]
    path = os.path.join(tmp_path, "advice.json")
    a.write_json(path, extra={"build": "x:y"})
    import json

    loaded = json.load(open(path))
    assert (
        loaded["recommended"] == "B" and loaded["build"] == "x:y" and len(loaded["variants"]) == 7
    )
    assert loaded["verdict"]["answer"] == "recommend" and loaded["reason"] == a.reason
    assert not_applicable_line(a.variants[:3]) == ""


@pytest.mark.parametrize("seconds", [1.0, 0.05])
def test_plot_is_a_png(tmp_path: Any, seconds: float) -> None:
    path = os.path.join(tmp_path, "advice.png")
    advice(seconds=seconds).save_plot(path)  # 0.05 s: too short, the title says "cannot tell"
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_help_and_arguments() -> None:
    text = parser().format_help()
    for option in (
        "--build",
        "--memory-budget",
        "--variants",
        "--include-compiled",
        "--rounds",
        "--nproc",
        "--out",
        "--time-budget",
    ):
        assert option in text
    assert parser().parse_args(["--build", "a:b"]).time_budget == 60.0
    assert _without_nproc(["--build", "a:b", "--nproc", "4", "--nproc=3", "--steps", "2"]) == [
        "--build",
        "a:b",
        "--steps",
        "2",
    ]
    with pytest.raises(SystemExit, match="module.path:function"):
        load_build("nocolon")
    with pytest.raises(SystemExit, match="cannot import"):
        load_build("no_such_module_here:build")
    with pytest.raises(SystemExit, match="has no function"):
        load_build("os:no_such_function")
    assert load_build("os.path:join") is os.path.join


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--memory-budget", "lots"], "--memory-budget 'lots': give bytes as a number"),
        (
            ["--variants", "TrainPipelineSparseDist,Nope"],
            "--variants 'Nope' is not a pipeline of trec_pipelines",
        ),
        (["--rounds", "0"], "need --steps >= 1, --warmup >= 0, --rounds >= 1"),
        (["--time-budget", "-1"], "and --time-budget >= 0 (got 20, 5, 3, 2, -1.0)"),
    ],
)
def test_cli_refuses_bad_options_before_launching(
    argv: List[str], message: str, capsys: Any
) -> None:
    from trec_pipelines.advise.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["--build", "x:y", *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_variant_build_context_for_compiled_autograd() -> None:
    import torch

    from trec_pipelines import TrainPipelineSparseDist, TrainPipelineSparseDistCompAutograd

    with Variant("x", TrainPipelineSparseDistCompAutograd).build_context():
        assert torch._dynamo.config.optimize_ddp == "python_reducer"
    with Variant("y", TrainPipelineSparseDist).build_context():
        assert torch._dynamo.config.optimize_ddp != "python_reducer"


def test_the_command_line_end_to_end(tmp_path: Any) -> None:
    """``python -m trec_pipelines.advise`` launches 2 ranks, prints the table, writes the JSON;
    with matplotlib hidden from every process (``sys.modules["matplotlib"] = None`` in a
    ``sitecustomize``), as on a fresh install, it warns once, draws no PNG, and exits 0
    (``test_plot_is_a_png`` draws the PNG)."""
    import json
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    hide = os.path.join(tmp_path, "hide")
    os.makedirs(hide)
    with open(os.path.join(hide, "sitecustomize.py"), "w") as f:
        f.write("import sys\nsys.modules['matplotlib'] = None\n")
    env = dict(os.environ, TREC_ADVISE_BATCHES="3", PYTHONPATH=os.pathsep.join([hide, repo]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    out = os.path.join(tmp_path, "out")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trec_pipelines.advise",
            "--build",
            "benchmarks.advise_build:tiny",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--time-budget",
            "0",  # the steps and rounds asked for, no more
            "--variants",
            "TrainPipelineSparseDist,TrainPipelineBase",
            "--memory-budget",
            "1GiB",
            "--out",
            out,
            "--no-progress",
            "--nproc",
            "2",
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # Two steps of a tiny model in one round: too short and too few to tell.
    assert "verdict: cannot tell: the shortest timed epoch took" in done.stdout
    assert "memory budget 1.0 GiB" in done.stdout
    document = json.load(open(os.path.join(out, "advice.json")))
    assert (
        document["build"] == "benchmarks.advise_build:tiny" and document["memory_budget"] == 2**30
    )
    assert [v["name"] for v in document["variants"]] == [
        "TrainPipelineSparseDist",
        "TrainPipelineBase",
    ]
    assert document["recommended"] is None and document["verdict"]["answer"] == "cannot tell"
    assert document["verdict"]["rerun_steps"] > 2 and document["verdict"]["rerun_rounds"] == 3
    assert done.stderr.count("matplotlib is not installed") == 1, done.stderr[-2000:]
    assert f"results: {out}/ (advice.json)" in done.stdout
    assert not os.path.exists(os.path.join(out, "advice.png"))


def test_without_matplotlib_the_outputs_are_the_table_and_the_json(
    tmp_path: Any, monkeypatch: Any, capsys: Any
) -> None:
    """What the outputs need is checked before measuring: no matplotlib is a warning and no
    PNG, not a failure; a results directory that cannot be written is an error at once."""
    import importlib.util

    from trec_pipelines.advise import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    out = os.path.join(tmp_path, "results")
    args = parser().parse_args(["--build", "x:y", "--out", out])
    assert cli.output_needs(args) == (False, out, None)
    assert os.path.isdir(out)
    assert capsys.readouterr().err.strip() == cli.MATPLOTLIB_MISSING
    # --no-plot: no PNG asked for, nothing to warn about.
    quiet = parser().parse_args(["--build", "x:y", "--out", out, "--no-plot"])
    assert cli.output_needs(quiet) == (False, out, None) and capsys.readouterr().err == ""
    # With matplotlib (the real lookup): the PNG is drawn.
    monkeypatch.setattr(importlib.util, "find_spec", real)
    if real("matplotlib") is not None:
        assert cli.output_needs(args)[0] is True
    # A file where the directory should be: the error names it, before any measuring.
    blocked = os.path.join(tmp_path, "a-file")
    open(blocked, "w").close()
    plot, where, error = cli.output_needs(parser().parse_args(["--build", "x:y", "--out", blocked]))
    assert where == blocked and error is not None
    assert error.startswith(f"advise: cannot write the results to {blocked!r}")


def test_the_table_says_where_the_model_sits_on_the_regime_map() -> None:
    """The model's link bytes by kind, and at 1 and 10 Gbit/s what hiding the ids can gain
    next to the plain loop's step (hand-written bytes; the 2-rank tier checks the bytes
    against the bench's arithmetic on a real model)."""
    import json

    from trec_pipelines.advise.link import LinkEstimate, gain_bound
    from trec_pipelines.observe.link_bytes import LinkBytes

    # Ids 100 ms at 1 Gbit/s, the model's own collectives 20 ms; the plain loop's step
    # is 1.0 s / 20 steps = 50 ms.  Plain: 50 + 100 + 20 = 170 ms; pipelined at best
    # max(50 + 20, 100) = 100 ms: 1.70x.  At 10 Gbit/s: 62 / 52 = 1.19x.
    ids_heavy = LinkBytes(input_dist=12.5e6, output_dist=1.25e6, allreduce=1.25e6)
    a = replace(advice(), link=LinkEstimate(ids_heavy, 512, 2))
    lines = a.table().splitlines()
    start = lines.index(
        "link bytes per step, from your model's shapes (batch 512/rank, 2 ranks, table-wise, "
        "every rank's on one link): input dist ids 12.50 MB (83%), output dist 1.25 MB (8%), "
        "gradient all-reduce 1.25 MB (8%)"
    )
    assert lines[start + 1 : start + 4] == [
        "  at 1 Gbit/s: ids 100.0 ms, output dist + all-reduce 20.0 ms, next to the plain loop's "
        "50.0 ms step here: hiding the ids gains at most 70%; the ids' all-to-all is a large share "
        "of the step: the map's end where pipelining pays",
        "  at 10 Gbit/s: ids 10.0 ms, output dist + all-reduce 2.0 ms, next to the plain loop's "
        "50.0 ms step here: hiding the ids gains at most 19%; the ids' all-to-all is a large share "
        "of the step: the map's end where pipelining pays",
        '  (where this sits on the regime map: docs/guides/performance.md, "Where pipelining '
        'pays: the regime map")',
    ]
    assert lines[-1].startswith("verdict: ")
    assert json.loads(json.dumps(a.to_dict()))["link"]["bytes"]["input_dist"] == 12.5e6
    # A DCNv2-like model: wide tables, short bags; the embeddings fill the link.
    wide = LinkBytes(input_dist=0.5e6, output_dist=10e6, allreduce=2e6)
    assert gain_bound(wide, 50.0, 1.0) == pytest.approx((50 + 4 + 96) / (50 + 96))
    assert gain_bound(wide, 50.0, 10.0) == pytest.approx(60 / 59.6)
    dcn = replace(a, link=LinkEstimate(wide, 512, 2)).table()
    assert "gains at most 3%; the model's own collectives and compute bind: a few percent" in dcn
    assert "gains at most 1%; nothing measurable to gain from hiding the input dist" in dcn
    assert replace(a, link=None).table().count("link bytes") == 0
