"""What a training step can't beat, and how much of the input dist a pipeline hid.

Pure arithmetic over what the runner measured (no torch, no process group), so
it is tested with made-up numbers.  Two inputs:

* the stage probe's epochs (``benchmarks.contenders.stage_probe.StageProbe``): per stage,
  each run alone, wall seconds, CPU seconds, and the bytes it put on an
  emulated link;
* a recorded epoch per variant of ours (:func:`benchmarks.running.recording.recorded_epoch`):
  the schedule recorder's actions plus, on the training thread, the time spent
  inside torchrec's input dist (issuing it, waiting for it) and the moment each
  all-to-all was issued.

[Note: the bound model]

Per step, a rank has two resources: its cores (all compute, and the CPU work
of communication) and, with ``--link-gbit``, one emulated link that every
collective crosses (the input dist's splits and tensors all-to-alls, the
embeddings' output all-to-all forward and backward, DDP's gradient
all-reduce; both directions share it).  A step can't be shorter than any of:

* ``fwd+bwd+opt``: the probe's forward + backward + optimizer of one batch.
  Each part needs the one before (lookup, output all-to-all, dense forward
  and backward, gradient all-to-all, embedding update, step), so it is one
  chain, its own collectives included.  (SemiSync breaks this chain on
  purpose: it trains on embeddings one step old.)
* ``training thread``: that chain plus the input dist's CPU work on the
  training thread (building and issuing it), which the same thread can't do
  while it runs the chain.
* ``cores (measured CPU)``: the CPU seconds of every rank in all three
  stages, divided by the cores the ranks share ([Note: the measured CPU]).
* ``link`` (emulated link only): the bytes of every collective of a step
  (read from the namespace's loopback counter during the probe) at the link
  rate, per stage no more than the stage's own time.
* ``input dist`` and ``H2D``: one of each per step, each a chain of its own.

That is the bound for any schedule (the old "SparseDist bound" was the
``fwd+bwd+opt``, ``input dist`` and ``H2D`` terms alone).  A variant's
schedule adds what it makes serial, read from its recorded epoch:

* ``input dist on the chain``: ``input dist + fwd+bwd+opt``, for a schedule
  that runs a batch's input dist in the step that trains it, before the
  forward that needs it (Base, Lite): only the copy overlaps it.
* ``link order`` (emulated link only):
  ``fwd+bwd+opt + max(0, input-dist link time - gap)``.  On one process
  group gloo sends collectives over one connection per rank pair in the
  order they were issued, so the link is a FIFO: an input dist issued
  ``gap`` ms before the step's next collective delays that collective, and
  with it the chain, by whatever of its link time is left.  ``gap`` is
  measured on the recorded epoch: from the input dist's largest all-to-all
  (the ids) to the next all-to-all the training thread issues that is not
  input dist; the median over steady steps, the largest over ranks.  It
  assumes the link was idle when the input dist was issued (a busy link
  only delays it more) and ignores DDP's all-reduce, which the recording
  can't see (issued from C++).
* ``link share`` (emulated link, the input dist on a dedicated process group,
  ``input_dist_group="dedicated"``), instead of ``link order``:
  ``fwd+bwd+opt + min(fwd+bwd+opt link time, max(0, input-dist link time - gap))``.
  The step's own collectives no longer queue behind the ids (two groups,
  two sets of connections), but they share the link's rate with them while
  both are on it (the namespace's link serves flows in turn: [Note: the
  link's queue] in ``benchmarks/settings/netns.py``): each gets half, so the chain's
  collectives take longer by the overlap, at most their own link time.

[Note: the measured CPU]

The cores term is the CPU the ranks were charged while the probe ran a
step's stages, not the sum of the operations' times: every thread of every
rank process (the training thread, gloo's and autograd's workers), user and
kernel time (``time.process_time``, the kernel's per-thread runtime summed
over the process), per step, added over ranks, over the cores they share.
It includes what communication costs on the CPU: gloo's threads, the
sockets' system calls, and the TCP work the kernel does for the link while
a rank's thread is on the core (a packet's send, and on the loopback often
its receive too, run in the sender's system call).  Over an emulated link
that is well above what the probe's operations on the cores add up to (the
training thread's lookup, dense work, update and optimizer step, which the
dependency bound's own cores term sums): the gap is communication's CPU.

What it does not count: kernel work for the link that runs while no rank
thread is on a core.  The emulated link's rate limit releases packets from
a timer, and the softirq that then moves them through the loopback and
TCP's receive path runs on whichever core the timer fires, charged to
whatever task is current there: often the idle task or ``ksoftirqd``, a
rank only when one of its threads was running.  (That is on a kernel
without ``CONFIG_IRQ_TIME_ACCOUNTING``, as the bench's machine: with it,
interrupt work is charged to no task, and the term counts a rank's threads'
own work alone.)  The machine-wide counters (``/proc/stat``'s softirq column) see
it, but they also see every other process's interrupts and are sampled per
tick (10 ms), so counting them could lift the floor above what the ranks
need.  The floor stays a lower bound by leaving that work out: it counts
what the ranks' processes were charged, no more.  The dependency bound
(:mod:`benchmarks.measuring.dependency_bound`) takes the same term.

Over the plain loopback (no ``--link-gbit``) there is no link term and no
link-order term: the loopback is taken to move bytes at memory speed, so
communication only costs the CPU time gloo and the kernel spend on it, which
the cores and ``training thread`` terms already count.

[Note: the hidden fraction]

``hidden = 1 - exposed / standalone``, clipped to [0, 1]: ``standalone`` is
the probe's input dist per step; ``exposed`` is, per steady step of the
recorded epoch, the training thread's time in input-dist work, the union of
our InputDistStart/InputDistWait verbs and its time inside torchrec's
``input_dist`` and the input dist's awaitables (the tensors wait a forward
does included).  Averaged over the steady steps (every ``progress()`` call
after the first that issues an input dist) and over ranks.  The issuing CPU
work counts as exposed, so even a perfect pipeline stays a little under 1.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

# Our verbs that are input-dist work on the training thread.
INPUT_DIST_TASKS = frozenset({"InputDistStart", "InputDistWait"})

# Names of the bound's terms, in print order.
FWD_BWD_OPT = "fwd+bwd+opt"
TRAINING_THREAD = "training thread"
# The ranks' measured CPU per core (see [Note: the measured CPU]); the dependency
# bound names its term the same way.
CORES = "cores (measured CPU)"
LINK = "link"
INPUT_DIST = "input dist"
H2D = "H2D"
LINK_ORDER = "link order"
ON_CHAIN = "input dist on the chain"
LINK_SHARE = "link share"
TERM_ORDER = (
    ON_CHAIN,
    LINK_ORDER,
    LINK_SHARE,
    FWD_BWD_OPT,
    TRAINING_THREAD,
    LINK,
    CORES,
    INPUT_DIST,
    H2D,
)

Interval = Tuple[float, float]


# --------------------------------------------------------------------------
# The probe's costs and the bound
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCosts:
    """Per-step costs from the stage probe, ms, the median over its epochs.

    ``thread_input_dist_ms`` and ``cpu_ms`` are None for results recorded
    before the probe measured CPU time; the ``link_*`` fields are None
    unless the link was emulated.
    """

    h2d_ms: float
    input_dist_ms: float
    compute_ms: float
    thread_input_dist_ms: Optional[float] = None
    cpu_ms: Optional[float] = None  # every rank, every stage
    cores: Optional[int] = None
    link_input_dist_ms: Optional[float] = None
    link_compute_ms: Optional[float] = None
    # Bytes per step on the emulated link (every rank): the input dist's, and
    # the model's own collectives' (output all-to-alls, gradient all-reduce).
    link_input_dist_bytes: Optional[float] = None
    link_compute_bytes: Optional[float] = None

    @property
    def cpu_per_core_ms(self) -> Optional[float]:
        """The ranks' measured CPU per core per step, ms: ``cpu_ms / cores``
        ([Note: the measured CPU]); None when either is unknown."""
        if self.cpu_ms is None or not self.cores:
            return None
        return self.cpu_ms / self.cores

    def stage_ms(self) -> Dict[str, float]:
        """The three stage times, as the old bound printed them."""
        return {"h2d": self.h2d_ms, "input_dist": self.input_dist_ms, "compute": self.compute_ms}


def _median_ms(stages: Sequence[Mapping[str, float]], key: str, steps: int) -> Optional[float]:
    if not stages or any(key not in s for s in stages):
        return None
    return statistics.median(1e3 * s[key] / steps for s in stages)


def step_costs(
    stages: Sequence[Mapping[str, float]],
    steps: int,
    cores: Optional[int],
    link_gbit: Optional[float],
) -> Optional[StepCosts]:
    """:class:`StepCosts` from a block's probe epochs (``combine_stage_times`` records).

    ``link_gbit`` is the rate of the emulated link, None when none was emulated.
    """
    h2d, input_dist, compute = (
        _median_ms(stages, k, steps) for k in ("h2d", "input_dist", "compute")
    )
    if h2d is None or input_dist is None or compute is None:
        return None
    cpu_parts = [_median_ms(stages, k, steps) for k in ("cpu_h2d", "cpu_input_dist", "cpu_compute")]
    cpu = None if None in cpu_parts else sum(p for p in cpu_parts if p is not None)

    def link_ms(key: str, stage_ms: float) -> Optional[float]:
        per_step = _median_ms(stages, key, steps)  # 1e3 * bytes per step
        if per_step is None or not link_gbit:
            return None
        at_rate = per_step * 8 / (link_gbit * 1e9)  # (1e3 * bytes) * bits/byte / (bits/s) = ms
        # A stage can't hold the link longer than it lasts (tbf lets a few
        # percent more than its rate through: its bucket, its rounding).
        return min(at_rate, stage_ms)

    def link_bytes(key: str) -> Optional[float]:
        per_step = _median_ms(stages, key, steps)
        return None if per_step is None or not link_gbit else per_step / 1e3

    return StepCosts(
        h2d_ms=h2d,
        input_dist_ms=input_dist,
        compute_ms=compute,
        thread_input_dist_ms=_median_ms(stages, "thread_input_dist", steps),
        cpu_ms=cpu,
        cores=cores,
        link_input_dist_ms=link_ms("link_bytes_input_dist", input_dist),
        link_compute_ms=link_ms("link_bytes_compute", compute),
        link_input_dist_bytes=link_bytes("link_bytes_input_dist"),
        link_compute_bytes=link_bytes("link_bytes_compute"),
    )


@dataclass(frozen=True)
class Bound:
    """Lower limits on a step's time (ms, by term); the step can't beat the largest."""

    terms: Dict[str, float]

    @property
    def step_ms(self) -> float:
        return max(self.terms.values())

    @property
    def binding(self) -> str:
        """The term that sets the bound."""
        return max(self.terms, key=lambda name: self.terms[name])

    def qps(self, examples_per_step: float) -> Optional[float]:
        """Examples/s at the bound (None when every term is 0)."""
        return examples_per_step * 1e3 / self.step_ms if self.step_ms > 0 else None

    def reached(self, step_ms: Optional[float]) -> Optional[float]:
        """How much of this floor a measured step reaches: ``floor / step``.

        1 is a step at the floor, 0.5 one twice as long; above 1 would be a
        step faster than the floor (a bound broken: a term measured too high).
        None without a step (or for a step of 0 ms).
        """
        if step_ms is None or step_ms <= 0:
            return None
        return self.step_ms / step_ms


def timed_cpu_per_core_ms(
    cpu_seconds: Sequence[float], steps: int, cores: Optional[int]
) -> Optional[float]:
    """The ranks' CPU per core per step, ms, from a contender's timed epochs: the median
    over epochs of the CPU seconds every rank was charged (added over ranks), per step,
    over the cores the ranks share (None without epochs, steps or cores)."""
    if not cpu_seconds or steps <= 0 or not cores:
        return None
    return statistics.median(1e3 * c / steps / cores for c in cpu_seconds)


def ms_per_step(qps: Optional[float], examples_per_step: float) -> Optional[float]:
    """A step's time, ms, from examples/s (None without a rate)."""
    return examples_per_step * 1e3 / qps if qps else None


