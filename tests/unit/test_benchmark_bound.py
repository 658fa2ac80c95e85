"""The benchmark's bound and hidden input dist, from made-up probe epochs and timelines."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch.distributed as dist

from benchmarks.contenders.stage_probe import combine_stage_times
from benchmarks.measuring import schedule_bound as sb
from benchmarks.running.recording import recorded_epoch, tap_input_dist
from benchmarks.tables import report, results
from tests.unit.fakes import (
    FakeShardedEBC,
    TinyModel,
    base_pipeline,
    make_batches,
    sparse_dist_pipeline,
)

MB = 1e6


# --------------------------------------------------------------------------
# The probe's costs and the any-schedule bound
# --------------------------------------------------------------------------


def _stage(
    h2d: float = 0.001,
    input_dist: float = 0.3,
    compute: float = 1.0,
    thread: float = 0.02,
    cpu: Tuple[float, float, float] = (0.0, 0.1, 1.2),
    link: Optional[Tuple[float, float]] = None,
) -> Dict[str, float]:
    """One probe epoch of 10 steps (seconds and bytes summed over the epoch)."""
    record = {
        "h2d": h2d,
        "input_dist": input_dist,
        "compute": compute,
        "thread_input_dist": thread,
        "cpu_h2d": cpu[0],
        "cpu_input_dist": cpu[1],
        "cpu_compute": cpu[2],
    }
    if link is not None:
        record["link_bytes_input_dist"], record["link_bytes_compute"] = link
    return record


def test_ranks_combine_wall_times_by_max_and_cpu_by_sum() -> None:
    ranks = [
        {
            "input_dist": 0.3,
            "cpu_compute": 0.5,
            "thread_input_dist": 0.01,
            "link_bytes_compute": 10.0,
        },
        {
            "input_dist": 0.2,
            "cpu_compute": 0.7,
            "thread_input_dist": 0.03,
            "link_bytes_compute": 12.0,
        },
    ]
    assert combine_stage_times(ranks) == pytest.approx(
        {
            "input_dist": 0.3,
            "cpu_compute": 1.2,
            "thread_input_dist": 0.03,
            "link_bytes_compute": 12.0,
        }
    )
    assert combine_stage_times([{}, {}]) == {}


def test_step_costs_are_medians_per_step_with_link_time_at_the_rate() -> None:
    # 10 steps; 3.75 MB of input dist and 2.5 MB of fwd+bwd+opt per step at 1 Gbit/s: 30 and 20 ms
    stages = [
        _stage(link=(37.5 * MB, 25 * MB)),
        _stage(input_dist=0.5, link=(37.5 * MB, 25 * MB)),
        _stage(),
    ]
    costs = sb.step_costs(stages[:2], steps=10, cores=2, link_gbit=1.0)
    assert costs is not None
    assert costs.input_dist_ms == pytest.approx(40.0)  # median of 30 and 50 ms
    assert costs.compute_ms == pytest.approx(100.0) and costs.h2d_ms == pytest.approx(0.1)
    assert costs.thread_input_dist_ms == pytest.approx(2.0)
    assert costs.cpu_ms == pytest.approx(130.0)  # 0 + 10 + 120 ms, all ranks
    assert costs.link_input_dist_ms == pytest.approx(
        30.0
    ) and costs.link_compute_ms == pytest.approx(20.0)
    # No emulated link: no link times, whatever the counter said.
    assert sb.step_costs(stages[:2], 10, 2, None).link_input_dist_ms is None  # type: ignore[union-attr]
    # An epoch without the counter (or an old result without CPU times) leaves those out.
    old = [{"h2d": 0.001, "input_dist": 0.3, "compute": 1.0}]
    costs = sb.step_costs(old, 10, 2, 1.0)
    assert costs is not None and costs.cpu_ms is None and costs.link_input_dist_ms is None
    assert sb.step_costs([], 10, 2, None) is None


def test_link_time_is_at_most_the_stage_s_own_time() -> None:
    # 50 MB per step would take 400 ms at 1 Gbit/s, but the input dist lasted 30 ms
    costs = sb.step_costs([_stage(link=(500 * MB, 0.0))], 10, 2, 1.0)
    assert costs is not None and costs.link_input_dist_ms == pytest.approx(30.0)


def test_any_schedule_bound_takes_the_largest_term() -> None:
    costs = sb.StepCosts(
        h2d_ms=0.1,
        input_dist_ms=30.0,
        compute_ms=100.0,
        thread_input_dist_ms=2.0,
        cpu_ms=260.0,
        cores=2,
        link_input_dist_ms=30.0,
        link_compute_ms=20.0,
    )
    bound = sb.any_schedule_bound(costs)
    assert bound.terms == pytest.approx(
        {
            "fwd+bwd+opt": 100.0,
            "training thread": 102.0,
            "link": 50.0,
            "cores (measured CPU)": 130.0,
            "input dist": 30.0,
            "H2D": 0.1,
        }
    )
    assert bound.binding == "cores (measured CPU)" and bound.step_ms == pytest.approx(130.0)
    assert bound.qps(2000) == pytest.approx(2000 / 0.130)
    # Over the loopback there is no link term; old results have only the three stages.
    loopback = sb.any_schedule_bound(sb.StepCosts(0.1, 30.0, 100.0, 2.0, 120.0, 2))
    assert "link" not in loopback.terms and loopback.binding == "training thread"
    assert sb.any_schedule_bound(sb.StepCosts(0.1, 30.0, 100.0)).terms == {
        "fwd+bwd+opt": 100.0,
        "input dist": 30.0,
        "H2D": 0.1,
    }


def test_schedule_terms_for_a_fifo_link_and_an_input_dist_on_the_chain() -> None:
    costs = sb.StepCosts(
        0.1, 35.0, 100.0, 2.0, 120.0, 2, link_input_dist_ms=30.0, link_compute_ms=20.0
    )
    # Issued 5 ms before backward's all-to-all: 25 ms of the ids are still ahead of it.
    bound = sb.schedule_bound(costs, gap_ms=5.0)
    assert bound.terms["link order"] == pytest.approx(125.0) and bound.binding == "link order"
    # A gap longer than the input dist's link time costs nothing.
    assert sb.schedule_bound(costs, gap_ms=40.0).binding == "training thread"
    # Base and Lite wait for the input dist before their forward.
    chain = sb.schedule_bound(costs, gap_ms=40.0, on_chain=True)
    assert (
        chain.terms["input dist on the chain"] == pytest.approx(135.0)
        and chain.binding == "input dist on the chain"
    )
    # Over the loopback: no link-order term.
    loopback = sb.StepCosts(0.1, 35.0, 100.0, 2.0, 120.0, 2)
    assert "link order" not in sb.schedule_bound(loopback, gap_ms=5.0).terms


@pytest.mark.parametrize(
    "exposed, standalone, hidden",
    [(3.0, 30.0, 0.9), (0.0, 30.0, 1.0), (45.0, 30.0, 0.0), (None, 30.0, None), (3.0, 0.0, None)],
)
def test_hidden_fraction_is_clipped(
    exposed: Optional[float], standalone: float, hidden: Optional[float]
) -> None:
    result = sb.hidden_fraction(exposed, standalone)
    assert result == (None if hidden is None else pytest.approx(hidden))


# --------------------------------------------------------------------------
# Synthetic recorded epochs (times in ms here, seconds in the record)
# --------------------------------------------------------------------------

ms = 1e-3


def _sparse_dist_epoch(
    tensors_wait_ms: float = 1.0, backward_head_ms: float = 4.0
) -> Dict[str, Any]:
    """SparseDist's schedule over 5 batches, 100 ms per call (a fill call, 3 steady, a drain).

    Call k >= 1: InputDistStart(k+1) at +0..2 ms (splits all-to-all at +1),
    Forward(k) at +3..43 waiting ``tensors_wait_ms`` for batch k's tensors from +4
    and issuing the output all-to-all 1 ms after, InputDistWait(k+1) at +43..44
    issuing the ids all-to-all (4 MB) at +44, Backward(k) at +44..94 issuing its
    all-to-all at +44 + ``backward_head_ms``.
    """
    actions: List[List[Any]] = []
    waits: List[List[Any]] = []
    sends: List[List[float]] = []
    n_calls = 5
    for k in range(n_calls):
        t = 100.0 * k
        if k == 0:  # the fill: batch 0's whole input dist, then batch 1's start
            actions += [
                [0, "InputDistStart", 0, "main", t, t + 2],
                [0, "InputDistWait", 0, "main", t + 2, t + 30],
            ]
            waits += [["issue", t + 0.5, t + 1.5], ["wait", t + 2, t + 30]]
            sends += [[t + 1, 96], [t + 29, 4e6]]
        if k + 1 < n_calls:
            actions.append(
                [k, "InputDistStart", k + 1, "main", t + 30 * (k == 0), t + 30 * (k == 0) + 2]
            )
            waits.append(["issue", t + 30 * (k == 0) + 0.5, t + 30 * (k == 0) + 1.5])
            sends.append([t + 30 * (k == 0) + 1, 96])
        actions.append([k, "Forward", k, "main", t + 3 + 30 * (k == 0), t + 43])
        if k >= 1:
            waits.append(["wait", t + 4, t + 4 + tensors_wait_ms])  # inside Forward
        sends.append(
            [t + 5 + tensors_wait_ms + 30 * (k == 0), 2e6]
        )  # output all-to-all, after the wait
        if k + 1 < n_calls:
            actions.append([k, "InputDistWait", k + 1, "main", t + 43, t + 44])
            waits.append(["wait", t + 43.2, t + 43.8])  # nested in the verb: counted once
            sends.append([t + 44, 4e6])
        actions.append([k, "Backward", k, "main", t + 44, t + 94])
        sends.append([t + 44 + backward_head_ms, 2e6])
    return {
        "call_starts": [100.0 * k * ms for k in range(n_calls)],
        "actions": [a[:4] + [a[4] * ms, a[5] * ms] for a in actions],
        "input_dist": [[w[0], w[1] * ms, w[2] * ms] for w in waits],
        "all_to_alls": [[s[0] * ms, s[1]] for s in sends],
    }


def _base_epoch() -> Dict[str, Any]:
    """Base: the whole input dist inside each call's Forward (issue, splits wait, tensors wait)."""
    actions, waits, sends = [], [], []
    for k in range(4):
        t = 100.0 * k
        actions += [
            [k, "Forward", k, "main", t, t + 60],
            [k, "Backward", k, "main", t + 60, t + 95],
        ]
        waits += [["issue", t + 1, t + 2], ["wait", t + 2, t + 5], ["wait", t + 5, t + 30]]
        sends += [[t + 1.5, 96], [t + 5, 4e6], [t + 40, 2e6], [t + 62, 2e6]]
    return {
        "call_starts": [100.0 * k * ms for k in range(4)],
        "actions": [a[:4] + [a[4] * ms, a[5] * ms] for a in actions],
        "input_dist": [[w[0], w[1] * ms, w[2] * ms] for w in waits],
        "all_to_alls": [[s[0] * ms, s[1]] for s in sends],
    }


