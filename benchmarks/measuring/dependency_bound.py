"""What a training step can't beat once batches may overlap: the dependency bound, per semantics.

Pure arithmetic over per-operation times (no torch, no process group), so it
is tested with made-up numbers.  The any-schedule bound of
:mod:`benchmarks.measuring.schedule_bound` takes a batch's forward, backward
and optimizer step as one chain no schedule breaks; within a batch that holds,
across batches it does not: batch *i+1*'s lookup may run while batch *i*'s
dense work does, as long as the tables it reads are the ones its semantics
asks for.  This module bounds the step of every schedule with given
semantics from the dependencies between operations alone.

[Note: the dependency bound]

A training step is ten operations, each on one resource (``RESOURCE``):
H2D (the copy), the input dist (link), the embedding lookup (cores), the
output all-to-all forward (link), the dense forward (cores: bottom MLP,
interaction, over-arch), the dense backward (cores), the gradient all-to-all
(link: the output dist's backward), the embedding update (cores: the
lookup's backward with the fused optimizer), DDP's gradient all-reduce (link)
and the optimizer step (cores).

Dependencies are edges ``u -> v`` of a distance ``d`` and a lag: batch
*i+d*'s ``v`` starts no earlier than ``lag`` after batch *i*'s ``u`` starts
(the lag is ``u``'s time unless said otherwise: ``v`` waits for ``u`` to end).
Within batch *i*: input dist -> lookup -> out a2a -> dense fwd -> dense bwd
-> grad a2a -> emb update, and dense bwd -> all-reduce -> opt.  DDP starts the
all-reduce during the backward: it may start once ``ALLREDUCE_FROM`` of the
dense backward has run (0 by default: with it) and ends no earlier than the
backward does, so that edge's lag is ``max(f * bwd, bwd - all-reduce)``.  The
gradient all-to-all may start once the dense backward has produced the
embeddings' gradient, ``GRAD_FROM`` of the way through it (1 by default: at
its end; the bottom MLP's backward need not come first), so that edge's lag is
``g * bwd``.  Between batches:

* ``sync`` (the plain loop's math: SparseDist, Fused, Base, Staged, ...):
  lookup(i+1) after emb update(i); dense fwd(i+1) after opt(i).
* ``one-step-stale`` (SemiSync's semantics, without gradient
  stashing): lookup(i+1) after emb update(i-1) and before emb update(i) (it
  reads the tables batch *i* has not updated yet); dense fwd(i+1) after
  opt(i).

The input dist and H2D of batch *i+1* depend on nothing of batch *i*.

The bound is the largest of three kinds of term, a simple lower bound on the
steady-state period of every schedule that keeps these dependencies and runs
one operation at a time per resource (not the best such schedule's period,
which can be longer: it also makes the cycles' operations queue for their
resources):

* a resource's load per step: the time its operations hold it (``busy``),
  divided by its capacity (``cores``: what one rank's compute gets of the
  machine's cores; the link and the copy: 1).  Over ``n`` steps a resource
  does ``n`` times its load at that rate, so ``n`` steps take at least
  ``n * load``.  The cores have two such terms: ``cores (operations)``, the
  operations above that run on them, and ``cores (measured CPU)``, the CPU
  every thread of every rank was charged per step over the cores they share
  (the any-schedule bound's term, [Note: the measured CPU] in
  :mod:`benchmarks.measuring.schedule_bound`).  The second counts what the
  first can't see, communication's CPU (gloo's threads, the sockets, the
  kernel's TCP work for the link), and is the honest floor where it is
  measured; the first stays for results without it and to show the gap.
* a dependency cycle's length over its steps: a cycle ``v0 -> ... -> v0``
  whose lags add up to ``L`` and whose distances add up to ``D > 0`` says,
  edge by edge, that ``v0`` of batch *i+D* starts at least ``L`` after
  ``v0`` of batch *i*; chained ``n`` times, batch *i+nD*'s ``v0`` starts at
  least ``n L`` after batch *i*'s, so a step takes at least ``L / D`` on
  average, whatever the schedule.  Every simple cycle of the graph is a
  term (the graph has ten nodes; there are a handful).
* ``sync`` only, the link's window: the cycles let the link carry batch
  *i*'s all-reduce and gradient all-to-all and batch *i+1*'s output
  all-to-all at once, each cycle one of them.  Under sync semantics all three
  fall between the same two points: none can start before batch *i*'s dense
  forward and the first ``min(f, g)`` of its dense backward have run, and all
  must be done when batch *i+1*'s dense forward starts (it needs batch *i*'s
  optimizer step, after the all-reduce, and batch *i+1*'s embeddings, after
  the output all-to-all, whose lookup waits for batch *i*'s update, after the
  gradient all-to-all).  One link carries them one after the other, so
  successive dense forwards start at least ``dense fwd + min(f, g) * dense bwd
  + all-reduce + grad a2a + out a2a`` apart (each collective at the time it
  holds the link).  Under one-step-stale semantics batch *i+1*'s lookup no
  longer waits for batch *i*'s update, its output all-to-all can cross the
  link during batch *i*'s dense work, and there is no such window.

The operation times are measured each alone (the stage probe, one rank's
training thread); operations that overlap in a real schedule share the
machine and only get slower, so the terms stay lower bounds.

Each term only grows with each operation's time (the all-reduce edge's lag
falls as the all-reduce grows, but every cycle through it continues with the
all-reduce itself, so the sum ``max(f * bwd + all-reduce, bwd)`` grows), so
more time on an operation never lowers the bound (nor does it lower the window).

The sync cycles: lookup > out a2a > dense fwd > dense bwd > grad a2a > emb
update (the embeddings' round trip, both all-to-alls on it) and dense fwd >
dense bwd (with the all-reduce) > opt.  The stale ones: the dense one, the
same round trip over two steps, and lookup > emb update (batch *i+1*'s
lookup and batch *i*'s update take turns on the tables).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from benchmarks.measuring.schedule_bound import CORES as CORES_CPU, Bound

# The operations of a step, in a batch's order.
H2D = "h2d"
INPUT_DIST = "input_dist"
LOOKUP = "lookup"
OUT_A2A = "out_a2a"
DENSE_FWD = "dense_fwd"
DENSE_BWD = "dense_bwd"
GRAD_A2A = "grad_a2a"
EMB_UPDATE = "emb_update"
ALLREDUCE = "allreduce"
OPT = "opt"
OPS = (H2D, INPUT_DIST, LOOKUP, OUT_A2A, DENSE_FWD, DENSE_BWD, GRAD_A2A, EMB_UPDATE, ALLREDUCE, OPT)

LABEL = {
    H2D: "H2D",
    INPUT_DIST: "input dist",
    LOOKUP: "lookup",
    OUT_A2A: "out a2a",
    DENSE_FWD: "dense fwd",
    DENSE_BWD: "dense bwd",
    GRAD_A2A: "grad a2a",
    EMB_UPDATE: "emb update",
    ALLREDUCE: "all-reduce",
    OPT: "opt",
}

CORES = "cores"
LINK = "link"
COPY = "H2D"
# The cores' load term from the operations' own times (CORES_CPU is the measured one).
CORES_OPS = "cores (operations)"
RESOURCE = {
    H2D: COPY,
    INPUT_DIST: LINK,
    LOOKUP: CORES,
    OUT_A2A: LINK,
    DENSE_FWD: CORES,
    DENSE_BWD: CORES,
    GRAD_A2A: LINK,
    EMB_UPDATE: CORES,
    ALLREDUCE: LINK,
    OPT: CORES,
}

SYNC = "sync"
STALE = "one-step-stale"
SEMANTICS = (SYNC, STALE)

# Default fraction of the dense backward after which DDP's all-reduce may start.
ALLREDUCE_FROM = 0.0
# Default fraction of the dense backward after which the gradient all-to-all may start.
GRAD_FROM = 1.0

# The sync bound's link-window term (see the Note).
WINDOW = "window dense fwd > dense bwd to the first collective > link: all-reduce + grad a2a + next out a2a"


@dataclass(frozen=True)
class OpTimes:
    """Per-step time of each operation, ms (keys: ``OPS``).

    ``ms`` is how long an operation takes, start to end (what a dependency
    waits for); ``busy_ms``, where given, how long of that it holds its
    resource (a collective's bytes at the link's rate, less than its wall
    time; 0 for the loopback, taken to move bytes at memory speed); where not
    given, all of ``ms``.  ``derived`` names the operations not measured on
    their own, each with how it was derived (for the table's footnote).
    ``allreduce_from``, where measured, is the all-reduce's start as a
    fraction of the dense backward (:func:`dependency_bound` uses it);
    ``grad_from``, where measured, the fraction of the dense backward run when
    the embeddings' gradient is ready for the gradient all-to-all.
    """

    ms: Mapping[str, float]
    busy_ms: Mapping[str, float] = field(default_factory=dict)
    derived: Mapping[str, str] = field(default_factory=dict)
    # Measured: the fraction of the dense backward run before DDP's all-reduce starts.
    allreduce_from: Optional[float] = None
    # Measured: the fraction of the dense backward run when the embeddings' gradient is ready.
    grad_from: Optional[float] = None

    def __post_init__(self) -> None:
        missing = [op for op in OPS if op not in self.ms]
        if missing:
            raise ValueError(f"OpTimes needs a time for every operation; missing {missing}")
        negative = {op: t for op, t in self.ms.items() if t < 0}
        if negative:
            raise ValueError(f"operation times must be >= 0 ms, got {negative}")

    def busy(self, op: str) -> float:
        """How long ``op`` holds its resource: at most its time."""
        return min(self.ms[op], self.busy_ms.get(op, self.ms[op]))

    def load(self, resource: str) -> float:
        """Time per step the resource's operations hold it, ms."""
        return sum(self.busy(op) for op in OPS if RESOURCE[op] == resource)


@dataclass(frozen=True)
class Edge:
    """Batch *i+distance*'s ``dst`` starts no earlier than ``lag`` after batch *i*'s ``src`` starts."""

    src: str
    dst: str
    distance: int
    lag: float


def _edges(
    times: OpTimes, semantics: str, allreduce_from: float, grad_from: float = GRAD_FROM
) -> List[Edge]:
    t = times.ms

    def after(src: str, dst: str, distance: int = 0) -> Edge:
        return Edge(src, dst, distance, t[src])

    bwd, ar = t[DENSE_BWD], t[ALLREDUCE]
    edges = [
        after(H2D, INPUT_DIST),
        after(INPUT_DIST, LOOKUP),
        after(LOOKUP, OUT_A2A),
        after(OUT_A2A, DENSE_FWD),
        after(DENSE_FWD, DENSE_BWD),
        # The embeddings' gradient is ready part of the way through the dense backward.
        Edge(DENSE_BWD, GRAD_A2A, 0, grad_from * bwd),
        after(GRAD_A2A, EMB_UPDATE),
        # Starts after a fraction of the backward, ends no earlier than it.
        Edge(DENSE_BWD, ALLREDUCE, 0, max(allreduce_from * bwd, bwd - ar)),
        after(ALLREDUCE, OPT),
        after(OPT, DENSE_FWD, 1),
    ]
    if semantics == SYNC:
        edges.append(after(EMB_UPDATE, LOOKUP, 1))
    elif semantics == STALE:
        edges.append(after(EMB_UPDATE, LOOKUP, 2))
        edges.append(after(LOOKUP, EMB_UPDATE, -1))  # batch i+1 reads before batch i writes
    else:
        raise ValueError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
    return edges


@dataclass(frozen=True)
class Cycle:
    """A dependency cycle: its operations in order, total lag (ms) and steps spanned."""

    ops: Tuple[str, ...]
    length_ms: float
    steps: int

    @property
    def per_step_ms(self) -> float:
        return self.length_ms / self.steps

    @property
    def name(self) -> str:
        chain = " > ".join(LABEL[op] for op in self.ops)
        return f"cycle {chain}" + (f" (over {self.steps} steps)" if self.steps != 1 else "")


def cycles(edges: Sequence[Edge]) -> List[Cycle]:
    """Every simple cycle of the graph, each once (from its earliest operation in ``OPS``).

    Raises when a cycle spans no step forward (distance <= 0): such
    dependencies ask an operation to wait for itself.
    """
    order = {op: k for k, op in enumerate(OPS)}
    out_edges: Dict[str, List[Edge]] = {}
    for e in edges:
        out_edges.setdefault(e.src, []).append(e)
    found: List[Cycle] = []

    def walk(start: str, path: List[Edge]) -> None:
        at = path[-1].dst if path else start
        for e in out_edges.get(at, ()):
            if e.dst == start:
                found.append(_cycle(start, path + [e]))
            elif order[e.dst] > order[start] and all(p.dst != e.dst for p in path):
                walk(start, path + [e])

    for op in OPS:
        walk(op, [])
    return found


def _cycle(start: str, path: Sequence[Edge]) -> Cycle:
    steps = sum(e.distance for e in path)
    ops = (start,) + tuple(e.dst for e in path[:-1])
    if steps <= 0:
        names = " > ".join(LABEL[op] for op in ops)
        raise ValueError(
            f"the dependency cycle {names} spans {steps} steps: an operation would wait for "
            "itself; every cycle must reach a later batch"
        )
    return Cycle(ops, sum(e.lag for e in path), steps)


@dataclass(frozen=True)
class DependencyBound(Bound):
    """:class:`Bound` under one semantics: a term per resource and per dependency cycle,
    the binding one named by its resource or its cycle's operations."""

    semantics: str = ""


def dependency_bound(
    times: OpTimes,
    semantics: str,
    cores: Optional[float] = 1.0,
    allreduce_from: Optional[float] = None,
    grad_from: Optional[float] = None,
    *,
    cpu_per_core_ms: Optional[float] = None,
) -> DependencyBound:
    """The bound of [Note: the dependency bound] for ``semantics`` (``SYNC`` or ``STALE``).

    ``cores``: the cores' worth one rank's compute gets (the machine's cores
    over the ranks sharing them); None when not known, which leaves the
    operations' cores term out.  ``cpu_per_core_ms``: the ranks' measured
    CPU per core per step (:attr:`StepCosts.cpu_per_core_ms
    <benchmarks.measuring.schedule_bound.StepCosts.cpu_per_core_ms>`), the
    measured cores term; None leaves it out.  ``allreduce_from``: the fraction of the
    dense backward after which DDP's all-reduce may start, in [0, 1]; by
    default the one measured with ``times``, else ``ALLREDUCE_FROM``.
    ``grad_from``: likewise for the gradient all-to-all (``GRAD_FROM``).
    """
    if allreduce_from is None:
        allreduce_from = (
            times.allreduce_from if times.allreduce_from is not None else ALLREDUCE_FROM
        )
    if grad_from is None:
        grad_from = times.grad_from if times.grad_from is not None else GRAD_FROM
    if cores is not None and cores <= 0:
        raise ValueError(f"cores must be > 0 (the cores' worth one rank gets), got {cores}")
    if cpu_per_core_ms is not None and cpu_per_core_ms < 0:
        raise ValueError(
            f"cpu_per_core_ms must be >= 0 (the ranks' CPU ms per core per step), got {cpu_per_core_ms}"
        )
    for name, value in (("allreduce_from", allreduce_from), ("grad_from", grad_from)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} is a fraction of the backward, in [0, 1]; got {value}")
    terms: Dict[str, float] = {LINK: times.load(LINK), COPY: times.load(COPY)}
    if cores is not None:
        terms[CORES_OPS] = times.load(CORES) / cores
    if cpu_per_core_ms is not None:
        terms[CORES_CPU] = cpu_per_core_ms
    for cycle in cycles(_edges(times, semantics, allreduce_from, grad_from)):
        terms[cycle.name] = cycle.per_step_ms
    if semantics == SYNC:
        t = times.ms
        first = min(allreduce_from, grad_from) * t[DENSE_BWD]
        carried = sum(times.busy(op) for op in (ALLREDUCE, GRAD_A2A, OUT_A2A))
        terms[WINDOW] = t[DENSE_FWD] + first + carried
    return DependencyBound(terms, semantics)


def semantics_of(variant: str) -> str:
    """The semantics a variant trains with: one step stale for SemiSync, else synchronous."""
    return STALE if "SemiSync" in variant else SYNC


# --------------------------------------------------------------------------
# The stage probe's operation times
# --------------------------------------------------------------------------

# Keys of the probe's epoch record (seconds summed over the epoch) this reads.
PROBE_KEYS = ("h2d", "input_dist", "lookup", "out_a2a", "forward", "backward", "opt", "emb_update")
# The backward's pieces, timed apart (``allreduce_from`` a fraction summed over the
# epoch); results from before the probe timed them derive these (``DERIVED``).
PIECE_KEYS = ("dense_bwd", "allreduce", "allreduce_from", "emb_backward")
# Timed with them since 2026-11-28: when the embeddings' gradient is ready (a fraction
# of the dense backward, summed over the epoch); results without it take ``GRAD_FROM``.
GRAD_FROM_KEY = "grad_from"

DERIVED = {
    DENSE_FWD: "forward - lookup - out a2a",
    GRAD_A2A: "out a2a (the same bytes the other way; autograd runs it inside the backward)",
    ALLREDUCE: "max(0, link time of the model's collectives - 2 x out a2a), 0 over the loopback",
    DENSE_BWD: "max(0, backward - grad a2a - emb update - all-reduce)",
}
# What stays derived once the backward's pieces are timed.
DERIVED_FROM_PIECES = {
    DENSE_FWD: DERIVED[DENSE_FWD],
    GRAD_A2A: "max(0, the lookup's backward - emb update)",
}


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def op_times(
    stages: Sequence[Mapping[str, float]],
    steps: int,
    link_compute_ms: Optional[float] = None,
    link_input_dist_ms: Optional[float] = None,
) -> Optional[OpTimes]:
    """:class:`OpTimes` from the probe's epochs (medians per step), None for results
    from before the probe split the step.

    ``link_*_ms``: the link time per step of the input dist and of the
    model's own collectives (bytes at the emulated rate,
    :func:`benchmarks.measuring.schedule_bound.step_costs`); None without an
    emulated link, where collectives take no link time.

    Where the probe timed the backward's pieces apart (``PIECE_KEYS``: the
    dense backward with DDP's all-reduce not waited, the all-reduce waited
    alone, the lookup's backward after it), they are the operations' times,
    and the fraction of the dense backward run before the all-reduce's first
    bucket is issued is ``allreduce_from`` (and, where timed, the fraction run
    when the embeddings' gradient was ready is ``grad_from``).  Only the dense forward (the
    forward's remainder) and the gradient all-to-all (the lookup's backward
    less the update) stay derived.

    Older results derive the rest (``DERIVED``), each rule keeping the bound
    a lower one: the gradient all-to-all is taken as the forward one (the same
    bytes), and on every cycle it sits next to the dense backward, from which
    it is subtracted, so their sum is the backward's own remainder; the
    all-reduce gets the link time the two all-to-alls' wall times leave, no
    more than its own; the dense backward is what is left of the backward
    with the all-reduce's whole time taken out, though the backward waits
    only for the all-reduce's tail (over the loopback, where the all-reduce
    counts 0, the tail the backward waits for stays in it).
    """
    if not stages or steps <= 0 or any(k not in s for s in stages for k in PROBE_KEYS):
        return None
    m = {k: _median([1e3 * s[k] / steps for s in stages]) for k in PROBE_KEYS}
    out_a2a = m["out_a2a"]
    link = link_compute_ms or 0.0
    ms = {
        H2D: m["h2d"],
        INPUT_DIST: m["input_dist"],
        LOOKUP: m["lookup"],
        OUT_A2A: out_a2a,
        DENSE_FWD: max(0.0, m["forward"] - m["lookup"] - out_a2a),
        EMB_UPDATE: m["emb_update"],
        OPT: m["opt"],
    }
    allreduce_from: Optional[float] = None
    grad_from: Optional[float] = None
    if all(k in s for s in stages for k in PIECE_KEYS):
        p = {k: _median([1e3 * s[k] / steps for s in stages]) for k in PIECE_KEYS}
        ms[DENSE_BWD], ms[ALLREDUCE] = p["dense_bwd"], p["allreduce"]
        ms[GRAD_A2A] = max(0.0, p["emb_backward"] - m["emb_update"])
        allreduce_from = min(1.0, max(0.0, p["allreduce_from"] / 1e3))
        if all(GRAD_FROM_KEY in s for s in stages):
            g = _median([s[GRAD_FROM_KEY] / steps for s in stages])
            grad_from = min(1.0, max(0.0, g))
        derived = dict(DERIVED_FROM_PIECES)
    else:
        ms[GRAD_A2A] = out_a2a
        ms[ALLREDUCE] = max(0.0, link - 2 * out_a2a)
        ms[DENSE_BWD] = max(0.0, m["backward"] - out_a2a - m["emb_update"] - ms[ALLREDUCE])
        derived = dict(DERIVED)
    a2a_busy = min(out_a2a, link / 2)  # the two all-to-alls carry the same bytes
    busy = {
        INPUT_DIST: link_input_dist_ms or 0.0,
        OUT_A2A: a2a_busy,
        GRAD_A2A: a2a_busy,
        ALLREDUCE: link - 2 * a2a_busy,
    }
    return OpTimes(ms, busy, derived, allreduce_from, grad_from)


__all__ = [
    "ALLREDUCE_FROM",
    "CORES_CPU",
    "CORES_OPS",
    "Cycle",
    "DependencyBound",
    "Edge",
    "GRAD_FROM",
    "OPS",
    "OpTimes",
    "SEMANTICS",
    "STALE",
    "SYNC",
    "cycles",
    "dependency_bound",
    "op_times",
    "semantics_of",
    "WINDOW",
]