def any_schedule_bound(costs: StepCosts) -> Bound:
    """The terms every schedule obeys (see [Note: the bound model])."""
    terms = {FWD_BWD_OPT: costs.compute_ms, INPUT_DIST: costs.input_dist_ms, H2D: costs.h2d_ms}
    if costs.thread_input_dist_ms is not None:
        terms[TRAINING_THREAD] = costs.compute_ms + costs.thread_input_dist_ms
    if costs.cpu_per_core_ms is not None:
        terms[CORES] = costs.cpu_per_core_ms
    if costs.link_input_dist_ms is not None and costs.link_compute_ms is not None:
        terms[LINK] = costs.link_input_dist_ms + costs.link_compute_ms
    return Bound({name: terms[name] for name in TERM_ORDER if name in terms})


def schedule_bound(
    costs: StepCosts, gap_ms: Optional[float], on_chain: bool = False, dedicated: bool = False
) -> Bound:
    """:func:`any_schedule_bound` plus what a schedule makes serial.

    ``on_chain``: it runs a batch's input dist in the step that trains that
    batch, before the forward that needs it (Base, Lite), so a step is at
    least input dist + fwd+bwd+opt.  ``gap_ms``: it issues the input dist
    that long before the step's next collective (only with an emulated
    link): on the model's group the link-order term, on a ``dedicated``
    group the link-share term.
    """
    terms = dict(any_schedule_bound(costs).terms)
    if on_chain:
        terms[ON_CHAIN] = costs.input_dist_ms + costs.compute_ms
    if gap_ms is not None and costs.link_input_dist_ms is not None:
        left = max(0.0, costs.link_input_dist_ms - gap_ms)  # ids still on the link
        if not dedicated:
            terms[LINK_ORDER] = costs.compute_ms + left
        elif costs.link_compute_ms is not None:
            terms[LINK_SHARE] = costs.compute_ms + min(costs.link_compute_ms, left)
    return Bound({name: terms[name] for name in TERM_ORDER if name in terms})