def test_steady_calls_skip_the_fill_and_the_drain() -> None:
    assert [k for k, _, _ in sb.steady_calls(_sparse_dist_epoch())] == [1, 2, 3]
    assert [k for k, _, _ in sb.steady_calls(_base_epoch())] == [1, 2, 3]
    assert sb.steady_calls({"call_starts": [], "actions": []}) == []


def test_exposed_input_dist_is_the_union_of_verbs_and_waits_per_steady_call() -> None:
    # Per steady call: InputDistStart 2 ms + the tensors wait in Forward 1 ms + InputDistWait 1 ms
    assert sb.exposed_input_dist_ms(_sparse_dist_epoch()) == pytest.approx(4.0)
    assert sb.exposed_input_dist_ms(_sparse_dist_epoch(tensors_wait_ms=21.0)) == pytest.approx(24.0)
    # Base: issue 1 + splits 3 + tensors 25 ms, all inside its Forward
    assert sb.exposed_input_dist_ms(_base_epoch()) == pytest.approx(29.0)
    assert sb.exposed_input_dist_ms({"call_starts": [0.0], "actions": []}) is None


def test_issue_gap_runs_from_the_ids_all_to_all_to_the_next_other_one() -> None:
    assert sb.issue_gap_ms(_sparse_dist_epoch(backward_head_ms=4.0)) == pytest.approx(4.0)
    assert sb.issue_gap_ms(_sparse_dist_epoch(backward_head_ms=12.5)) == pytest.approx(12.5)
    # Base: ids at +5, the output all-to-all after the lookup at +40
    assert sb.issue_gap_ms(_base_epoch()) == pytest.approx(35.0)
    assert sb.issue_gap_ms({**_base_epoch(), "all_to_alls": []}) is None


