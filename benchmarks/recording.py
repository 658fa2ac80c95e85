"""The recorded epoch of a variant of ours: its schedule, and where its input dist went.

Per variant of ours and batch size the runner runs one untimed epoch with
schedule recording on (the timeline picture is drawn from it).  During that
epoch :func:`~trec_pipelines.sparse.input_dist_tap.tap_input_dist` (in the package,
shared with ``trec_pipelines.advise``) also notes, on the training thread only:

* the time spent inside torchrec's ``input_dist`` of each sharded module
  ("issue") and inside the waits of the input dist's awaitables ("wait"):
  the part of the input dist the thread did not hide, wherever it happens
  (a pipelined forward waits for the tensors all-to-all inside its
  Forward verb; Base runs the whole input dist inside its forward);
* the moment each all-to-all was issued and the bytes this rank sent in it.

Everything is stored as plain JSON (layout in :mod:`benchmarks.schedule_bound`,
which computes the hidden fraction and the link-order gap from it).  The
taps replace a few torchrec methods and ``torch.distributed.all_to_all_single``
for the length of that epoch only; nothing timed ever runs with them.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from torch import nn

from trec_pipelines.sparse.input_dist_tap import INPUT_DIST_AWAITABLES, InputDistTap, tap_input_dist


def recorded_epoch(
    pipeline: Any, model: nn.Module, run_epoch: Callable[[], Any], picture: Optional[str] = None
) -> Dict[str, Any]:
    """Run ``run_epoch`` with ``pipeline`` recording its schedule and the input dist tapped.

    Returns the epoch as plain JSON (seconds from the first ``progress()``
    call); with ``picture`` also draws ``progress()`` calls 2..5 to that PNG.
    """
    recorder = pipeline.enable_schedule_recording()
    try:
        with tap_input_dist(model) as tap:
            run_epoch()
        actions = pipeline.schedule_actions
        if picture is not None:
            pipeline.save_timeline(picture, calls=(2, 5))
        call_starts = list(recorder.call_starts)
    finally:
        pipeline.disable_schedule_recording()
    origin = call_starts[0] if call_starts else 0.0
    return {
        "call_starts": [t - origin for t in call_starts],
        "actions": [
            [a.call, a.task, a.batch, a.thread, a.cpu_start - origin, a.cpu_end - origin]
            for a in actions
        ],
        "input_dist": [[kind, start - origin, end - origin] for kind, start, end in tap.intervals],
        "all_to_alls": [[t - origin, nbytes] for t, nbytes in tap.all_to_alls],
    }


__all__ = ["INPUT_DIST_AWAITABLES", "InputDistTap", "recorded_epoch", "tap_input_dist"]
