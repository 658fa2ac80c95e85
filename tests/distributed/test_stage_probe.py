"""The bench's stage probe on 2 gloo ranks: its split training step trains as the plain loop does.

The probe times a training step in pieces (the lookup, the output dist, forward, backward,
optimizer, and the embedding update replayed alone); these tests check that the split
forward computes what the module's own forward does (the dense parameters after one step
match the plain loop's) and that every piece was recorded.  Nothing is timed.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.contenders.build import PlainLoop
from benchmarks.contenders.stage_probe import StageProbe
from benchmarks.contenders.variants import TRAIN
from trec_pipelines.testing.dlrm import current_group
from trec_pipelines.testing.dlrm_sharded import make_spec_batches
from trec_pipelines.testing.dlrm_spec import tiny_spec

PIECES = ("lookup", "out_a2a", "forward", "backward", "opt", "emb_update")


def _dense(model: torch.nn.Module) -> dict:
    return {
        name: p.detach().clone()
        for name, p in model.named_parameters()
        if "ebc" not in name and "embedding" not in name
    }


def test_the_split_step_trains_the_dense_part_as_the_plain_loop_and_records_every_piece() -> None:
    spec = tiny_spec()
    rank = torch.distributed.get_rank()
    (batch,) = make_spec_batches(spec, 1, 8, 0, rank)
    probe, plain, untrained = StageProbe(), PlainLoop(TRAIN), PlainLoop(TRAIN)
    for contender in (probe, plain, untrained):
        contender.build(spec, "table_wise", current_group(), 0, 0.05, 0.01)
    try:
        assert probe.run_epoch([batch]) == 1 and plain.run_epoch([batch]) == 1
        assert probe.model is not None and plain.model is not None
        ours, reference = _dense(probe.model), _dense(plain.model)
        assert ours and ours.keys() == reference.keys()
        for name in ours:
            torch.testing.assert_close(ours[name], reference[name], msg=name)
        assert untrained.model is not None
        before = _dense(untrained.model)
        assert any(
            not torch.equal(before[name], ours[name]) for name in ours
        )  # the step moved them
        record = probe.last.as_dict()
        assert all(key in record for key in PIECES), record
        # The pieces of the training stage are its parts, timed back to back.
        assert record["forward"] + record["backward"] + record["opt"] == pytest.approx(
            record["compute"], rel=1e-6
        )
        assert record["lookup"] + record["out_a2a"] <= record["forward"]
        # The backward replayed in pieces: when the all-reduce was issued and when the
        # embeddings' gradient was ready, each a fraction of the dense backward (one step).
        assert all(key in record for key in ("dense_bwd", "allreduce", "emb_backward")), record
        assert 0.0 <= record["allreduce_from"] <= 1.0 and 0.0 <= record["grad_from"] <= 1.0
    finally:
        for contender in (probe, plain, untrained):
            contender.close()
