"""Tools to check a pipeline's stream protocol on CPU, with no GPU.

:class:`StreamRecorder` runs a pipeline on a recording stand-in for a device
with streams; :func:`assert_stream_protocol` checks the record against the
rules of ``[Note: stream protocol]`` (:mod:`trec_pipelines.core.streams`).

Example::

    model = MyModel()
    with StreamRecorder() as recorder:
        pipeline = recorder.watch(TrainPipelineSparseDist(model, optimizer, torch.device("cpu")))
        for _ in range(5):
            pipeline.progress(it)
    assert_stream_protocol(recorder)
"""

from typing import List

from trec_pipelines.testing.stream_checker import (
    ProtocolSummary,
    StreamProtocolError,
    Violation,
    assert_stream_protocol,
    check_schedule,
    check_stream_protocol,
    schedule_by_stream,
    summarize,
)
from trec_pipelines.testing.stream_device import RecordingDevice, RecordingEvent, RecordingStream
from trec_pipelines.testing.stream_recorder import StreamRecorder, host_memory_of

# The recorder, the checks, what they report, then the stand-in device.
__all__ = [
    "StreamRecorder",
    "host_memory_of",
    "assert_stream_protocol",
    "check_stream_protocol",
    "check_schedule",
    "StreamProtocolError",
    "Violation",
    "ProtocolSummary",
    "summarize",
    "schedule_by_stream",
    "RecordingDevice",
    "RecordingStream",
    "RecordingEvent",
]


def __dir__() -> List[str]:
    """``dir(trec_pipelines.testing)``: the public names, not the modules (PEP 562)."""
    return list(__all__)
