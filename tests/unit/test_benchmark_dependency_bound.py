"""The benchmark's dependency bound (batches may overlap), from made-up operation times."""

from __future__ import annotations

import json
import random
from typing import Any, Dict, List, Optional

import pytest

from benchmarks.contenders.stage_probe import StageTimes
from benchmarks.measuring import dependency_bound as db, schedule_bound as sb
from benchmarks.tables import report, results

ROUND_TRIP = "cycle lookup > out a2a > dense fwd > dense bwd > grad a2a > emb update"
DENSE = "cycle dense fwd > dense bwd > all-reduce > opt"
TAKE_TURNS = "cycle lookup > emb update"
WINDOW = db.WINDOW

# ms per step; cores ops add up to 70, link ops to 33, the round trip to 82, the dense cycle to 54.
BASE = {
    "h2d": 0.1,
    "input_dist": 5.0,
    "lookup": 10.0,
    "out_a2a": 8.0,
    "dense_fwd": 20.0,
    "dense_bwd": 30.0,
    "grad_a2a": 8.0,
    "emb_update": 6.0,
    "allreduce": 12.0,
    "opt": 4.0,
}


def _row(text: str, variant: str, semantics: str) -> List[str]:
    """The words of ``variant``'s row for ``semantics`` in a printed report."""
    return next(
        ln for ln in text.splitlines() if ln.startswith(f"{variant} ") and semantics in ln
    ).split()


def _times(**ms: float) -> db.OpTimes:
    return db.OpTimes({**BASE, **ms})


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------


def test_sync_round_trip_carries_both_all_to_alls_and_binds() -> None:
    bound = db.dependency_bound(_times(), db.SYNC, cores=1.0)
    assert bound.terms == pytest.approx(
        {
            "link": 5 + 8 + 8 + 12,
            "H2D": 0.1,
            "cores (operations)": 10 + 20 + 30 + 6 + 4,
            ROUND_TRIP: 10 + 8 + 20 + 30 + 8 + 6,  # out a2a and grad a2a on it
            DENSE: 20 + max(30, 12) + 4,
            # The all-reduce may start with the backward: the dense fwd, then the three
            # collectives one after the other on the link.
            WINDOW: 20 + 0 + (12 + 8 + 8),
        }
    )
    assert bound.binding == ROUND_TRIP and bound.step_ms == pytest.approx(82.0)
    assert bound.qps(200) == pytest.approx(200 / 0.082)


def test_stale_breaks_the_round_trip_and_is_compute_bound() -> None:
    bound = db.dependency_bound(_times(), db.STALE, cores=1.0)
    assert bound.terms == pytest.approx(
        {
            "link": 33.0,
            "H2D": 0.1,
            "cores (operations)": 70.0,
            ROUND_TRIP + " (over 2 steps)": 82.0 / 2,
            TAKE_TURNS: 10 + 6,  # batch i+1's lookup and batch i's update take turns
            DENSE: 54.0,
        }
    )
    assert bound.binding == "cores (operations)" and bound.step_ms == pytest.approx(70.0)
    # Twice the cores per rank: the dense cycle is what is left.
    halved = db.dependency_bound(_times(), db.STALE, cores=2.0)
    assert halved.terms["cores (operations)"] == pytest.approx(35.0)
    assert halved.binding == DENSE and halved.step_ms == pytest.approx(54.0)


def test_link_bound_stale_equals_the_link_total() -> None:
    times = _times(input_dist=30.0, out_a2a=25.0, grad_a2a=25.0, allreduce=40.0)
    bound = db.dependency_bound(times, db.STALE, cores=1.0)
    assert bound.binding == "link" and bound.step_ms == pytest.approx(30 + 25 + 25 + 40)
    # What a collective holds the link for, not its wall time, is the link's load.
    busy = db.OpTimes(times.ms, busy_ms={"input_dist": 3.0, "allreduce": 10.0})
    assert db.dependency_bound(busy, db.STALE).terms["link"] == pytest.approx(3 + 25 + 25 + 10)
    assert busy.busy("lookup") == 10.0 and busy.busy("input_dist") == 3.0
    # A busy time above the operation's own is capped at it.
    assert db.OpTimes(times.ms, busy_ms={"opt": 99.0}).busy("opt") == 4.0


