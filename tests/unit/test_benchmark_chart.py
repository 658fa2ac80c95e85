"""The benchmark's QPS figure: what it draws from a hand-made result, checked against hand-computed ratios."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

import pytest

from benchmarks.figures import qps_chart, replot
from benchmarks.tables import report

SD, BASE, EVAL = "TrainPipelineSparseDist", "TrainPipelineBase", "EvalPipelineSparseDist"


def _entry(
    variant: str,
    side: str,
    qps: List[float],
    mode: str = "train",
    shimmed: bool = False,
    base: Optional[str] = None,
) -> Dict[str, Any]:
    # One rank, batch 10, one step per epoch: 10 examples an epoch, so seconds = 10 / qps.
    entry = {
        "variant": variant,
        "side": side,
        "mode": mode,
        "shimmed": shimmed,
        "status": report.OK,
        "reason": "",
        "seconds": [10.0 / q for q in qps],
    }
    if base is not None:
        entry["base_variant"] = base
    return entry


def _raw() -> Dict[str, Any]:
    contenders = {
        # Run order: Base first; the figure puts the faster SparseDist on top.
        f"ours:{BASE}": _entry(BASE, "ours", [11, 11, 11, 11, 5.5], base=BASE),
        f"torchrec:{BASE}": _entry(BASE, "torchrec", [11, 11, 11, 11, 11], shimmed=True),
        f"ours:{SD}": _entry(SD, "ours", [20, 15, 12, 11, 10], base=SD),
        f"torchrec:{SD}": _entry(SD, "torchrec", [10, 10, 10, 10, 10]),
        f"ours:{SD} [shared]": _entry(f"{SD} [shared]", "ours", [10, 10, 10, 10, 5], base=SD),
        f"ours:{EVAL}": _entry(EVAL, "ours", [30, 30, 20, 20, 20], mode="eval", base=EVAL),
        "plain:train": _entry("plain", "plain", [10, 10, 10, 10, 5]),
        "plain:eval": _entry("plain", "plain", [20, 20, 20, 20, 20], mode="eval"),
    }
    return {
        "world": 1,
        "throughput": [
            {
                "batch_size": 10,
                "steps": 1,
                "rounds": 5,
                "contenders": contenders,
                # SparseDist's fwd+bwd+opt alone: 0.5 s an epoch of 10 examples -> 20 examples/s
                "stages": [{"h2d": 0.0, "input_dist": 0.1, "compute": 0.5}] * 5,
            }
        ],
        "overhead": None,
    }


# Hand-computed, per round (plain train 10, 10, 10, 10, 5; torchrec SparseDist 10 each):
#   SparseDist / plain    = 2.0, 1.5, 1.2, 1.1, 2.0 -> sorted 1.1 1.2 1.5 2.0 2.0
#   SparseDist / torchrec = 2.0, 1.5, 1.2, 1.1, 1.0 -> sorted 1.0 1.1 1.2 1.5 2.0
#   [shared] / plain      = 1.0 each;  Base / plain = 1.1 each;  Base / torchrec = 1, 1, 1, 1, 0.5
#   EvalSparseDist / plain eval = 1.5, 1.5, 1.0, 1.0, 1.0
# Quartiles of 5 sorted values (inclusive method): the 2nd and 4th.
# Bound: 20 examples/s over the plain loop's median of 10 = 2.0.


def _spread(s: Optional[qps_chart.Spread]) -> Tuple[float, ...]:
    assert s is not None
    return (s.median, s.q1, s.q3, s.low, s.high, s.rounds)


def test_paired_spread_by_hand() -> None:
    spread = qps_chart.paired_spread([20, 15, 12, 11, 10], [10, 10, 10, 10, 5])
    assert _spread(spread) == pytest.approx((1.5, 1.2, 2.0, 1.1, 2.0, 5))
    even = qps_chart.paired_spread([1, 2, 3, 4], [1, 1, 1, 1])  # quartiles 1.75 and 3.25
    assert _spread(even) == pytest.approx((2.5, 1.75, 3.25, 1.0, 4.0, 4))
    assert qps_chart.paired_spread([1.0, 2.0], [1.0]) is None  # rounds that don't pair
    assert _spread(qps_chart.paired_spread([3.0], [2.0])) == pytest.approx((1.5,) * 5 + (1,))


def test_blocks_sort_by_speed_keep_twins_under_their_row_and_split_modes() -> None:
    (block,) = qps_chart.chart_blocks(_raw())
    assert (block.batch_size, block.world, block.steps, block.rounds) == (10, 1, 1, 5)
    train, evaluation = block.panels
    assert (train.mode, evaluation.mode) == ("train", "eval")
    # SparseDist (1.5) above Base (1.1); its [shared] twin (1.0) stays under it.
    assert [r.label for r in train.rows] == [SD, f"{SD} [shared]", BASE]
    assert [r.twin for r in train.rows] == ["", "[shared]", ""]
    sd, shared, base = train.rows
    assert _spread(sd.vs_plain) == pytest.approx((1.5, 1.2, 2.0, 1.1, 2.0, 5))
    assert _spread(sd.vs_torchrec) == pytest.approx((1.2, 1.1, 1.5, 1.0, 2.0, 5))
    assert _spread(shared.vs_plain) == pytest.approx((1.0, 1.0, 1.0, 1.0, 1.0, 5))
    assert _spread(base.vs_plain) == pytest.approx((1.1, 1.1, 1.1, 1.1, 1.1, 5))
    assert _spread(base.vs_torchrec) == pytest.approx((1.0, 1.0, 1.0, 0.5, 1.0, 5))
    assert base.shimmed and not sd.shimmed
    assert train.bound == pytest.approx(2.0)
    (ev,) = evaluation.rows
    assert _spread(ev.vs_plain) == pytest.approx((1.0, 1.0, 1.5, 1.0, 1.5, 5))
    assert ev.vs_torchrec is None and ev.torchrec_na == "n/a: no such class in torchrec"
    assert evaluation.bound is None  # no bound for eval


def _axes(fig: Any) -> Dict[str, Any]:
    """The figure's panels by their left title."""
    return {ax.get_title(loc="left"): ax for ax in fig.get_axes()}