def hidden_fraction(exposed_ms: Optional[float], standalone_ms: Optional[float]) -> Optional[float]:
    """``1 - exposed / standalone`` clipped to [0, 1] (see [Note: the hidden fraction])."""
    if exposed_ms is None or not standalone_ms or standalone_ms <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - exposed_ms / standalone_ms))


# --------------------------------------------------------------------------
# A recorded epoch
# --------------------------------------------------------------------------
#
# One rank's recorded epoch, as the runner stores it (seconds from the first
# progress() call; plain JSON types):
#
#     {"call_starts": [s, ...],
#      "actions": [[call, task, batch, thread, start, end], ...],
#      "input_dist": [["issue"|"wait", start, end], ...],  # training thread, inside torchrec
#      "all_to_alls": [[time, bytes], ...]}                  # issued on the training thread


def _merged(intervals: Sequence[Interval]) -> List[Interval]:
    out: List[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _covered(merged: Sequence[Interval], lo: float, hi: float) -> float:
    """Length of ``merged`` (disjoint, sorted) inside ``[lo, hi)``."""
    return sum(max(0.0, min(end, hi) - max(start, lo)) for start, end in merged)


def _inside(merged: Sequence[Interval], t: float) -> bool:
    return any(start <= t <= end for start, end in merged)


def input_dist_time(epoch: Mapping[str, Any]) -> List[Interval]:
    """The training thread's input-dist intervals, merged: our input-dist verbs
    and its time inside torchrec's input dist."""
    spans = [
        (a[4], a[5])
        for a in epoch.get("actions", ())
        if a[1] in INPUT_DIST_TASKS and a[3] == "main"
    ]
    spans += [(start, end) for _, start, end in epoch.get("input_dist", ())]
    return _merged(spans)


def call_windows(epoch: Mapping[str, Any]) -> List[Tuple[int, float, float]]:
    """``(call, start, end)`` per ``progress()`` call; a call ends where the next starts."""
    starts = list(epoch.get("call_starts", ()))
    if not starts:
        return []
    ends = [a[5] for a in epoch.get("actions", ())] + [
        end for _, _, end in epoch.get("input_dist", ())
    ]
    last = max(ends + [starts[-1]])
    return [(k, s, starts[k + 1] if k + 1 < len(starts) else last) for k, s in enumerate(starts)]


def steady_calls(epoch: Mapping[str, Any]) -> List[Tuple[int, float, float]]:
    """The calls after the first (the fill) that issue an input dist.

    Each of them does one batch's worth of input-dist work (issue one, wait
    for one), wherever the schedule puts the two; the drain calls issue none.
    """
    issues = [start for kind, start, _ in epoch.get("input_dist", ()) if kind == "issue"]
    issues += [
        a[4] for a in epoch.get("actions", ()) if a[1] == "InputDistStart" and a[3] == "main"
    ]
    return [
        (k, lo, hi)
        for k, lo, hi in call_windows(epoch)
        if k >= 1 and any(lo <= t < hi for t in issues)
    ]


def exposed_input_dist_ms(epoch: Mapping[str, Any]) -> Optional[float]:
    """Mean training-thread input-dist time per steady call, ms (None: no steady call)."""
    steady = steady_calls(epoch)
    if not steady:
        return None
    merged = input_dist_time(epoch)
    return 1e3 * statistics.mean(_covered(merged, lo, hi) for _, lo, hi in steady)


def issue_gap_ms(epoch: Mapping[str, Any]) -> Optional[float]:
    """Median over steady calls of the time from the input dist's largest
    all-to-all to the next all-to-all of the training thread that is not
    input dist, ms (None when no steady call has both)."""
    merged = input_dist_time(epoch)
    sends = sorted((t, nbytes, _inside(merged, t)) for t, nbytes in epoch.get("all_to_alls", ()))
    gaps: List[float] = []
    for _, lo, hi in steady_calls(epoch):
        ours = [(nbytes, t) for t, nbytes, is_input_dist in sends if is_input_dist and lo <= t < hi]
        if not ours:
            continue
        issued = max(ours)[1]
        later = [t for t, _, is_input_dist in sends if not is_input_dist and t > issued]
        if later:
            gaps.append(1e3 * (later[0] - issued))
    return statistics.median(gaps) if gaps else None


def _enclosing_batch(actions: Sequence[Sequence[Any]], t: float) -> Optional[int]:
    """The batch of the shortest training-thread action running at ``t``."""
    around = [a for a in actions if a[3] == "main" and a[4] <= t <= a[5]]
    return min(around, key=lambda a: a[5] - a[4])[2] if around else None


def input_dist_on_chain(epoch: Mapping[str, Any]) -> Optional[bool]:
    """Whether the steady calls issue the input dist of the batch they train.

    The batch an input dist is issued for is that of the verb it is issued
    in (InputDistStart, or the Forward of a schedule that leaves it to the
    module); the batch a call trains is its Forward's.  None when no steady
    call shows both; otherwise what most steady calls do.
    """
    actions = epoch.get("actions", ())
    votes: List[bool] = []
    for k, lo, hi in steady_calls(epoch):
        trained = [a[2] for a in actions if a[0] == k and a[1] == "Forward" and a[3] == "main"]
        issued = [
            a[2] for a in actions if a[1] == "InputDistStart" and a[3] == "main" and lo <= a[4] < hi
        ]
        issued += [
            _enclosing_batch(actions, start)
            for kind, start, _ in epoch.get("input_dist", ())
            if kind == "issue" and lo <= start < hi
        ]
        issued = [b for b in issued if b is not None]
        if trained and issued:
            votes.append(trained[0] in issued)
    return None if not votes else 2 * sum(votes) > len(votes)


@dataclass(frozen=True)
class ScheduleFacts:
    """What a variant's recorded epochs (one per rank) say about its schedule."""

    exposed_ms: Optional[float]  # mean over ranks
    gap_ms: Optional[float]  # largest over ranks (the weaker link-order term)
    on_chain: bool  # every rank that could tell runs the input dist on the chain
    exposed_ms_per_rank: List[Optional[float]]
    gap_ms_per_rank: List[Optional[float]]


def schedule_facts(ranks: Sequence[Mapping[str, Any]]) -> ScheduleFacts:
    """:func:`exposed_input_dist_ms`, :func:`issue_gap_ms` and
    :func:`input_dist_on_chain` of every rank, combined."""
    exposed = [exposed_input_dist_ms(r) for r in ranks]
    gaps = [issue_gap_ms(r) for r in ranks]
    chains = [c for c in (input_dist_on_chain(r) for r in ranks) if c is not None]
    known_exposed = [e for e in exposed if e is not None]
    known_gaps = [g for g in gaps if g is not None]
    return ScheduleFacts(
        exposed_ms=statistics.mean(known_exposed) if known_exposed else None,
        gap_ms=max(known_gaps) if known_gaps else None,
        on_chain=bool(chains) and all(chains),
        exposed_ms_per_rank=exposed,
        gap_ms_per_rank=gaps,
    )


__all__ = [
    "Bound",
    "ScheduleFacts",
    "StepCosts",
    "any_schedule_bound",
    "timed_cpu_per_core_ms",
    "exposed_input_dist_ms",
    "hidden_fraction",
    "input_dist_on_chain",
    "ms_per_step",
    "issue_gap_ms",
    "schedule_bound",
    "schedule_facts",
    "step_costs",
]