def test_the_all_reduce_starts_after_a_fraction_of_the_backward() -> None:
    times = _times(allreduce=25.0)
    # Overlappable with the whole backward: the longer of the two.
    assert db.dependency_bound(times, db.SYNC).terms[DENSE] == pytest.approx(20 + 30 + 4)
    # From half the backward: 15 ms of backward, then the 25 ms all-reduce.
    half = db.dependency_bound(times, db.SYNC, allreduce_from=0.5)
    assert half.terms[DENSE] == pytest.approx(20 + (15 + 25) + 4)
    # After the whole backward: both in a row.
    end = db.dependency_bound(times, db.SYNC, allreduce_from=1.0)
    assert end.terms[DENSE] == pytest.approx(20 + 30 + 25 + 4)


def test_the_link_window_binds_when_the_collectives_start_late() -> None:
    """Under sync semantics batch i's all-reduce and gradient all-to-all and batch i+1's
    output all-to-all share the link between two dense forwards: written out, a step where
    all three start 90% into the backward takes 20 + 27 + 30 + 25 + 25 ms at least."""
    times = _times(out_a2a=25.0, grad_a2a=25.0, allreduce=30.0)
    late = db.dependency_bound(times, db.SYNC, allreduce_from=0.9, grad_from=0.9)
    assert late.terms[WINDOW] == pytest.approx(20 + 27 + 30 + 25 + 25)
    assert late.binding == WINDOW and late.step_ms == pytest.approx(127.0)
    # Each cycle alone lets the three overlap on the link, and stays below it.
    assert late.terms[ROUND_TRIP] == pytest.approx(10 + 25 + 20 + 27 + 25 + 6)
    assert late.terms[DENSE] == pytest.approx(20 + 27 + 30 + 4)
    # The window opens at the earlier of the two starts.
    early = db.dependency_bound(times, db.SYNC, allreduce_from=0.9, grad_from=0.5)
    assert early.terms[WINDOW] == pytest.approx(20 + 15 + 80)
    # What a collective holds the link for counts, not its wall time.
    busy = db.OpTimes(times.ms, busy_ms={"allreduce": 10.0})
    assert db.dependency_bound(busy, db.SYNC, None, 0.9, 0.9).terms[WINDOW] == pytest.approx(
        20 + 27 + 10 + 25 + 25
    )
    # One step stale: batch i+1's output all-to-all may cross during batch i's dense work.
    assert WINDOW not in db.dependency_bound(times, db.STALE, None, 0.9, 0.9).terms


def test_the_gradient_all_to_all_starts_when_the_embeddings_gradient_is_ready() -> None:
    # Half-way through the 30 ms dense backward: the round trip is 15 ms shorter.
    half = db.dependency_bound(_times(), db.SYNC, grad_from=0.5)
    assert half.terms[ROUND_TRIP] == pytest.approx(10 + 8 + 20 + 15 + 8 + 6)
    stale = db.dependency_bound(_times(), db.STALE, grad_from=0.5)
    assert stale.terms[ROUND_TRIP + " (over 2 steps)"] == pytest.approx((82 - 15) / 2)
    # Measured with the times, it is the default.
    measured = db.OpTimes(_times().ms, grad_from=0.5)
    assert db.dependency_bound(measured, db.SYNC).terms == pytest.approx(half.terms)


def test_cycles_per_semantics() -> None:
    def names(semantics: str) -> List[str]:
        return [c.name for c in db.cycles(db._edges(_times(), semantics, 0.0))]

    assert sorted(names(db.SYNC)) == sorted([ROUND_TRIP, DENSE])
    assert sorted(names(db.STALE)) == sorted([ROUND_TRIP + " (over 2 steps)", TAKE_TURNS, DENSE])


def test_a_cycle_that_reaches_no_later_batch_is_refused() -> None:
    edges = [db.Edge("lookup", "emb_update", 0, 1.0), db.Edge("emb_update", "lookup", 0, 1.0)]
    with pytest.raises(ValueError, match="spans 0 steps"):
        db.cycles(edges)