def test_which_schedules_run_the_input_dist_on_the_chain() -> None:
    assert (
        sb.input_dist_on_chain(_sparse_dist_epoch()) is False
    )  # issues batch k+1 while training k
    assert sb.input_dist_on_chain(_base_epoch()) is True  # issued inside Forward(k)


def test_facts_combine_ranks() -> None:
    facts = sb.schedule_facts([_sparse_dist_epoch(1.0, 4.0), _sparse_dist_epoch(3.0, 6.0)])
    assert facts.exposed_ms == pytest.approx(5.0)  # mean of 4 and 6
    assert facts.gap_ms == pytest.approx(6.0)  # the larger: the weaker link-order term
    assert facts.exposed_ms_per_rank == pytest.approx([4.0, 6.0]) and not facts.on_chain


# --------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------


def _entry(variant: str, side: str, seconds: Sequence[float]) -> Dict[str, Any]:
    return {
        "variant": variant,
        "side": side,
        "mode": "train",
        "shimmed": False,
        "status": "ok",
        "reason": "",
        "seconds": list(seconds),
    }


def _raw(link_gbit: Optional[float] = 1.0) -> Dict[str, Any]:
    sd, base = "TrainPipelineSparseDist", "TrainPipelineBase"
    # 10 steps x 100 examples x 2 ranks = 2000 examples per epoch
    return {
        "world": 2,
        "cores": 2,
        "link_gbit": link_gbit,
        "throughput": [
            {
                "batch_size": 100,
                "steps": 10,
                "contenders": {
                    f"ours:{sd}": _entry(sd, "ours", [1.25]),  # 1600 ex/s
                    f"torchrec:{sd}": _entry(sd, "torchrec", [1.6]),  # 1250
                    f"ours:{base}": _entry(base, "ours", [1.4]),
                    "plain:train": _entry("plain", "plain", [1.4]),
                },
                # per step: H2D 0.1, input dist 30, fwd+bwd+opt 100 ms; thread 2 ms; CPU 130 ms;
                # link 30 + 20 ms at 1 Gbit/s
                "stages": [_stage(link=(37.5 * MB, 25 * MB))],
                "recorded": {sd: [_sparse_dist_epoch(1.0, 4.0)] * 2, base: [_base_epoch()] * 2},
            }
        ],
        "overhead": None,
    }


