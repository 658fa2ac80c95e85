"""The plain-loop references made once per run (trec_pipelines/testing/references.py)
against the plain loop trained anew: the copy a later test gets is that run, bit for bit."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from trec_pipelines.testing import references
from trec_pipelines.testing.dlrm import (
    DLRM,
    assert_runs_equal,
    make_batches,
    make_sharded,
    plain_loop,
)
from trec_pipelines.testing.references import plain_loop_of

SEED, DATA_SEED = 4321, 23


def test_a_kept_reference_is_the_plain_loop_trained_anew() -> None:
    batches = make_batches(3, seed=DATA_SEED)
    first = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    trained = references.references_trained()
    after_first = torch.get_rng_state()
    torch.manual_seed(99)  # the state a hit must put back, whatever it was before
    again = plain_loop_of(DLRM, "table_wise", make_batches(3, seed=DATA_SEED), seed=SEED)
    assert references.references_trained() == trained, "the same inputs were trained again"
    assert torch.equal(torch.get_rng_state(), after_first)
    fresh = plain_loop(*make_sharded(DLRM, "table_wise", seed=SEED), batches)
    assert_runs_equal(fresh, again, ("plain loop trained anew", "kept reference"))
    assert_runs_equal(fresh, first, ("plain loop trained anew", "first reference"))


def test_a_copy_changed_by_its_caller_leaves_the_next_copy_alone() -> None:
    batches = make_batches(3, seed=DATA_SEED)
    mine = plain_loop_of(DLRM, "table_wise", batches, seed=SEED)
    mine[0].add_(1.0)
    for tensor in mine.weights.values():
        tensor.zero_()
    fresh = plain_loop(*make_sharded(DLRM, "table_wise", seed=SEED), batches)
    assert_runs_equal(fresh, plain_loop_of(DLRM, "table_wise", batches, seed=SEED))


def test_other_inputs_on_any_rank_train_a_reference_of_their_own() -> None:
    """Other batches on the last rank only (the first rank's own are the same), another
    seed, another sharding: each is trained, and equals the plain loop trained anew."""
    last = dist.get_world_size() - 1
    same = make_batches(3, seed=DATA_SEED)
    plain_loop_of(DLRM, "table_wise", same, seed=SEED)
    cases: Any = [
        ("table_wise", SEED, make_batches(3, seed=DATA_SEED + int(dist.get_rank() == last))),
        ("table_wise", SEED + 1, same),
        ("column_wise", SEED, same),
    ]
    for sharding_type, seed, batches in cases:
        trained = references.references_trained()
        kept = plain_loop_of(DLRM, sharding_type, batches, seed=seed)
        assert references.references_trained() == trained + 1, (sharding_type, seed)
        fresh = plain_loop(*make_sharded(DLRM, sharding_type, seed=seed), batches)
        assert_runs_equal(fresh, kept, ("plain loop trained anew", f"{sharding_type}, {seed}"))


def test_a_model_class_made_inside_a_function_is_never_kept() -> None:
    def local_class(scale: float) -> Any:
        class Scaled(DLRM):
            def forward(self, batch: Any) -> Any:
                loss, out = super().forward(batch)
                return loss * scale, out

        return Scaled

    batches = make_batches(3, seed=DATA_SEED)
    trained = references.references_trained()
    down = plain_loop_of(local_class(1.0), "table_wise", batches, seed=SEED)
    up = plain_loop_of(local_class(-1.0), "table_wise", batches, seed=SEED)
    assert references.references_trained() == trained + 2
    assert not torch.equal(down[-1], up[-1]), "the second class's run was the first's copy"