def _thin_bars(ax: Any) -> Dict[int, Tuple[float, float]]:
    """Row -> (x0, x1) of each thin smallest-to-largest line drawn in ``ax``."""
    bars = {}
    for collection in ax.collections:
        if collection.get_linewidth()[0] == pytest.approx(1.0):
            for (x0, y0), (x1, _) in collection.get_segments():
                bars[round(y0)] = (x0, x1)
    return bars


def test_what_is_drawn() -> None:
    import matplotlib.pyplot as plt

    fig = qps_chart.draw(qps_chart.chart_blocks(_raw()))
    try:
        axes = _axes(fig)
        assert set(axes) == {
            "train: ours / plain loop",
            "train: ours / torchrec's same-named class",
            "eval: ours / plain loop",
            "eval: ours / torchrec's same-named class",
        }
        train = axes["train: ours / plain loop"]
        labels = [t.get_text() for t in train.get_yticklabels()]
        assert labels == ["SparseDist", "SparseDist [shared]", "Base"]
        assert train.get_ylim()[0] > train.get_ylim()[1]  # first row on top
        # Row 0 (SparseDist): its rounds run 1.1..2.0; quartiles 1.2..2.0; median 1.5.
        assert _thin_bars(train)[0] == pytest.approx((1.1, 2.0))
        thick = [c for c in train.collections if c.get_linewidth()[0] > 1.0]
        assert [tuple(p[0] for p in s) for c in thick for s in c.get_segments()][0] == (
            pytest.approx((1.2, 2.0))
        )
        medians = [line.get_xdata()[0] for line in train.get_lines() if line.get_marker() == "o"]
        assert medians == pytest.approx([1.5, 1.0, 1.1])
        numbers = [t.get_text() for t in train.texts]
        assert numbers == ["1.50", "1.00", "1.10"]
        bound = [
            line
            for line in train.get_lines()
            if line.get_linestyle() == "--" and line.get_color() == qps_chart.BOUND_COLOR
        ]
        assert len(bound) == 1 and bound[0].get_xdata()[0] == pytest.approx(2.0)
        assert train.get_title(loc="right") == "bound (any schedule): 2.00"

        vs_torchrec = axes["train: ours / torchrec's same-named class"]
        assert _thin_bars(vs_torchrec)[0] == pytest.approx((1.0, 2.0))
        assert _thin_bars(vs_torchrec)[2] == pytest.approx((0.5, 1.0))  # Base, one slow round
        hollow = [
            line.get_ydata()[0]
            for line in vs_torchrec.get_lines()
            if line.get_marker() == "o" and line.get_markerfacecolor() in ("white", (1, 1, 1, 1))
        ]
        assert hollow == [2]  # Base's torchrec class ran under the shim
        # The [shared] row has no torchrec class of its own: it is compared with SparseDist's.
        assert _thin_bars(vs_torchrec)[1] == pytest.approx((0.5, 1.0))
        assert axes["eval: ours / plain loop"].get_title(loc="right") == ""  # no bound for eval
        eval_texts = [t.get_text() for t in axes["eval: ours / torchrec's same-named class"].texts]
        assert "n/a: no such class in torchrec" in eval_texts
        notes = "\n".join(t.get_text() for sub in fig.subfigs for t in sub.texts)
        assert "quartiles" in notes and "trec_pipelines/testing/torchrec_cpu.py" in notes
    finally:
        plt.close(fig)


def test_one_disturbed_round_does_not_squash_the_axis() -> None:
    raw = _raw()
    # One round of the [shared] row ten times faster than the rest: its line runs off the axis.
    raw["throughput"][0]["contenders"][f"ours:{SD} [shared]"] = _entry(
        f"{SD} [shared]", "ours", [10, 10, 10, 10, 50], base=SD
    )
    fig = qps_chart.draw(qps_chart.chart_blocks(raw))
    try:
        train = _axes(fig)["train: ours / plain loop"]
        # Without the outlier the values span 1.0..2.0; the axis stops half that span past it.
        assert train.get_xlim()[1] < 2.6
        arrows = [line for line in train.get_lines() if line.get_marker() == ">"]
        assert [line.get_ydata()[0] for line in arrows] == [1]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_replot_redraws_from_results_json(tmp_path: Any) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"raw": _raw(), "summary": {}}))
    out = tmp_path / "out"
    assert replot.main([str(folder), "--out", str(out)]) == 0
    assert (out / "qps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (folder / "qps.png").exists()  # --out leaves the results folder alone
    assert replot.main([str(tmp_path / "missing")]) == 2