def test_report_prints_the_bound_per_variant_with_hidden_fraction() -> None:
    (table,) = report.throughput_tables(_raw())
    bound = table.bound
    assert bound is not None
    assert bound.old_qps == pytest.approx(2000)  # 200 examples per 100 ms: the old 1/max
    assert bound.any_schedule.binding == "training thread" and bound.bound_qps == pytest.approx(
        200_000 / 102
    )
    sd, base = bound.variants
    assert sd.variant == "TrainPipelineSparseDist"
    assert sd.bound.terms["link order"] == pytest.approx(126.0)  # 100 + (30 - 4)
    assert sd.bound_qps == pytest.approx(200_000 / 126)
    assert sd.hidden == pytest.approx(1 - 4 / 30)
    assert sd.ours_of_bound == pytest.approx(1600 / (200_000 / 126))
    assert base.bound.binding == "input dist on the chain" and base.hidden == pytest.approx(
        1 / 30
    )  # 29 of 30 ms
    text = results.format_report(_raw(), repeats=1)
    assert "the old 'SparseDist bound'" in text and "1/max of these = 2,000 ex/s" in text
    assert "SparseDist bound:" not in text  # the old line is gone
    assert "any schedule: max(" in text and "(training thread) -> 1,961 ex/s" in text
    line = next(
        ln
        for ln in text.splitlines()
        if ln.startswith("TrainPipelineSparseDist ") and "link order" in ln
    )
    assert line.split() == [
        "TrainPipelineSparseDist",
        "4.00",
        "87%",
        "4.00",
        "126.00",
        "(link",
        "order)",
        "1,587",
        "1,600",
        "(101%)",
        "1,250",
        "(79%)",
    ]


def test_over_the_loopback_the_bound_has_no_link_terms() -> None:
    (table,) = report.throughput_tables(_raw(link_gbit=None))
    assert table.bound is not None
    assert "link" not in table.bound.any_schedule.terms
    assert "link order" not in table.bound.variants[0].bound.terms
    assert "no emulated link" in results.format_report(_raw(link_gbit=None), repeats=1)


