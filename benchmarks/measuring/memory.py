"""What each pipeline holds, measured in separate untimed epochs.

Two measurements per pipeline contender:

* from outside, alike for ours and torchrec's class: after every
  ``progress()`` the storages reachable from the pipeline object
  (:func:`trec_pipelines.observe.memory.footprint`, model and optimizer left out),
  keeping the largest; plus the process's resident memory (VmRSS) sampled at
  the same moments;
* for ours only, the per-action memory ledger (schedule recording with
  ``memory=True``), which also sees what ``progress()`` holds in its locals
  while it runs, so its peak is at least the outside one.

Held memory is split by place (``[Note: memory places]`` in
``trec_pipelines/observe/memory.py``): a host batch is one of the batches this
epoch feeds the pipeline, as the iterator gave it, held by the pipeline and not
yet copied (``Batch.to()`` always makes a new object), for torchrec's classes
and ours alike; ours' batch sources also list theirs.  Every other batch held is
a device batch.

And, for SparseDist, what the memory options save: a fresh pipeline per
option set, each measured from outside (``option_sets``).  Every epoch here
runs on batches made for it alone, and the options' batches copy in ``to()``
as a GPU's host-to-device copy does (``Batch.copying``): on CPU ``to()``
otherwise hands over the loader's own tensors, which ours never frees
(torchrec's ``free_features_storage_early`` does, destroying the data).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

from benchmarks.contenders.build import Contender
from benchmarks.measuring.timeline_store import timeline_json
from trec_pipelines.observe.memory import PeakTracker, footprint, owned_storages, rss_bytes
from trec_pipelines.testing import devices

# The variant whose memory options are measured, and the option sets, baseline first.
OPTIONS_VARIANT = "TrainPipelineSparseDist"
OPTION_SETS: Tuple[Tuple[str, Dict[str, Any]], ...] = (
    ("none", {}),
    ("enable_inplace_copy_batch", {"enable_inplace_copy_batch": True}),
    ("free_features_storage_early", {"free_features_storage_early": True}),
    ("clear_data_dist_inputs", {"clear_data_dist_inputs": True}),
    (
        "all three",
        {
            "enable_inplace_copy_batch": True,
            "free_features_storage_early": True,
            "clear_data_dist_inputs": True,
        },
    ),
)


@contextlib.contextmanager
def _after_each_step(contender: Contender, hook: Any) -> Iterator[None]:
    contender.after_step = hook
    try:
        yield
    finally:
        contender.after_step = None


def held_epoch(contender: Contender, batches: Sequence[Any]) -> Dict[str, Any]:
    """One epoch measured from outside after each ``progress()`` (see the module docstring)."""
    pipeline = getattr(contender, "pipeline", None)
    if pipeline is None:
        raise RuntimeError(f"{contender.key} has no pipeline object to measure")
    skip = owned_storages(contender.model, contender.optimizer)
    tracker = PeakTracker()
    rss_peak = 0

    def after_step() -> None:
        nonlocal rss_peak
        tracker.add(footprint(pipeline, skip, host_objects=batches))
        rss_peak = max(rss_peak, rss_bytes() or 0)

    rss_before = rss_bytes()
    with _after_each_step(contender, after_step):
        contender.run_epoch(batches)
    peak = tracker.peak
    if peak is None:
        raise RuntimeError(f"{contender.key} made no step to measure")
    return {
        "held_peak": peak.total,
        "held_by_kind": dict(peak.bytes_by_kind),
        "storages": peak.storages,
        "max_batches": tracker.max_batches,
        "held_by_place": peak.bytes_by_place,
        "place_peaks": dict(tracker.peak_by_place),
        "max_host_batches": tracker.max_host_batches,
        "max_device_batches": tracker.max_device_batches,
        "agree_ahead": agrees_ahead(pipeline),
        "truncated": peak.truncated,
        "rss_before": rss_before,
        "rss_peak": rss_peak,
        "steps": tracker.samples,
    }


def agrees_ahead(pipeline: Any) -> bool:
    """Whether ``pipeline`` (ours) pulls a host batch ahead for the ranks' agreement
    (``agree_ahead``, with an agreement); False for torchrec's classes."""
    source = getattr(pipeline, "_source", None)
    return bool(
        getattr(source, "agree_ahead", False) and getattr(source, "agreement", None) is not None
    )


def ledger_epoch(
    contender: Contender, batches: Sequence[Any], timeline: Optional[Dict[str, Any]] = None
) -> Optional[Dict[str, Any]]:
    """One epoch of ours with the per-action memory ledger on; None without a recorder.

    ``timeline``: a dict that receives that epoch's timeline (calls 1..4) with
    its memory track, stored as JSON (:mod:`benchmarks.measuring.timeline_store`:
    the memory figure is drawn from it, at run time and by ``replot``).  Its
    times include the measuring, so it shows the order of work and what is
    held, not how long each verb takes.
    """
    pipeline = getattr(contender, "pipeline", None)
    if pipeline is None or not hasattr(pipeline, "enable_schedule_recording"):
        return None
    pipeline.disable_schedule_recording()
    recorder = pipeline.enable_schedule_recording(memory=True)
    try:
        contender.run_epoch(batches)
        summary = pipeline.memory_ledger()
        if timeline is not None:
            starts = list(recorder.call_starts)
            timeline.update(
                timeline_json(
                    pipeline.schedule_actions,
                    pipeline.schedule_transfers,
                    starts[0] if starts else 0.0,
                    devices.device_type() == "cpu",
                    calls=(1, min(4, len(batches) - 1)),
                    memory=pipeline.memory_samples,
                ),
                title=type(pipeline).__name__,
                variant=contender.variant,
            )
    finally:
        pipeline.disable_schedule_recording()
    return {
        "peak": summary.peak_bytes,
        "peak_by_kind": dict(summary.peak_by_kind),
        "peak_at": summary.peak_at,
        "steady": summary.steady_bytes,
        "steady_by_kind": dict(summary.steady_by_kind),
        "max_batches": summary.max_batches,
        "peak_by_place": dict(summary.peak_by_place),
        "steady_by_place": dict(summary.steady_by_place),
        "max_host_batches": summary.max_host_batches,
        "max_device_batches": summary.max_device_batches,
        "device_max_allocated": summary.device_max_allocated,
        "device_max_reserved": summary.device_max_reserved,
    }


__all__ = ["OPTIONS_VARIANT", "OPTION_SETS", "agrees_ahead", "held_epoch", "ledger_epoch"]
