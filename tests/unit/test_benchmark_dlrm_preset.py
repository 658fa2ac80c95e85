"""The dlrm-dcnv2 presets, per-table bag sizes, the DCN interaction and the link's bytes by collective."""

from __future__ import annotations

from typing import List

import pytest
import torch

from benchmarks.measuring import link_bytes
from benchmarks.running import run_header
from benchmarks.settings.config import DLRM_DCNV2_POOLINGS, PRESETS, parse_args, to_argv
from trec_pipelines.testing.dlrm_net import SpecDLRM
from trec_pipelines.testing.dlrm_sharded import make_spec_batches
from trec_pipelines.testing.dlrm_spec import ModelSpec


def test_the_preset_is_mlperf_s_shapes() -> None:
    cfg = parse_args(["--preset", "dlrm-dcnv2"])
    assert len(cfg.dims) == 26 and set(cfg.dims) == {128}
    assert cfg.poolings == DLRM_DCNV2_POOLINGS and sum(cfg.poolings) == 214
    assert cfg.interaction == "dcn" and cfg.link_gbit == 1.0
    assert cfg.run_name() == "dlrm-dcnv2" and len(cfg.batch_sizes) == 1
    assert not cfg.memory and not cfg.overhead  # a short run
    assert parse_args(to_argv(cfg)) == cfg
    fast = parse_args(["--preset", "dlrm-dcnv2-10gbit"])
    assert fast.link_gbit == 10.0 and fast.run_name() == "dlrm-dcnv2-10gbit"
    assert fast.model_spec() == cfg.model_spec()  # one model, another link
    assert set(PRESETS["dlrm-dcnv2-10gbit"]) == set(PRESETS["dlrm-dcnv2"])


def test_options_next_to_the_preset_win() -> None:
    cfg = parse_args(["--preset", "dlrm-dcnv2", "--interaction", "concat", "--rows", "1000"])
    assert cfg.interaction == "concat" and cfg.rows == 1000 and cfg.poolings == DLRM_DCNV2_POOLINGS
    assert cfg.model_spec().interaction == "concat"
    assert parse_args(to_argv(cfg)) == cfg


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--dims", "8,8", "--poolings", "1,2,3"], "--poolings takes one bag size per table"),
        (["--dims", "8,8", "--poolings", "1,0"], "--poolings must be positive"),
        (["--interaction", "dot"], "--interaction must be one of concat, dcn"),
        (["--dcn-rank", "0"], "--dcn-layers and --dcn-rank must be >= 1"),
    ],
)
def test_bad_model_options_exit_with_a_message(
    argv: List[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert fragment in capsys.readouterr().err


def _spec(**kwargs: object) -> ModelSpec:
    values = dict(rows=50, dims=(4, 8, 4), pooling=2, dense_in=3, dense_arch=(6,), over_arch=(5,))
    values.update(kwargs)
    return ModelSpec(**values)  # type: ignore[arg-type]


def test_fixed_bags_have_each_table_s_size() -> None:
    spec = _spec(poolings=(3, 1, 5))
    (batch,) = make_spec_batches(spec, 1, batch_size=4, seed=0, rank=0)
    lengths = batch.sparse.length_per_key()
    assert lengths == [3 * 4, 1 * 4, 5 * 4]
    assert batch.sparse.lengths().tolist() == [3] * 4 + [1] * 4 + [5] * 4
    assert spec.ids_per_sample == 9.0
    # Without poolings, random lengths around pooling as before.
    (loose,) = make_spec_batches(_spec(), 1, batch_size=64, seed=0, rank=0)
    assert loose.sparse.lengths().max() <= 4 and len(set(loose.sparse.lengths().tolist())) > 1
    with pytest.raises(ValueError, match="one bag size per table"):
        _spec(poolings=(1, 2))


def test_the_dcn_interaction_crosses_the_concatenation() -> None:
    concat, dcn = SpecDLRM(_spec()), SpecDLRM(_spec(interaction="dcn", dcn_layers=2, dcn_rank=3))
    assert concat.cross is None and dcn.cross is not None
    width = 6 + 4 + 8 + 4
    x = torch.randn(7, width)
    assert dcn.cross(x).shape == (7, width)
    cross_params = sum(p.numel() for p in dcn.cross.parameters())
    assert cross_params == 2 * (2 * width * 3 + width)  # per layer: V, W (low rank) and a bias
    assert link_bytes.dense_parameters(_spec(interaction="dcn", dcn_layers=2, dcn_rank=3)) == (
        link_bytes.dense_parameters(_spec()) + cross_params
    )


def test_link_bytes_by_hand() -> None:
    spec = _spec(poolings=(3, 1, 5))
    b = link_bytes.step_bytes(spec, batch_size=10, world=2, dense_params=1000)
    # 20 samples, half of each batch's tables on the other rank.
    assert b.input_dist == 20 * 0.5 * (9 * 8 + 3 * 4)
    assert b.output_dist == 2 * 20 * 0.5 * 16 * 4
    assert b.allreduce == 2 * 2 * 0.5 * 1000 * 4
    assert b.model == b.output_dist + b.allreduce
    assert sum(b.shares().values()) == pytest.approx(1.0)
    assert link_bytes.link_ms(125e6, 1.0) == pytest.approx(1000.0)
    assert link_bytes.step_bytes(spec, 10, world=1, dense_params=5).total == 0.0
    # The preset: the ids are a few percent of the link's bytes.
    preset = parse_args(["--preset", "dlrm-dcnv2"]).model_spec()
    assert link_bytes.step_bytes(preset, 256, 2).shares()["input dist"] < 0.06


def test_the_header_names_the_bags_the_interaction_and_the_link_s_bytes() -> None:
    cfg = parse_args(["--preset", "dlrm-dcnv2"])
    link = {"requested_gbit": 1.0, "emulated": True, "qdisc": "tbf", "not_emulated_because": None}
    lines = run_header.header(cfg, 2, "gloo", "cpu", 60.0, link, ["a note"])
    assert "fixed bags of 214 ids/sample" in lines[0] and "dcn interaction" in lines[0]
    assert lines[1].startswith("interconnect: emulated 1 Gbit/s")
    assert "input dist" in lines[2] and "output dist" in lines[2] and "Gbit/s" in lines[2]
    assert lines[-1] == "note: a note"
    other = parse_args(["--preset", "dlrm-dcnv2", "--sharding-type", "row_wise"])
    assert not any(
        "link bytes" in line for line in run_header.header(other, 2, "gloo", "cpu", 1.0, link, [])
    )
    plain = run_header.link_line({"requested_gbit": None})
    assert plain.startswith("interconnect: none emulated")
