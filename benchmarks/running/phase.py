"""One phase of a run: build, warm up and time a list of contenders at each batch size.

The contenders of a round run back to back in an order that rotates between
rounds (drift between rounds cancels in the paired ratios); the untimed
measurements of :mod:`benchmarks.running.block_probes` follow each batch size.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks.contenders.build import (
    CompiledPlainLoop,
    Contender,
)
from benchmarks.measuring import memory
from benchmarks.running.block_probes import (
    memory_block,
    memory_options_block,
    recorded_block,
    validation_block,
)
from benchmarks.running.session import Session, new_entry
from benchmarks.settings import variants
from benchmarks.tables import report
from trec_pipelines.testing.dlrm_sharded import make_spec_batches
from trec_pipelines.testing.dlrm_spec import ModelSpec


def _compiles(contender: Contender) -> bool:
    """A contender running compiled code: a compiled variant, or the plain loop doing its compiled work."""
    return contender.base_variant in variants.COMPILED_VARIANTS or isinstance(
        contender, CompiledPlainLoop
    )


class _Alive:
    """The contenders still in the phase, and each one's entry (status, reason, compiles)."""

    def __init__(self, session: Session, contenders: Sequence[Contender]) -> None:
        self.session = session
        self.entries = {c.key: new_entry(c) for c in contenders}
        self.contenders: List[Contender] = []

    def build(self, spec: ModelSpec, contenders: Sequence[Contender]) -> None:
        """Build each contender; one that fails to build is n/a for the whole phase."""
        for contender in contenders:
            err = self.session.build(contender, spec)
            self.session.bar.step(f"build {contender.key}")
            if err is None:
                self.contenders.append(contender)
            else:
                self.entries[contender.key].update(
                    status=report.NA, reason=f"failed to build: {err}"
                )
                self.session.bar.write(f"n/a {contender.key}: failed to build: {err}")

    def drop(self, contender: Contender, why: str) -> None:
        self.entries[contender.key].update(status=report.NA, reason=why, seconds=[])
        self.contenders.remove(contender)
        self.session.bar.write(f"n/a {contender.key}: {why}")


def _warm_up(alive: _Alive, warmup: Sequence[Any], batches: Sequence[Any], batch_size: int) -> None:
    """One untimed epoch per contender (two for the compiled ones)."""
    session = alive.session
    for contender in list(alive.contenders):
        err, _, _ = session.epoch(contender, warmup)
        if err is None and _compiles(contender):
            # Dynamo's caches are per code object, shared by every model
            # of the run: an epoch over the timed batches lets the shapes
            # they bring turn dynamic here, not in the first timed round
            # of whichever contender happens to run first.
            err, _, _ = session.epoch(contender, batches)
        session.bar.step(f"b{batch_size} warm-up {contender.key}")
        if err is not None:
            alive.drop(contender, f"warm-up epoch failed: {err}")


def _timed_rounds(
    alive: _Alive,
    contenders: Sequence[Contender],
    batches: Sequence[Any],
    block: Dict[str, Any],
    rounds: int,
) -> None:
    """``rounds`` timed epochs per contender into ``block`` (seconds, the ranks' CPU
    seconds, stages, compiles)."""
    session, batch_size = alive.session, block["batch_size"]
    seconds: Dict[str, List[float]] = {c.key: [] for c in contenders}
    cpu_seconds: Dict[str, List[float]] = {c.key: [] for c in contenders}
    block["rounds"] = rounds
    for round_index in range(rounds):
        for contender in round_order(alive.contenders, round_index):
            err, elapsed, stages = session.epoch(contender, batches)
            session.bar.step(f"b{batch_size} round {round_index + 1}/{rounds} {contender.key}")
            if err is not None:
                alive.drop(contender, f"timed epoch failed: {err}")
                continue
            seconds[contender.key].append(elapsed)
            cpu_seconds[contender.key].append(session.last_cpu_seconds)
            alive.entries[contender.key]["compiles"] += session.last_compiles
            if stages:
                block["stages"].append(stages)
    for key, entry in alive.entries.items():
        ok = entry["status"] == report.OK
        block["contenders"][key] = dict(
            entry,
            seconds=seconds[key] if ok else [],
            cpu_seconds=cpu_seconds[key] if ok else [],  # every rank's, added; per round
        )


