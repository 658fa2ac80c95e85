"""The code the guides show (docs/examples/), run on the test DLRM: each must do
what its guide says, checked against the plain loop."""

from __future__ import annotations

import tempfile
from typing import Any, List

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from docs.examples import checkpoint, quickstart, schedule
from tests import devices
from tests.distributed.dlrm import (
    DLRM,
    Run,
    assert_runs_equal,
    make_batches,
    make_sharded,
    plain_loop,
    plain_loop_restarted,
    weights,
)
from tests.elastic.train_with_checkpoints import Batches

DEVICE = devices.device()
SEED, RESTART_SEED, DATA_SEED = 1234, 99, 11
N = 7


def _outputs(raw: List[Any]) -> List[torch.Tensor]:
    return [out.detach().clone() for out in raw]


def test_quickstart_trains_as_the_plain_loop(capsys: Any) -> None:
    batches = make_batches(N, seed=DATA_SEED)
    ref = plain_loop(*make_sharded(DLRM, "table_wise", seed=SEED), batches)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    ours = Run(_outputs(quickstart.train_one_epoch(dmp, optimizer, batches, DEVICE)), weights(dmp))
    assert_runs_equal(ref, ours, ("plain loop", "quickstart"))
    assert "ebc" in capsys.readouterr().out  # the report names the pipelined module


def test_checkpoint_recipe_resumes_the_batches_in_flight() -> None:
    """Save after 3 steps, resume into a new model, pipeline and loader: the run
    equals the plain loop's over all the batches, none lost or trained twice (on
    more than 2 ranks the plain loop restarted at the same step, as in
    test_resume: DDP's rebuilt buckets change a sum's order in the last bits)."""
    batches = make_batches(N, seed=DATA_SEED)
    ref = plain_loop_restarted(batches, 3, SEED, RESTART_SEED)
    # The same directory on every rank (each writes its own file in it).
    name = [tempfile.mkdtemp(prefix="trec_doc_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    directory = str(name[0])

    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    loader = StatefulDataLoader(Batches(batches), batch_size=None)
    pipeline = checkpoint.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    it = iter(loader)
    before = _outputs([pipeline.progress(it) for _ in range(3)])
    checkpoint.save(directory, pipeline, dmp, optimizer, loader)
    dist.barrier()

    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED + 1)  # other weights: all loaded
    loader = StatefulDataLoader(Batches(batches), batch_size=None)
    pipeline, it = checkpoint.resume(directory, dmp, optimizer, loader, DEVICE)
    after: List[torch.Tensor] = []
    while True:
        try:
            after.append(pipeline.progress(it).detach().clone())
        except StopIteration:
            break
    assert_runs_equal(ref, Run(before + after, weights(dmp)), ("plain loop", "resumed"))


def test_schedule_example_records_the_steady_state(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)  # export_trace writes trace.json here
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = schedule.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    rows, ledger = schedule.record(pipeline, iter(make_batches(N, seed=DATA_SEED)))
    by_task = {(task, stream): cells for task, stream, cells in rows}
    # SparseDist's steady state: step k trains batch k and copies batch k+2.
    assert by_task[("Forward", "default")][3] == 3
    assert by_task[("H2D", "memcpy")][3] == 5
    # Three in flight, and the batch pulled a step ahead while the ranks agree on it.
    assert ledger.max_batches == 4
    assert (tmp_path / "trace.json").stat().st_size > 0
