"""Check a recorded run against the stream protocol (``[Note: stream protocol]``).

:func:`check_stream_protocol` replays the records of a
:class:`~trec_pipelines.testing.stream_recorder.StreamRecorder` (any
:class:`~trec_pipelines.testing.stream_records.Recording`) as a GPU would
order them and returns every :class:`Violation` of four rules:

(a) **Cross-stream access needs a wait.**  A kernel on stream S that reads a
    storage last written on stream T != S must be ordered after that write:
    S issued ``wait_stream(T)`` after the write, or waited on an event
    recorded on T after it -- directly or through other streams (if B waited
    for A after A wrote, and C then waited for B, C is covered).  The same
    holds for a write after another stream's read (the writer must have
    waited for the read).  Ordering is tracked with one vector clock per
    stream; ``synchronize()`` of a stream, event or the device orders all
    later work.  Host reads (``.item()``) are not counted as synchronization:
    the protocol must not rely on a model happening to sync.
(b) **Memory handed to another stream is ``record_stream``-ed there.**  For a
    storage allocated during the run on stream A and used by a kernel on
    stream B != A: when it is freed without ``record_stream(B)``, the next
    kernel A issues must be ordered after B's last use of it (A waited for B
    since).  Otherwise the caching allocator may hand the block to new work
    on A while B still reads it.  ``record_stream(B)`` any time before the
    free satisfies the rule.  Exempt: external memory (parameters, buffers
    and host tensors made before the recording; the allocator never frees
    them under the pipeline) and storages still alive when the recording
    ends, or never followed by more work on A (no reuse can happen).
(c) **An event is recorded before it is waited on.**  On a GPU a wait on an
    event that was never recorded returns at once: no ordering at all.
(d) **Each stream's work follows the schedule.**  Given the variant's exact
    recorded sequence (``"P0 H2D[i0]@memcpy"`` strings or recorder actions),
    the (task, batch) sequence recorded on each stream role must equal that
    sequence's projection on the role.  Independently of a given schedule,
    every kernel issued inside a verb runs on the stream the verb is recorded
    on (when that role names a stream of the pipeline's recorder), or on a
    side stream that the verb's stream waits for before the verb ends.  A verb
    may finish, on the side stream where it was issued, work an earlier verb
    started there (torchrec's forward completes the input_dist's all-to-all on
    the data_dist stream, then joins that stream): everything after the verb
    on its stream is still ordered after that work, as if it had run there.
    A side stream is one some verb is recorded on, other than the default
    stream.  Reported: work a verb issues on the default stream when the verb
    is recorded on a side stream (it serializes what the schedule overlaps),
    and side-stream work its verb's stream has not waited for when the verb
    ends.

Every message names the tensor (dtype, shape, storage number), where it was
produced (stream, and the pipeline step and task active then), the two
streams, and the step (``progress()`` call and task) of the access.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, DefaultDict, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from trec_pipelines.testing.stream_records import (
    EventLike,
    FreeRecord,
    OpRecord,
    RecordEventRecord,
    Recording,
    RecordStreamRecord,
    Span,
    SpanRecord,
    SyncRecord,
    WaitEventRecord,
    WaitStreamRecord,
    Where,
)

RULES = "abcd"

Clock = Dict[Any, int]  # stream -> how much of its work is known to be done


@dataclass(frozen=True)
class Violation:
    """One broken rule: ``rule`` is "a", "b", "c" or "d"."""

    rule: str
    message: str

    def __str__(self) -> str:
        return f"rule ({self.rule}) {self.message}"


class StreamProtocolError(AssertionError):
    """Raised by :func:`assert_stream_protocol`; ``violations`` holds them all."""

    def __init__(self, violations: List[Violation], shown: int = 20) -> None:
        self.violations = violations
        lines = [str(v) for v in violations[:shown]]
        if len(violations) > shown:
            lines.append(f"... and {len(violations) - shown} more")
        super().__init__(f"{len(violations)} stream protocol violation(s):\n" + "\n".join(lines))


def _name(stream: Any) -> str:
    return str(getattr(stream, "name", stream))


def _join(into: Clock, other: Clock) -> None:
    for stream, position in other.items():
        if into.get(stream, 0) < position:
            into[stream] = position


@dataclass
class ProtocolSummary:
    """What a recording exercised, so a clean check can be told from a vacuous one.

    Attributes:
        ops: kernels per stream name.
        cross_stream_accesses: kernel accesses to memory last written on another stream.
        waits: ``wait_stream`` and event waits.
        record_streams: ``record_stream`` calls.
        handed_over_frees: frees of memory allocated on one stream and used on another.
    """

    ops: Dict[str, int]
    cross_stream_accesses: int
    waits: int
    record_streams: int
    handed_over_frees: int


@dataclass(frozen=True)
class _Access:
    position: int
    record: OpRecord


@dataclass(frozen=True)
class _PendingReuse:
    """A freed storage whose memory the allocating stream may hand out again."""

    storage: int
    user: Any
    use: _Access
    allocated_by: OpRecord
    freed: Where


class _Replay:
    """Replays the records in issue order, with one vector clock per stream.

    ``clock[S][T] = p``: the work issued to T up to its p-th kernel runs
    before anything issued to S from now on.
    """

    def __init__(self, recorder: Recording, rules: str, span_streams: bool) -> None:
        self._recorder = recorder
        self._rules = rules
        self._span_streams = span_streams
        self.violations: List[Violation] = []
        self._reported: Set[Tuple[Any, ...]] = set()
        self._count: DefaultDict[Any, int] = defaultdict(int)
        self._clocks: Dict[Any, Clock] = {}
        self._host: Clock = {}
        self._events: Dict[EventLike, Tuple[Clock, RecordEventRecord]] = {}
        self._first_record: Dict[EventLike, RecordEventRecord] = {}
        self._last_write: Dict[int, Tuple[Any, _Access]] = {}
        self._reads: DefaultDict[int, Dict[Any, _Access]] = defaultdict(dict)
        self._alloc: Dict[int, Tuple[Any, OpRecord]] = {}
        self._uses: DefaultDict[int, Dict[Any, _Access]] = defaultdict(dict)
        self._record_streams: DefaultDict[int, Set[Any]] = defaultdict(set)
        self._pending: DefaultDict[Any, List[_PendingReuse]] = defaultdict(list)
        self.summary = ProtocolSummary({}, 0, 0, 0, 0)
        # (d): a verb's kernels on a side stream not its own, checked when the verb ends.
        self._off_stream: Dict[Span, List[_Access]] = {}
        # The streams some verb is recorded on, but for the default stream.
        self._side_streams: Set[Any] = set()
        for record in recorder.records:
            if isinstance(record, RecordEventRecord):
                self._first_record.setdefault(record.event, record)
            elif isinstance(record, SpanRecord) and record.span.stream is not None:
                if record.span.role != "default":
                    self._side_streams.add(record.span.stream)

    # ------------------------------------------------------------ helpers

    def _report(self, rule: str, key: Tuple[Any, ...], message: str) -> None:
        if rule in self._rules and (rule, key) not in self._reported:
            self._reported.add((rule, key))
            self.violations.append(Violation(rule, message))

    def _clock(self, stream: Any) -> Clock:
        clock = self._clocks.setdefault(stream, {})
        _join(clock, self._host)
        clock[stream] = self._count[stream]
        return clock

    def _tensor(self, storage: int) -> str:
        info = self._recorder.tensors.get(storage)
        return str(info) if info is not None else f"storage #{storage}"

    # ------------------------------------------------------------- replay

    def run(self) -> List[Violation]:
        for record in self._recorder.records:
            if isinstance(record, OpRecord):
                self._op(record)
            elif isinstance(record, WaitStreamRecord):
                self.summary.waits += 1
                _join(self._clock(record.stream), self._clock(record.producer))
            elif isinstance(record, RecordEventRecord):
                self._events[record.event] = (dict(self._clock(record.stream)), record)
            elif isinstance(record, WaitEventRecord):
                self._wait_event(record)
            elif isinstance(record, RecordStreamRecord):
                self.summary.record_streams += 1
                self._record_streams[record.storage].add(record.stream)
            elif isinstance(record, FreeRecord):
                self._free(record)
            elif isinstance(record, SyncRecord):
                self._sync(record)
            elif isinstance(record, SpanRecord) and not record.enter:
                self._span_ends(record.span)
        for span in list(self._off_stream):  # verbs still open when the recording ended
            self._span_ends(span)
        return self.violations

    def _op(self, op: OpRecord) -> None:
        stream = op.stream
        clock = self._clock(stream)
        # (b): the first kernel on the allocating stream after a free may reuse the block.
        for pending in self._pending.pop(stream, []):
            if clock.get(pending.user, 0) < pending.use.position:
                self._report_reuse(pending, op)
        accessed = list(dict.fromkeys(op.reads + op.writes))
        ops = self.summary.ops
        ops[_name(stream)] = ops.get(_name(stream), 0) + 1
        for storage in accessed:
            written = self._last_write.get(storage)
            if written is not None:
                writer, access = written
                if writer is not stream:
                    self.summary.cross_stream_accesses += 1
                    if clock.get(writer, 0) < access.position:
                        self._report_unordered_read(storage, writer, access, op)
        for storage in op.writes:
            for reader, access in self._reads.get(storage, {}).items():
                if reader is not stream and clock.get(reader, 0) < access.position:
                    self._report_unordered_write(storage, reader, access, op)
        position = self._count[stream] + 1
        self._count[stream] = position
        clock[stream] = position
        here = _Access(position, op)
        if self._span_streams:
            self._check_span_stream(here)
        for storage in op.reads:
            self._reads[storage][stream] = here
        for storage in op.writes + op.allocs:
            self._last_write[storage] = (stream, here)
            # Later accesses are ordered against this write, which came after those reads.
            self._reads[storage] = {stream: here} if storage in op.reads else {}
        for storage in op.allocs:
            self._alloc[storage] = (stream, op)
        for storage in accessed:
            allocated = self._alloc.get(storage)
            if allocated is not None and allocated[0] is not stream:
                self._uses[storage][stream] = here

    def _wait_event(self, wait: WaitEventRecord) -> None:
        self.summary.waits += 1
        recorded = self._events.get(wait.event)
        if recorded is None:
            first = self._first_record.get(wait.event)
            when = (
                f"is first recorded only later, on stream '{_name(first.stream)}' at {first.where}"
                if first is not None
                else "is never recorded"
            )
            self._report(
                "c",
                (wait.event, wait.where.index),
                f"wait on an unrecorded event: stream '{_name(wait.stream)}' waits on event "
                f"#{wait.event.number} at {wait.where}, but the event {when}; on a GPU that "
                "wait returns at once and orders nothing.",
            )
            return
        _join(self._clock(wait.stream), recorded[0])

    def _free(self, free: FreeRecord) -> None:
        storage = free.storage
        allocated = self._alloc.pop(storage, None)
        if allocated is not None:
            owner, allocated_by = allocated
            if self._uses.get(storage):
                self.summary.handed_over_frees += 1
            recorded = self._record_streams.get(storage, set())
            for user, use in self._uses.get(storage, {}).items():
                if user not in recorded:
                    self._pending[owner].append(
                        _PendingReuse(storage, user, use, allocated_by, free.where)
                    )
        for table in (self._uses, self._record_streams, self._reads):
            table.pop(storage, None)
        self._last_write.pop(storage, None)

    def _sync(self, sync: SyncRecord) -> None:
        if sync.stream is not None:
            _join(self._host, self._clock(sync.stream))
        elif sync.event is not None:
            recorded = self._events.get(sync.event)
            if recorded is not None:
                _join(self._host, recorded[0])
        else:
            for stream in list(self._count):
                _join(self._host, self._clock(stream))

    # ----------------------------------------------------------- messages

    def _report_unordered_read(
        self, storage: int, writer: Any, write: _Access, op: OpRecord
    ) -> None:
        reader = op.stream
        self._report(
            "a",
            (storage, write.record.where.index, reader),
            f"cross-stream read without a wait: {self._tensor(storage)}, produced by "
            f"{write.record.op} on stream '{_name(writer)}' at {write.record.where}, is "
            f"{'read' if storage in op.reads else 'overwritten'} by {op.op} on stream "
            f"'{_name(reader)}' at {op.where}; '{_name(reader)}' has not waited for that work "
            f"(no wait_stream('{_name(writer)}') and no wait of an event recorded on "
            f"'{_name(writer)}' after it, directly or through another stream).",
        )

    def _report_unordered_write(
        self, storage: int, reader: Any, read: _Access, op: OpRecord
    ) -> None:
        writer = op.stream
        self._report(
            "a",
            (storage, read.record.where.index, writer, "write"),
            f"cross-stream write without a wait: {self._tensor(storage)}, read by "
            f"{read.record.op} on stream '{_name(reader)}' at {read.record.where}, is "
            f"overwritten by {op.op} on stream '{_name(writer)}' at {op.where}, before "
            f"'{_name(writer)}' waited for that read.",
        )

    def _report_reuse(self, pending: _PendingReuse, op: OpRecord) -> None:
        owner, user = op.stream, pending.user
        self._report(
            "b",
            (pending.storage, user),
            f"missing record_stream: {self._tensor(pending.storage)}, allocated on stream "
            f"'{_name(owner)}' by {pending.allocated_by.op} at {pending.allocated_by.where}, "
            f"was used on stream '{_name(user)}' (last by {pending.use.record.op} at "
            f"{pending.use.record.where}) and freed before {pending.freed}, without "
            f"record_stream('{_name(user)}'); stream '{_name(owner)}' then issued {op.op} "
            f"at {op.where} without having waited for that use, so the caching allocator "
            f"may give the memory to new work on '{_name(owner)}' while '{_name(user)}' "
            "still reads it.",
        )

    def _check_span_stream(self, here: _Access) -> None:
        op = here.record
        span = op.where.span
        if span is None or span.stream is None or span.stream is op.stream:
            return
        if not (op.reads or op.writes or op.allocs):
            return  # touches no memory
        if op.stream in self._side_streams:
            # Fine if the verb's stream has waited for it by the time the verb ends.
            self._off_stream.setdefault(span, []).append(here)
            return
        self._report_span_stream(span, op, "")

    def _span_ends(self, span: Span) -> None:
        pending = self._off_stream.pop(span, [])
        if not pending:
            return
        clock = self._clock(span.stream)
        for access in pending:
            op = access.record
            if clock.get(op.stream, 0) < access.position:
                self._report_span_stream(
                    span,
                    op,
                    f", and stream '{span.role}' had not waited for that work when the step "
                    f"ended (no wait_stream('{_name(op.stream)}') and no wait of an event "
                    "recorded after it)",
                )

    def _report_span_stream(self, span: Span, op: OpRecord, unjoined: str) -> None:
        self._report(
            "d",
            (span, op.stream),
            f"work on the wrong stream: {span} is recorded on stream '{span.role}', but "
            f"its {op.op} ran on stream '{_name(op.stream)}' (at {op.where}){unjoined}.",
        )


# ------------------------------------------------------------- schedule

_ACTION = re.compile(r"^P(\d+) (\S+)\[(?:i(\d+)|--)\]@(\S+)$")

# (call, task, batch)
_Step = Tuple[int, str, Optional[int]]


def _parse(action: Any) -> Tuple[str, _Step]:
    """``(role, (call, task, batch))`` of an action string, recorder action or span."""
    if isinstance(action, str):
        match = _ACTION.match(action.strip())
        if match is None:
            raise ValueError(
                f"cannot read the action {action!r}; write it as the recorder prints "
                "it, e.g. 'P0 H2D[i0]@memcpy'"
            )
        call, task, batch, role = match.groups()
        return role, (int(call), task, None if batch is None else int(batch))
    role = getattr(action, "stream", None)
    role = getattr(action, "role", role) if not isinstance(role, str) else role
    return str(role), (action.call, action.task, action.batch)


def schedule_by_stream(actions: Iterable[Any]) -> Dict[str, List[_Step]]:
    """Each stream role's ``(call, task, batch)`` sequence, in order."""
    by_role: Dict[str, List[_Step]] = defaultdict(list)
    for action in actions:
        role, step = _parse(action)
        by_role[role].append(step)
    return dict(by_role)


