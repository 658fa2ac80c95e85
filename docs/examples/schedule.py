"""Seeing what a pipeline did: its recorded schedule and what it held."""

from __future__ import annotations

from typing import Any, Iterator, List, Tuple

from trec_pipelines import TrainPipelineSparseDist
from trec_pipelines.observe.ledger import LedgerSummary


def record(
    pipeline: TrainPipelineSparseDist[Any, Any], it: Iterator[Any], steps: int = 6
) -> Tuple[List[Any], LedgerSummary]:
    pipeline.enable_schedule_recording(memory=True)
    for _ in range(steps):
        pipeline.progress(it)
    pipeline.print_schedule(steps - 1)  # task x progress() call -> batch index, with streams
    pipeline.print_memory()  # host and device batches, then by kind: at the peak, steady, own max
    pipeline.export_trace("trace.json")  # Chrome / Perfetto: a track per stream + the CPU thread
    return pipeline.schedule(), pipeline.memory_ledger()
