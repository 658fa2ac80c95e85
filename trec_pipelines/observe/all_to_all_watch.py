"""The link: when each all-to-all of a recorded pipeline was on the wire.

torchrec issues the input dist's two all-to-alls (the splits, then the ids)
and the embeddings' output all-to-alls (and, in backward, their gradients')
through ``torch.distributed.all_to_all_single``.  While a pipeline records its
schedule (``enable_schedule_recording()``), that function is wrapped to note,
per call, a :class:`~trec_pipelines.observe.action_records.Transfer`: the verb and
batch it was issued in, its process group, the bytes this rank sent, when it
was issued and when its work completed.

Completion is stamped by a callback on the work's future, so it is when the
work finished even if nobody waited for it then: on CPU (gloo) the callback
runs as the work completes and reads the clock; on CUDA it runs at once on a
stream made to wait for the collective, and records an event there, which the
recorder turns into a time with its other events.  A blocking call (no work
returned) completes when it returns.

The wrapper is installed when the first recorder starts watching and removed
when the last one stops; when something else wrapped the function meanwhile
(and has not put it back), it stays, calling torch's function straight through
while nobody watches, and removes itself at its first call once it is
``torch.distributed.all_to_all_single`` again (that other wrapper put it back).
With no recorder ever enabled, nothing is wrapped.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable, List, Optional, Protocol

import torch
import torch.distributed as dist

from trec_pipelines.core import lifetime
from trec_pipelines.core.streams import current_stream
from trec_pipelines.observe.action_records import Action, Transfer


class Watcher(Protocol):
    """What the link needs of a recorder (:class:`~trec_pipelines.observe.recorder.ScheduleRecorder`
    is one; named here by what it does, since the recording imports this module)."""

    def enclosing(self) -> Optional[Action]: ...

    def note_transfer(
        self, group: str, nbytes: int, issued: float, device: torch.device
    ) -> Transfer: ...

    def end_transfer_on(self, transfer: Transfer, stream: Optional[torch.Stream]) -> None: ...


INPUT_DIST_GROUP = "input-dist group"
MODEL_GROUP = "model group"

_lock = threading.Lock()
# The recorders watching, by id (a recorder is a dataclass: not hashable).
_watching: "weakref.WeakValueDictionary[int, Watcher]" = weakref.WeakValueDictionary()
# torch's all_to_all_single while ours is installed, else None.
_original: Optional[Callable[..., Any]] = None


def watch(recorder: Watcher) -> None:
    """Note the all-to-alls issued from now on in ``recorder`` (installs the wrapper)."""
    global _original
    with _lock:
        _watching[id(recorder)] = recorder
        if _original is None:
            _original = dist.all_to_all_single
            dist.all_to_all_single = _all_to_all_single


def unwatch(recorder: Watcher) -> None:
    """Stop noting all-to-alls in ``recorder``; the last one out removes the wrapper."""
    with _lock:
        _watching.pop(id(recorder), None)
        _remove_if_unwatched()


def _remove_if_unwatched() -> None:
    """Put torch's function back if nobody watches and the wrapper is on top
    (the caller holds ``_lock``)."""
    global _original
    if not _watching and _original is not None and dist.all_to_all_single is _all_to_all_single:
        dist.all_to_all_single = _original
        _original = None


def watched() -> bool:
    """Whether some recorder is noting all-to-alls now."""
    return bool(_watching)


def group_label(group: Optional[dist.ProcessGroup]) -> str:
    """Which group an all-to-all ran on: a dedicated input-dist group, or the model's."""
    return INPUT_DIST_GROUP if group is not None and lifetime.is_owned(group) else MODEL_GROUP


def _argument(args: Any, kwargs: Any, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _all_to_all_single(*args: Any, **kwargs: Any) -> Any:
    original = _original
    assert original is not None, "the wrapper is only called while installed"
    recorders = list(_watching.values())
    if not recorders:
        with _lock:
            _remove_if_unwatched()
        return original(*args, **kwargs)
    sent = _argument(args, kwargs, 1, "input")
    nbytes = sent.numel() * sent.element_size() if isinstance(sent, torch.Tensor) else 0
    device = sent.device if isinstance(sent, torch.Tensor) else torch.device("cpu")
    label = group_label(_argument(args, kwargs, 4, "group"))
    claimed = [r for r in recorders if r.enclosing() is not None] or recorders
    issued = time.perf_counter()
    notes: List[Transfer] = [r.note_transfer(label, nbytes, issued, device) for r in claimed]
    work = original(*args, **kwargs)
    if work is None:  # a blocking call: done when it returns
        done = time.perf_counter()
        for note in notes:
            note.completed = done
        return work
    if device.type == "cpu":

        def stamp(_: Any) -> None:
            done = time.perf_counter()
            for note in notes:
                note.completed = done

    else:

        def stamp(_: Any) -> None:
            # Runs on streams that wait for the collective: an event here marks its end.
            stream = current_stream(device)
            for recorder, note in zip(claimed, notes, strict=True):
                recorder.end_transfer_on(note, stream)

    work.get_future().then(stamp)
    return work


__all__ = [
    "INPUT_DIST_GROUP",
    "MODEL_GROUP",
    "Watcher",
    "group_label",
    "unwatch",
    "watch",
    "watched",
]