def _show(step: _Step) -> str:
    call, task, batch = step
    return f"{task}[{'--' if batch is None else f'i{batch}'}] (in progress call {call})"


def check_schedule(actual: Sequence[Any], expected: Sequence[Any]) -> List[Violation]:
    """Rule (d): per stream role, the recorded (task, batch) order is the expected one."""
    got, want = schedule_by_stream(actual), schedule_by_stream(expected)
    violations = []
    for role in sorted(set(got) | set(want)):
        ran, planned = got.get(role, []), want.get(role, [])
        ran_order = [(task, batch) for _, task, batch in ran]
        planned_order = [(task, batch) for _, task, batch in planned]
        if ran_order == planned_order:
            continue
        k = next(
            (i for i, (a, b) in enumerate(zip(ran_order, planned_order, strict=False)) if a != b),
            min(len(ran_order), len(planned_order)),
        )
        saw = _show(ran[k]) if k < len(ran) else "nothing more"
        wanted = _show(planned[k]) if k < len(planned) else "nothing more"
        violations.append(
            Violation(
                "d",
                f"schedule of stream '{role}': its task #{k} is {saw}, the schedule has "
                f"{wanted} ({len(ran)} task(s) recorded on it, {len(planned)} expected).",
            )
        )
    return violations


# ---------------------------------------------------------------- entry


