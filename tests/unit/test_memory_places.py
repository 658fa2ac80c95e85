"""Held memory by place: host batches (pulled, not yet copied) and device batches."""

from __future__ import annotations

from typing import Any, List

import torch

import trec_pipelines as tp
from tests.unit.fakes import TinyModel, drain, make_batches, optimizer_for
from tests.unit.test_memory_ledger import _tensors
from trec_pipelines.data.source import BatchSource
from trec_pipelines.observe.memory import (
    BATCH,
    DEVICE_BATCH,
    HOST_BATCH,
    OTHER,
    footprint,
)

CPU = torch.device("cpu")


class Holder:
    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


def nbytes(batch: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(batch))


def test_a_batch_source_holds_host_batches() -> None:
    """The source's fetched-ahead batch is a host batch; the copied ones are device batches."""
    batches = make_batches(3)
    # (computes the KJTs' offsets first: the batches hold them)
    size, rest = nbytes(batches[0]), nbytes(batches[1]) + nbytes(batches[2])
    source = BatchSource()
    it = iter(batches)
    source.fetch_ahead(it, count=1)
    assert source.host_batches() == [batches[0]]
    copied = batches[1:]  # taken as copied: not the source's
    holder = Holder(_source=source, batches=copied)
    held = footprint(holder)
    assert held.batches == 3 and held.host_batches == 1 and held.device_batches == 2
    assert held.host_batch_bytes == held.bytes_by_place[HOST_BATCH] == size
    assert held.bytes_by_place[DEVICE_BATCH] == rest
    assert held.bytes_by_kind[BATCH] == size + rest
    source.next(it)  # handed out: no longer the source's
    assert source.host_batches() == []
    assert footprint(Holder(_source=source, cur=batches[0])).host_batches == 0


def test_a_host_batch_sharing_storage_with_its_copy_is_one_device_batch() -> None:
    """On CPU a copy may hand over the host batch's own tensors: one batch, on the device."""
    host = torch.arange(12, dtype=torch.float32)
    copy = host.view(3, 4)  # another object, the same storage
    held = footprint(Holder(_held=[host], cur=copy))
    assert held.batches == 1 and held.host_batches == 0 and held.device_batches == 1
    assert held.bytes_by_place[DEVICE_BATCH] == 48 and held.bytes_by_place[HOST_BATCH] == 0


def test_host_objects_are_host_batches_wherever_they_are_held() -> None:
    """torchrec's classes have no batch source: the batches fed to them are named instead."""
    fed = [torch.ones(4), torch.ones(8)]
    copied = fed[1].clone()
    holder = Holder(_cur_batch=fed[0], batches=[copied])
    held = footprint(holder, host_objects=fed)
    assert (held.host_batches, held.device_batches) == (1, 1)
    assert held.bytes_by_place == {
        HOST_BATCH: 16,
        DEVICE_BATCH: 32,
        "context": 0,
        "embeddings": 0,
        OTHER: 0,
    }
    assert footprint(holder).host_batches == 0  # not named: a batch held, taken as copied


def test_the_ledger_reports_by_place() -> None:
    """One process (no agreement, nothing pulled ahead): SparseDist's only host
    batch is the one each call pulls before copying it (two in the fill)."""
    model = TinyModel()
    pipeline = tp.TrainPipelineSparseDist(model, optimizer_for(model), CPU)
    pipeline.enable_schedule_recording(memory=True)
    drain(pipeline, iter(make_batches(8)))
    samples = pipeline.memory_samples
    host: List[int] = [s.held.host_batches for s in samples]
    summary = pipeline.memory_ledger()
    assert summary.max_host_batches == max(host) == 2
    assert max(s.held.host_batches for s in samples if s.call >= 1) == 1
    assert summary.max_device_batches == max(s.held.device_batches for s in samples) == 3
    assert summary.max_by_place[HOST_BATCH] > 0
    for sample in samples:
        by_place = sample.held.bytes_by_place
        assert by_place[HOST_BATCH] + by_place[DEVICE_BATCH] == sample.held.bytes_by_kind[BATCH]
    text = pipeline.print_memory()
    assert "host batch" in text and "device batch" in text
    assert "at most 2 on the host" in text and "3 on the device" in text