@pytest.mark.parametrize("semantics", db.SEMANTICS)
@pytest.mark.parametrize("allreduce_from", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("grad_from", [0.2, 1.0])
def test_more_time_on_an_operation_never_lowers_a_bound(
    semantics: str, allreduce_from: float, grad_from: float
) -> None:
    rng = random.Random(7)
    for _ in range(40):
        ms = {op: rng.uniform(0.0, 50.0) for op in db.OPS}
        busy = {op: rng.uniform(0.0, 50.0) for op in ("input_dist", "out_a2a", "allreduce")}
        args = (1.0, allreduce_from, grad_from)
        before = db.dependency_bound(db.OpTimes(ms, busy), semantics, *args)
        for op in db.OPS:
            grown = db.OpTimes({**ms, op: ms[op] + rng.uniform(0.1, 30.0)}, busy)
            after = db.dependency_bound(grown, semantics, *args)
            assert after.step_ms >= before.step_ms - 1e-9, (op, ms)
            for name, value in before.terms.items():
                assert after.terms[name] >= value - 1e-9, (op, name, ms)


def test_stale_is_never_above_sync() -> None:
    rng = random.Random(3)
    for _ in range(50):
        times = db.OpTimes({op: rng.uniform(0.0, 50.0) for op in db.OPS})
        stale = db.dependency_bound(times, db.STALE).step_ms
        assert stale <= db.dependency_bound(times, db.SYNC).step_ms + 1e-9


def test_wrong_inputs_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="missing \\['opt'\\]"):
        db.OpTimes({op: 1.0 for op in db.OPS if op != "opt"})
    with pytest.raises(ValueError, match=">= 0 ms"):
        _times(lookup=-1.0)
    with pytest.raises(ValueError, match="semantics must be one of"):
        db.dependency_bound(_times(), "async")
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        db.dependency_bound(_times(), db.SYNC, allreduce_from=1.5)
    with pytest.raises(ValueError, match="grad_from is a fraction"):
        db.dependency_bound(_times(), db.SYNC, grad_from=-0.1)
    with pytest.raises(ValueError, match="cores must be > 0"):
        db.dependency_bound(_times(), db.SYNC, cores=0.0)
    with pytest.raises(ValueError, match="cpu_per_core_ms must be >= 0"):
        db.dependency_bound(_times(), db.SYNC, cpu_per_core_ms=-1.0)
    assert not any(
        name.startswith("cores") for name in db.dependency_bound(_times(), db.SYNC, None).terms
    )


def test_semantics_of_a_variant() -> None:
    assert db.semantics_of("TrainPipelineSemiSync") == db.STALE
    for variant in (
        "TrainPipelineSparseDist",
        "TrainPipelineFusedSparseDist",
        "StagedTrainPipeline",
    ):
        assert db.semantics_of(variant) == db.SYNC


# --------------------------------------------------------------------------
# The probe's operation times
# --------------------------------------------------------------------------


def _probe_epoch() -> Dict[str, float]:
    """10 steps, seconds over the epoch: per step BASE's measured operations."""
    return {
        "h2d": 0.001,
        "input_dist": 0.05,
        "compute": 0.98,
        "lookup": 0.1,
        "out_a2a": 0.08,
        "forward": 0.38,  # 10 lookup + 8 out a2a + 20 dense
        "backward": 0.56,  # 30 dense + 8 grad a2a + 6 update + 12 all-reduce
        "opt": 0.04,
        "emb_update": 0.06,
    }


