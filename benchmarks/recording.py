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

The rank that draws the timeline also stores what it is drawn from, under
``"timeline"`` (layout in :func:`timeline_json`): every action with its stream
and device times, and every all-to-all from its issue to its completion, so
:func:`redraw_timelines` can draw the pictures again from a ``results.json``.
For ``StagedTrainPipeline`` the loop's own step (zero_grad, forward, backward,
optimizer step), which runs between the pipeline's calls, is recorded too,
through the contender's ``step_span``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch import nn

from trec_pipelines.observe import schedule_view
from trec_pipelines.observe.action_records import Action, Transfer
from trec_pipelines.observe.task_names import WAIT_BATCH
from trec_pipelines.sparse.input_dist_tap import INPUT_DIST_AWAITABLES, InputDistTap, tap_input_dist

# The progress() calls a timeline draws: past the fill, into the steady state.
TIMELINE_CALLS: Tuple[int, int] = (2, 5)


def picture_name(variant: str, batch_size: int) -> str:
    """The timeline's file name: ``"X [shared]"`` at batch 512 -> ``X_shared_b512.png``."""
    return f"{variant.replace(' [', '_').replace(']', '')}_b{batch_size}.png"


def timeline_json(
    actions: Sequence[Action],
    transfers: Sequence[Transfer],
    origin: float,
    on_cpu: bool,
    calls: Tuple[int, int] = TIMELINE_CALLS,
) -> Dict[str, Any]:
    """What a timeline is drawn from, as plain JSON (seconds from ``origin``).

    ``actions``: ``[call, task, batch, stream, thread, cpu_start, cpu_end,
    device_start, device_end]``; ``transfers``: ``[call, task, batch, group,
    bytes, issued, completed]`` (a device time or ``completed`` may be null);
    ``calls``: the window drawn; ``on_cpu``: recorded on CPU.
    """

    def rel(t: Optional[float]) -> Optional[float]:
        return None if t is None else round(t - origin, 7)  # to 0.1 us: enough to draw

    return {
        "on_cpu": on_cpu,
        "calls": list(calls),
        "actions": [
            [
                a.call,
                a.task,
                a.batch,
                a.stream,
                a.thread,
                rel(a.cpu_start),
                rel(a.cpu_end),
                rel(a.device_start),
                rel(a.device_end),
            ]
            for a in actions
        ],
        "transfers": [
            [t.call, t.task, t.batch, t.group, t.nbytes, rel(t.issued), rel(t.completed)]
            for t in transfers
        ],
    }


def timeline_from_json(stored: Dict[str, Any]) -> Tuple[List[Action], List[Transfer]]:
    """The actions and transfers :func:`timeline_json` stored."""
    actions = [
        Action(call, task, batch, stream, thread, cpu_start, cpu_end, device_start, device_end)
        for call, task, batch, stream, thread, cpu_start, cpu_end, device_start, device_end in stored[
            "actions"
        ]
    ]
    transfers = [Transfer(*row) for row in stored["transfers"]]
    return actions, transfers


def draw_stored(stored: Dict[str, Any], path: str, title: str) -> None:
    """Draw the timeline :func:`timeline_json` stored to the PNG ``path``."""
    actions, transfers = timeline_from_json(stored)
    first, last = stored["calls"]
    schedule_view.draw_timeline(
        actions,
        path,
        calls=(first, last),
        title=title,
        transfers=transfers,
        on_cpu=stored["on_cpu"],
    )


def redraw_timelines(results: Dict[str, Any], out_dir: str) -> List[str]:
    """Draw again every timeline a ``results.json`` (loaded) stores, into ``out_dir``.

    Returns the paths written, named as the run named them; a recorded epoch
    stored without its timeline (a run from before timelines were stored) is
    skipped.
    """
    written: List[str] = []
    blocks = (results.get("raw") or {}).get("throughput") or []
    for block in blocks:
        for variant, ranks in (block.get("recorded") or {}).items():
            stored = next((r["timeline"] for r in ranks if r and r.get("timeline")), None)
            if stored is None:
                continue
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, picture_name(variant, block["batch_size"]))
            draw_stored(stored, path, timeline_title(variant, block["batch_size"]))
            written.append(path)
    return written


def timeline_title(variant: str, batch_size: int) -> str:
    """A timeline's title: the variant and its batch size."""
    return (
        f"{variant}, batch {batch_size}: progress() calls {TIMELINE_CALLS[0]}..{TIMELINE_CALLS[1]}"
    )


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


__all__ = [
    "INPUT_DIST_AWAITABLES",
    "InputDistTap",
    "TIMELINE_CALLS",
    "draw_stored",
    "picture_name",
    "recorded_epoch",
    "redraw_timelines",
    "tap_input_dist",
    "timeline_from_json",
    "timeline_json",
    "timeline_title",
]
