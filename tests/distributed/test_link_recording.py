"""The link as recorded on 2 ranks: each all-to-all from its issue to the completion of its work.

A bare all-to-all: its completion falls between its issue and the end of the
wait for it.  A pipeline: each all-to-all its verbs issue is noted under the
verb and batch, on the group it ran on (the ids on the dedicated input-dist
group, the embeddings and their gradients on the model's), and completed
after it was issued.  Collectives end in an error, not a hang, after the
process group's timeout (tests/distributed/conftest.py).
"""

from __future__ import annotations

import time
from collections import Counter

import torch
import torch.distributed as dist

import trec_pipelines
from trec_pipelines.observe import all_to_all_watch as links
from trec_pipelines.observe.recorder import ScheduleRecorder
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    current_group,
    make_batches,
    make_sharded,
    run_pipeline,
)

DEVICE = devices.device()
SEED, DATA_SEED = 321, 5


def test_an_all_to_all_completes_between_its_issue_and_the_end_of_its_wait() -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    recorder = ScheduleRecorder()
    links.watch(recorder)
    try:
        recorder.begin_call()
        sent = torch.full((world * 1000,), float(rank), device=DEVICE)
        received = torch.empty_like(sent)
        with recorder.span("InputDistStart", 7, "data_dist"):
            work = dist.all_to_all_single(received, sent, group=current_group(), async_op=True)
        work.wait()
        waited = time.perf_counter()
    finally:
        links.unwatch(recorder)
    recorder.resolve()
    assert received.view(world, -1)[:, 0].tolist() == [float(r) for r in range(world)]
    [transfer] = recorder.transfers
    assert (transfer.call, transfer.task, transfer.batch) == (0, "InputDistStart", 7)
    assert transfer.group == links.MODEL_GROUP
    assert transfer.nbytes == sent.numel() * sent.element_size()
    assert transfer.completed is not None
    assert transfer.issued <= transfer.completed <= waited


def test_a_pipeline_records_each_all_to_all_under_its_verb_and_group() -> None:
    original = dist.all_to_all_single
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = trec_pipelines.TrainPipelineSparseDist(dmp, optimizer, DEVICE)
    pipeline.enable_schedule_recording()
    run_pipeline(pipeline, make_batches(5, seed=DATA_SEED), model=dmp)
    transfers = pipeline.schedule_transfers
    pipeline.disable_schedule_recording()
    assert dist.all_to_all_single is original
    by_verb = Counter((t.task, t.group) for t in transfers if t.batch != 0)
    # Past the first batch (whose input dist runs before the pipeline fuses
    # the splits, on the model's group), the splits and the ids on the
    # dedicated group; the embeddings and their gradients on the model's.
    assert set(by_verb) == {
        ("InputDistStart", links.INPUT_DIST_GROUP),
        ("InputDistWait", links.INPUT_DIST_GROUP),
        ("Forward", links.MODEL_GROUP),
        ("Backward", links.MODEL_GROUP),
    }, by_verb
    first = Counter((t.task, t.group) for t in transfers if t.batch == 0)
    assert {group for _, group in first} == {links.MODEL_GROUP}, first
    for task in ("InputDistStart", "Forward", "Backward"):
        batches = sorted({t.batch for t in transfers if t.task == task})
        assert batches == list(range(5)), (task, batches)
    for transfer in transfers:
        assert transfer.completed is not None, transfer
        assert transfer.issued <= transfer.completed, transfer