def test_summary_carries_the_bound_and_hidden_fraction() -> None:
    summary = json.loads(json.dumps(results.summary(_raw())))  # only JSON types
    bound = summary["throughput"][0]["bound"]
    assert bound["stage_ms_per_step"] == pytest.approx(
        {"h2d": 0.1, "input_dist": 30.0, "compute": 100.0}
    )
    assert bound["any_schedule"]["binding"] == "training thread"
    sd = bound["variants"]["TrainPipelineSparseDist"]
    assert sd["hidden_input_dist"] == pytest.approx(1 - 4 / 30) and sd["gap_ms"] == pytest.approx(
        4.0
    )
    assert sd["link_order_ms"] == pytest.approx(126.0) and sd["input_dist_on_chain"] is False
    assert bound["variants"]["TrainPipelineBase"]["input_dist_on_chain"] is True


def test_a_block_without_probe_epochs_has_no_bound() -> None:
    raw = _raw()
    raw["throughput"][0]["stages"] = []
    (table,) = report.throughput_tables(raw)
    assert table.bound is None
    assert results.summary(raw)["throughput"][0]["bound"] is None


# --------------------------------------------------------------------------
# A recorded epoch of our pipelines on the fake sharded module
# --------------------------------------------------------------------------


def test_taps_are_removed_after_the_block() -> None:
    original_input_dist = FakeShardedEBC.__dict__["input_dist"]
    original_a2a = dist.all_to_all_single
    model = TinyModel()
    with tap_input_dist(model) as tap:
        assert FakeShardedEBC.input_dist is not original_input_dist
        assert dist.all_to_all_single is not original_a2a
    assert FakeShardedEBC.__dict__["input_dist"] is original_input_dist
    assert dist.all_to_all_single is original_a2a
    assert tap.intervals == [] and tap.all_to_alls == []


@pytest.mark.parametrize("make, on_chain", [(sparse_dist_pipeline, False), (base_pipeline, True)])
def test_recorded_epochs_of_our_pipelines(make: Any, on_chain: bool) -> None:
    model = TinyModel()
    pipeline = make(model)
    batches = make_batches(7)

    def run() -> None:
        it = iter(batches)
        while True:
            try:
                pipeline.progress(it)
            except StopIteration:
                break

    epoch = json.loads(json.dumps(recorded_epoch(pipeline, model, run)))
    # 7 steps and the call that ends the epoch (StopIteration)
    assert len(epoch["call_starts"]) == 8 and epoch["call_starts"][0] == 0.0
    assert [k for k, _, _ in sb.steady_calls(epoch)] == list(range(1, 7 if on_chain else 6))
    assert (
        sum(1 for kind, _, _ in epoch["input_dist"] if kind == "issue") == 7
    )  # one input_dist per batch
    assert sb.input_dist_on_chain(epoch) is on_chain
    assert sb.exposed_input_dist_ms(epoch) is not None
    assert pipeline.schedule_actions == []  # recording is off again


def test_a_dedicated_group_trades_link_order_for_link_share() -> None:
    costs = sb.StepCosts(
        0.1, 35.0, 100.0, 2.0, 120.0, 2, link_input_dist_ms=30.0, link_compute_ms=20.0
    )
    # 25 ms of ids still on the link when the chain's collectives start: they
    # share its rate, so the chain's 20 ms of link time takes 20 ms longer.
    bound = sb.schedule_bound(costs, gap_ms=5.0, dedicated=True)
    assert "link order" not in bound.terms
    assert bound.terms["link share"] == pytest.approx(120.0)
    # Fewer ids left than the chain's own link time: delayed by what is left.
    assert sb.schedule_bound(costs, gap_ms=22.0, dedicated=True).terms[
        "link share"
    ] == pytest.approx(108.0)


def test_a_twin_row_is_held_to_its_group_s_bound_next_to_torchrec_s_class() -> None:
    raw = _raw()
    block = raw["throughput"][0]
    sd = "TrainPipelineSparseDist"
    twin = f"{sd} [shared]"
    block["contenders"][f"ours:{sd}"]["input_dist_group"] = "dedicated"
    block["contenders"][f"ours:{twin}"] = dict(
        _entry(twin, "ours", [1.6]), base_variant=sd, input_dist_group="shared"
    )
    block["recorded"][twin] = block["recorded"][sd]
    (table,) = report.throughput_tables(raw)
    rows = {r.variant: r for r in table.rows}
    # The twin's torchrec column is the same-named class's (1250 ex/s).
    assert rows[twin].torchrec.median == pytest.approx(1250) and rows[
        twin
    ].ours.median == pytest.approx(1250)
    bounds = {v.variant: v.bound for v in table.bound.variants}
    assert bounds[sd].terms["link share"] == pytest.approx(120.0)  # 100 + min(20, 30 - 4)
    assert bounds[twin].terms["link order"] == pytest.approx(126.0)