def test_op_times_derive_what_the_probe_cannot_separate() -> None:
    slow = {**_probe_epoch(), "lookup": 0.3}
    times = db.op_times([_probe_epoch(), _probe_epoch(), slow], 10, 28.0, 3.0)
    assert times is not None
    assert dict(times.ms) == pytest.approx(BASE)  # the median epoch's, per step
    assert set(times.derived) == {"dense_fwd", "grad_a2a", "allreduce", "dense_bwd"}
    # The two all-to-alls hold the link 8 ms each; the all-reduce the rest of the 28 ms.
    assert [times.busy(op) for op in ("input_dist", "out_a2a", "grad_a2a", "allreduce")] == (
        pytest.approx([3.0, 8.0, 8.0, 12.0])
    )
    # Over the loopback: no link time, so no all-reduce time taken out of the backward.
    loopback = db.op_times([_probe_epoch()], 10)
    assert loopback is not None and loopback.ms["allreduce"] == 0.0
    assert loopback.ms["dense_bwd"] == pytest.approx(42.0) and loopback.load("link") == 0.0
    # The all-to-alls' wall time above half the link's: the all-reduce gets none.
    short = db.op_times([_probe_epoch()], 10, 10.0, 3.0)
    assert short is not None and short.ms["allreduce"] == 0.0 and short.busy("out_a2a") == 5.0


def _pieces_epoch() -> Dict[str, float]:
    """As :func:`_probe_epoch`, with the backward's pieces timed apart: per step a 40 ms dense
    backward whose all-reduce (15 ms) starts 90% into it, and 9 ms of lookup backward."""
    return {
        **_probe_epoch(),
        "dense_bwd": 0.4,
        "allreduce": 0.15,
        "allreduce_from": 9.0,  # a fraction, summed over the 10 steps
        "emb_backward": 0.09,  # 3 of gradient all-to-all + the 6 of the update
    }


def test_op_times_take_the_backwards_pieces_where_the_probe_timed_them() -> None:
    times = db.op_times([_pieces_epoch()], 10, 28.0, 3.0)
    assert times is not None
    assert dict(times.ms) == pytest.approx(
        {**BASE, "dense_bwd": 40.0, "allreduce": 15.0, "grad_a2a": 3.0}
    )
    assert times.allreduce_from == pytest.approx(0.9)
    assert times.grad_from is None  # timed since the window term: older results take 1
    assert set(times.derived) == {"dense_fwd", "grad_a2a"}
    # The dense cycle waits for 90% of the backward, then the whole all-reduce:
    # 20 + 36 + 15 + 4, where the all-reduce from the backward's start would give 20 + 40 + 4.
    bound = db.dependency_bound(times, db.STALE, cores=None)
    assert bound.terms[DENSE] == pytest.approx(20 + 36 + 15 + 4)
    assert db.dependency_bound(times, db.STALE, None, 0.0).terms[DENSE] == pytest.approx(64)
    # One epoch without the pieces (a DDP the probe could not hook): all derived.
    mixed = db.op_times([_pieces_epoch(), _probe_epoch()], 10, 28.0, 3.0)
    assert mixed is not None and mixed.allreduce_from is None
    assert dict(mixed.ms) == pytest.approx(BASE)


def test_op_times_take_when_the_embeddings_gradient_was_ready() -> None:
    epochs = [{**_pieces_epoch(), "grad_from": g} for g in (8.0, 7.0, 9.5)]  # summed over 10
    times = db.op_times(epochs, 10, 28.0, 3.0)
    assert times is not None and times.grad_from == pytest.approx(0.8)  # the median epoch's
    # The round trip's dense bwd is the 32 ms before the gradient is ready; the window opens
    # at 32 ms (before the all-reduce's 36): 20 + 32 + the link time of the three collectives
    # (out a2a 8, the 3 ms grad a2a, the all-reduce's 12 of the link's 28 ms).
    bound = db.dependency_bound(times, db.SYNC, cores=None)
    assert bound.terms[ROUND_TRIP] == pytest.approx(10 + 8 + 20 + 32 + 3 + 6)
    assert bound.terms[WINDOW] == pytest.approx(20 + 32 + 8 + 3 + 12)


def test_results_from_before_the_probe_split_the_step_have_no_op_times() -> None:
    old = {k: v for k, v in _probe_epoch().items() if k in ("h2d", "input_dist", "compute")}
    assert db.op_times([old], 10) is None and db.op_times([], 10) is None