def _untimed(
    alive: _Alive,
    spec: ModelSpec,
    batches: Sequence[Any],
    block: Dict[str, Any],
    timelines_dir: Optional[str],
    what: Tuple[bool, bool, bool],
) -> List[str]:
    """The untimed measurements after the rounds; returns the pictures drawn.

    ``what``: (batch validation, recorded epochs, memory).
    """
    session, batch_size = alive.session, block["batch_size"]
    measure_validation, record, measure_memory = what
    timelines: List[str] = []
    if measure_validation:
        block["validation"] = validation_block(session, batches, batch_size)
    if record:
        pictures, block["recorded"] = recorded_block(
            session, alive.contenders, batches, batch_size, timelines_dir
        )
        timelines += pictures
    if measure_memory:
        block["memory"] = memory_block(session, alive.contenders, spec, batch_size, timelines_dir)
        if timelines_dir is not None:
            timelines += [
                m["ranks"][0]["timeline"]
                for m in block["memory"].values()
                if m["status"] == report.OK and m["ranks"] and m["ranks"][0].get("timeline")
            ]
    return timelines


def run_phase(
    session: Session,
    spec: ModelSpec,
    contenders: List[Contender],
    sizes: Sequence[Tuple[int, int]],
    timelines_dir: Optional[str],
    solo: bool = False,
    measure_memory: bool = False,
    measure_validation: bool = False,
    record: bool = False,
    repeats: Optional[int] = None,
) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Build, warm up and time ``contenders`` at each ``(batch_size, steps)``.

    ``solo``: rank 0 trains alone on a one-rank group, so no step waits for
    another rank (the overhead measurement).  ``measure_validation``: after
    the timed rounds of a batch size, time ``batch_problem`` on its batches.
    ``record``: a recorded epoch per variant of ours follows the timed rounds
    (timelines into ``timelines_dir`` when given).
    """
    cfg = session.cfg
    session.solo = solo
    alive = _Alive(session, contenders)
    alive.build(spec, contenders)
    blocks: List[Dict[str, Any]] = []
    timelines: List[str] = []
    for batch_size, steps in sizes:
        batches = make_spec_batches(spec, steps, batch_size, cfg.seed, session.rank)
        warmup = make_spec_batches(spec, cfg.warmup_steps, batch_size, cfg.seed + 1, session.rank)
        block: Dict[str, Any] = {
            "batch_size": batch_size,
            "steps": steps,
            "contenders": {},
            "stages": [],
        }
        _warm_up(alive, warmup, batches, batch_size)
        _timed_rounds(
            alive, contenders, batches, block, cfg.repeats if repeats is None else repeats
        )
        what = (measure_validation, record, measure_memory)
        timelines += _untimed(alive, spec, batches, block, timelines_dir, what)
        blocks.append(block)
    session.close(contenders)
    sparse_dist = next(
        (c for c in contenders if c.variant == memory.OPTIONS_VARIANT and c.side == "ours"), None
    )
    if measure_memory and cfg.memory_options and sparse_dist is not None:
        # At the largest batch size only: each option set builds a model of its own.
        largest = max(range(len(sizes)), key=lambda k: sizes[k][0])
        blocks[largest]["memory_options"] = memory_options_block(
            session, sparse_dist, spec, sizes[largest][0]
        )
    return blocks, timelines


def round_order(alive: Sequence[Contender], round_index: int) -> List[Contender]:
    """The order of one round: every contender once, A B C ... as built.

    Ours and torchrec's class of a variant always run back to back (so their
    per-round ratio sees the same machine), the pair's order alternates
    between rounds, and each round starts one group further on, so no
    contender always runs first or always follows the same one.
    """
    groups: List[List[Contender]] = []
    for contender in alive:
        if groups and contender.side == "torchrec" and groups[-1][-1].variant == contender.variant:
            groups[-1].append(contender)
        else:
            groups.append([contender])
    shift = round_index % max(len(groups), 1)
    order: List[Contender] = []
    for group in groups[shift:] + groups[:shift]:
        order += group if round_index % 2 == 0 else group[::-1]
    return order
