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
from trec_pipelines.testing.stream_recorder import StreamRecorder

__all__ = [
    "ProtocolSummary",
    "RecordingDevice",
    "RecordingEvent",
    "RecordingStream",
    "StreamProtocolError",
    "StreamRecorder",
    "Violation",
    "assert_stream_protocol",
    "check_schedule",
    "check_stream_protocol",
    "schedule_by_stream",
    "summarize",
]