def test_stage_times_add_pieces_and_a_missing_one_stays_missing() -> None:
    times = StageTimes()
    times.add("lookup", 0.5)
    times.add("lookup", 0.25)
    times.add("emb_update", 0.1)
    times.add("emb_update", None)
    times.add("emb_update", 0.1)  # one step without it: the sum would be wrong
    record = times.as_dict()
    assert record["lookup"] == pytest.approx(0.75) and "emb_update" not in record
    assert "out_a2a" not in record  # never measured


# --------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------


def _entry(variant: str, side: str, seconds: float) -> Dict[str, Any]:
    return {
        "variant": variant,
        "side": side,
        "mode": "train",
        "shimmed": False,
        "status": "ok",
        "reason": "",
        "seconds": [seconds],
    }


def _raw(stage: Optional[Dict[str, float]] = None) -> Dict[str, Any]:
    sd, semi = "TrainPipelineSparseDist", "TrainPipelineSemiSync"
    record = dict(stage if stage is not None else _probe_epoch())
    # 1 Gbit/s: 3 ms of input dist and 28 ms of the model's collectives per step.
    record["link_bytes_input_dist"], record["link_bytes_compute"] = 3.75e6, 35e6
    # 10 steps x 100 examples x 2 ranks = 2000 examples per epoch
    return {
        "world": 2,
        "cores": 2,
        "link_gbit": 1.0,
        "throughput": [
            {
                "batch_size": 100,
                "steps": 10,
                "contenders": {
                    f"ours:{sd}": _entry(sd, "ours", 1.0),  # 2000 ex/s: 100 ms a step
                    f"torchrec:{sd}": _entry(sd, "torchrec", 1.25),
                    f"ours:{semi}": _entry(semi, "ours", 0.875),  # 87.5 ms a step
                    "plain:train": _entry("plain", "plain", 2.0),  # 1000 ex/s
                },
                "stages": [record],
                "recorded": {},
            }
        ],
        "overhead": None,
    }


def test_report_prints_a_bound_per_semantics_and_holds_each_variant_to_its_own() -> None:
    (table,) = report.throughput_tables(_raw())
    assert table.bound is not None and table.bound.dependency is not None
    dep = table.bound.dependency
    assert dep.cores == 1.0  # 2 cores, 2 ranks
    assert dep.bounds[db.SYNC].step_ms == pytest.approx(82.0)
    assert dep.bounds[db.STALE].binding == "cores (operations)"  # no measured CPU in _raw()
    sd, semi = dep.variants
    assert (sd.semantics, semi.semantics) == (db.SYNC, db.STALE)
    assert sd.ours_of_bound == pytest.approx(82 / 100) and semi.ours_of_bound == pytest.approx(
        70 / 87.5
    )
    assert sd.torchrec_of_bound == pytest.approx(82 / 125)
    text = results.format_report(_raw(), repeats=1)
    assert (
        f"sync dependency bound: 82.00 ms/step (binding: {ROUND_TRIP}) -> 2,439 ex/s, "
        "plain loop 1,000 (41%)"
    ) in text
    assert (
        "one-step-stale dependency bound: 70.00 ms/step (binding: cores (operations)) -> 2,857 ex/s, "
        "plain loop 1,000 (35%)"
    ) in text
    assert "dense fwd* 20.00" in text and "lookup 10.00" in text
    assert _row(text, "TrainPipelineSemiSync", "one-step-stale") == [
        "TrainPipelineSemiSync",
        "one-step-stale",
        "70.00",
        "(cores",
        "(operations))",
        "2,857",
        "87.50",
        "(80%)",
        "-",  # no CPU measured in _raw()'s epochs
        "-",  # no torchrec row
        "-",
    ]