def check_stream_protocol(
    recorder: Recording,
    schedule: Optional[Sequence[Any]] = None,
    *,
    rules: str = RULES,
    span_streams: bool = True,
) -> List[Violation]:
    """Every violation of rules (a)-(d) in ``recorder``'s records, in the order found.

    ``schedule`` is the variant's exact recorded sequence for rule (d) (left
    out: only the "work runs on its verb's stream" part of (d) is checked).
    ``rules`` selects rules by letter; ``span_streams=False`` skips that part.
    """
    unknown = set(rules) - set(RULES)
    if unknown:
        raise ValueError(f"rules are letters of {RULES!r}, got {rules!r}")
    violations = _Replay(recorder, rules, span_streams and "d" in rules).run()
    if schedule is not None and "d" in rules:
        violations += check_schedule(recorder.spans, schedule)
    return violations


def summarize(recorder: Recording) -> ProtocolSummary:
    """How much cross-stream traffic the recording holds (see :class:`ProtocolSummary`)."""
    replay = _Replay(recorder, RULES, span_streams=False)
    replay.run()
    return replay.summary


def assert_stream_protocol(
    recorder: Recording, schedule: Optional[Sequence[Any]] = None, **options: Any
) -> None:
    """Raise :class:`StreamProtocolError` when :func:`check_stream_protocol` finds anything."""
    violations = check_stream_protocol(recorder, schedule, **options)
    if violations:
        raise StreamProtocolError(violations)


__all__ = [
    "ProtocolSummary",
    "RULES",
    "StreamProtocolError",
    "Violation",
    "assert_stream_protocol",
    "check_schedule",
    "check_stream_protocol",
    "schedule_by_stream",
    "summarize",
]
