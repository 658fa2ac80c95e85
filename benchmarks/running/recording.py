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

Everything is stored as plain JSON (layout in :mod:`benchmarks.measuring.schedule_bound`,
which computes the hidden fraction and the link-order gap from it).  The
taps replace a few torchrec methods and ``torch.distributed.all_to_all_single``
for the length of that epoch only; nothing timed ever runs with them.

The rank that draws the timeline also stores what it is drawn from, under
``"timeline"`` (layout in :func:`~benchmarks.figures.timelines.timeline_json`): every action with its stream
and device times, and every all-to-all from its issue to its completion, so
:func:`~benchmarks.figures.timelines.redraw_timelines` can draw the pictures again from a ``results.json``.
For ``StagedTrainPipeline`` the loop's own step (zero_grad, forward, backward,
optimizer step), which runs between the pipeline's calls, is recorded too,
through the contender's ``step_span``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from torch import nn

from benchmarks.figures.timelines import draw_stored
from benchmarks.measuring.timeline_store import timeline_json
from trec_pipelines.observe.task_names import WAIT_BATCH
from trec_pipelines.sparse.input_dist_tap import INPUT_DIST_AWAITABLES, InputDistTap, tap_input_dist


def recorded_epoch(
    pipeline: Any,
    model: nn.Module,
    run_epoch: Callable[[], Any],
    picture: Optional[str] = None,
    title: str = "",
    loop: Any = None,
    on_cpu: bool = True,
) -> Dict[str, Any]:
    """Run ``run_epoch`` with ``pipeline`` recording its schedule and the input dist tapped.

    Returns the epoch as plain JSON (seconds from the first ``progress()``
    call); with ``picture`` also draws ``progress()`` calls 2..5 to that PNG
    (titled ``title``) and stores what it drew under ``"timeline"``.  ``loop``:
    a contender whose loop does the training step itself (Staged); its
    ``step_span`` records each part of that step for the epoch.
    """
    recorder = pipeline.enable_schedule_recording()
    if loop is not None:

        def step_span(task: str, step: int) -> Any:
            # The batch the pipeline handed over last (its index counts every
            # epoch's batches); the loop's step number if it recorded none.
            handed = next(
                (a.batch for a in reversed(recorder.actions) if a.task == WAIT_BATCH), None
            )
            return recorder.span(task, step if handed is None else handed, "default")

        loop.step_span = step_span
    try:
        with tap_input_dist(model) as tap:
            run_epoch()
        actions = pipeline.schedule_actions
        transfers = pipeline.schedule_transfers
        call_starts = list(recorder.call_starts)
    finally:
        if loop is not None:
            loop.step_span = None
        pipeline.disable_schedule_recording()
    origin = call_starts[0] if call_starts else 0.0
    epoch: Dict[str, Any] = {
        "call_starts": [t - origin for t in call_starts],
        "actions": [
            [a.call, a.task, a.batch, a.thread, a.cpu_start - origin, a.cpu_end - origin]
            for a in actions
        ],
        "input_dist": [[kind, start - origin, end - origin] for kind, start, end in tap.intervals],
        "all_to_alls": [[t - origin, nbytes] for t, nbytes in tap.all_to_alls],
    }
    if picture is not None:
        epoch["timeline"] = timeline_json(actions, transfers, origin, on_cpu)
        draw_stored(epoch["timeline"], picture, title or type(pipeline).__name__)
    return epoch


__all__ = ["INPUT_DIST_AWAITABLES", "InputDistTap", "recorded_epoch", "tap_input_dist"]