def test_summary_stores_the_dependency_bound_and_old_results_stay_readable() -> None:
    summary = json.loads(json.dumps(results.summary(_raw())))  # only JSON types
    dep = summary["throughput"][0]["bound"]["dependency"]
    assert dep["op_ms_per_step"] == pytest.approx(BASE)
    assert dep["semantics"]["sync"]["binding"] == ROUND_TRIP
    assert dep["semantics"]["one-step-stale"]["bound_ms"] == pytest.approx(70.0)
    assert dep["variants"]["TrainPipelineSemiSync"]["semantics"] == "one-step-stale"
    assert dep["variants"]["TrainPipelineSparseDist"]["ours_of_bound"] == pytest.approx(0.82)
    # A probe epoch from before the pieces were timed: the any-schedule bound, no dependency bound.
    old = {k: v for k, v in _probe_epoch().items() if k in ("h2d", "input_dist", "compute")}
    bound = results.summary(_raw(old))["throughput"][0]["bound"]
    assert bound["any_schedule"]["binding"] and bound["dependency"] is None
    assert "dependency bound" not in results.format_report(_raw(old), repeats=1)


# --------------------------------------------------------------------------
# The measured CPU as the cores' floor, and the share of the floor reached
# --------------------------------------------------------------------------


def test_the_cores_floor_is_the_measured_cpu_per_core_when_there_is_one() -> None:
    # All ranks' CPU 254.76 ms a step on 2 cores: 127.38 ms per core.
    costs = sb.StepCosts(0.1, 5.0, 100.0, cpu_ms=254.76, cores=2)
    assert costs.cpu_per_core_ms == pytest.approx(127.38)
    assert sb.any_schedule_bound(costs).terms["cores (measured CPU)"] == pytest.approx(127.38)
    assert sb.StepCosts(0.1, 5.0, 100.0, cpu_ms=254.76).cpu_per_core_ms is None  # cores unknown
    assert sb.StepCosts(0.1, 5.0, 100.0, cores=2).cpu_per_core_ms is None  # CPU not measured
    # BASE's cores operations add up to 70 ms; the stale cycles to at most 54.
    measured = db.dependency_bound(_times(), db.STALE, cores=1.0, cpu_per_core_ms=90.0)
    assert measured.terms["cores (operations)"] == pytest.approx(70.0)
    assert measured.terms["cores (measured CPU)"] == pytest.approx(90.0)
    assert measured.binding == "cores (measured CPU)" and measured.step_ms == pytest.approx(90.0)
    # Above the sync round trip (82 ms) it binds the sync bound too.
    sync = db.dependency_bound(_times(), db.SYNC, cores=1.0, cpu_per_core_ms=90.0)
    assert sync.binding == "cores (measured CPU)" and sync.step_ms == pytest.approx(90.0)
    # Below the operations' sum, the operations bind: the floor is the larger of the two.
    low = db.dependency_bound(_times(), db.STALE, cores=1.0, cpu_per_core_ms=60.0)
    assert low.binding == "cores (operations)" and low.step_ms == pytest.approx(70.0)
    # The measured term does not need the cores per rank (it is per core already).
    alone = db.dependency_bound(_times(), db.STALE, cores=None, cpu_per_core_ms=90.0)
    assert "cores (operations)" not in alone.terms and alone.binding == "cores (measured CPU)"


def test_reached_is_the_floor_over_the_measured_step() -> None:
    floor = sb.Bound({"link": 30.0, "cores (measured CPU)": 80.0})
    assert floor.binding == "cores (measured CPU)"
    assert floor.reached(100.0) == pytest.approx(0.8)
    assert floor.reached(80.0) == pytest.approx(1.0)
    assert floor.reached(None) is None and floor.reached(0.0) is None
    # 2000 examples a step at 20,000 ex/s: 100 ms a step.
    assert sb.ms_per_step(20_000.0, 2000.0) == pytest.approx(100.0)
    assert sb.ms_per_step(None, 2000.0) is None and sb.ms_per_step(0.0, 2000.0) is None


def test_a_variants_cpu_per_core_is_the_median_epoch_per_step_over_the_cores() -> None:
    # Epochs of 10 steps charged 1.6, 2.4 and 1.8 s (all ranks); 2 cores: 90 ms per core a step.
    assert sb.timed_cpu_per_core_ms([1.6, 2.4, 1.8], 10, 2) == pytest.approx(90.0)
    assert sb.timed_cpu_per_core_ms([], 10, 2) is None  # results from before it was measured
    assert sb.timed_cpu_per_core_ms([1.6], 10, None) is None
    assert sb.timed_cpu_per_core_ms([1.6], 0, 2) is None


def _raw_with_cpu() -> Dict[str, Any]:
    """_raw() with the probe's CPU: all ranks 160 ms a step (1.6 s over 10 steps), 2 cores."""
    record = {**_probe_epoch(), "cpu_h2d": 0.0, "cpu_input_dist": 0.1, "cpu_compute": 1.5}
    raw = _raw(record)
    # SemiSync's timed epochs: 1.6, 1.7 and 1.8 s of CPU (both ranks) over 10 steps.
    semi = raw["throughput"][0]["contenders"]["ours:TrainPipelineSemiSync"]
    semi["cpu_seconds"] = [1.8, 1.6, 1.7]
    return raw


def test_report_holds_each_variant_to_the_measured_cpu_floor_and_names_the_binding_term() -> None:
    (table,) = report.throughput_tables(_raw_with_cpu())
    assert table.bound is not None and table.bound.dependency is not None
    dep = table.bound.dependency
    assert dep.cpu_per_core_ms == pytest.approx(80.0)  # 160 ms of all ranks over 2 cores
    stale, sync = dep.bounds[db.STALE], dep.bounds[db.SYNC]
    assert stale.binding == "cores (measured CPU)" and stale.step_ms == pytest.approx(80.0)
    assert sync.binding == ROUND_TRIP and sync.step_ms == pytest.approx(82.0)  # 82 > 80
    sd, semi = dep.variants
    assert semi.ours_ms == pytest.approx(87.5) and semi.ours_of_bound == pytest.approx(80 / 87.5)
    assert sd.ours_ms == pytest.approx(100.0) and sd.ours_of_bound == pytest.approx(82 / 100)
    assert sd.torchrec_ms == pytest.approx(125.0)
    assert semi.ours_cpu_ms == pytest.approx(85.0)  # median 1.7 s / 10 steps / 2 cores
    assert sd.ours_cpu_ms is None and sd.torchrec_cpu_ms is None  # not measured
    text = results.format_report(_raw_with_cpu(), repeats=1)
    assert (
        "cores per rank 1, cores (operations) 70.00 ms per core vs cores (measured CPU) "
        "80.00 ms per core"
    ) in text
    assert "ours ms/step (% of floor reached)" in text
    assert "% of floor reached = floor ms/step / the variant's measured ms/step" in text
    assert _row(text, "TrainPipelineSemiSync", "one-step-stale") == [
        "TrainPipelineSemiSync",
        "one-step-stale",
        "80.00",
        "(cores",
        "(measured",
        "CPU))",
        "2,500",
        "87.50",
        "(91%)",
        "85.00",  # 1.7 s of CPU (both ranks) over 10 steps on 2 cores
        "-",
        "-",
    ]
    summary = json.loads(json.dumps(results.summary(_raw_with_cpu())))
    bound = summary["throughput"][0]["bound"]
    assert bound["costs_ms_per_step"]["cpu_per_core"] == pytest.approx(80.0)
    assert bound["dependency"]["cpu_per_core_ms"] == pytest.approx(80.0)
    semi_json = bound["dependency"]["variants"]["TrainPipelineSemiSync"]
    assert semi_json["binding"] == "cores (measured CPU)"
    assert semi_json["ours_ms"] == pytest.approx(87.5)
    assert semi_json["ours_of_bound"] == pytest.approx(80 / 87.5)
    assert semi_json["ours_cpu_ms_per_core"] == pytest.approx(85.0)


def test_report_says_where_the_all_reduce_starts_when_the_probe_timed_the_pieces() -> None:
    raw = _raw(_pieces_epoch())
    text = results.format_report(raw, repeats=1)
    assert "all-reduce issued 90% into the dense bwd" in text
    assert "dense bwd 40.00" in text and "dense bwd*" not in text
    dep = json.loads(json.dumps(results.summary(raw)))["throughput"][0]["bound"]["dependency"]
    assert dep["allreduce_from"] == pytest.approx(0.9)
    assert "all-reduce issued" not in results.format_report(_raw(), repeats=1)
