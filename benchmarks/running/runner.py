"""The benchmark on one rank (run under torchrun by ``python -m benchmarks``).

Plan of a run:

1. Throughput.  Every contender (each variant of ours, torchrec's same-named
   class, the plain loops, the SparseDist stage probe) is built once, on its
   own model and its own process group.  Per batch size: one untimed warm-up
   epoch each (compiled variants compile here, and then also run the timed
   batches once, untimed, so their shapes recompile nothing later), then
   ``repeats`` rounds; each round times one epoch of every contender in
   turn (A B C, A B C, ...), so drift of a shared machine hits all of them
   alike.  The result per contender is the median over rounds.  After the
   rounds, every rank times ``batch_problem`` (what ``validate_batches=True``
   runs on each batch) on that batch size's epoch batches, in a loop of its
   own.  Then, per variant of ours, a short *recorded* epoch (schedule
   recording on, never timed) draws its timeline and notes where its input
   dist went (``benchmarks/running/recording.py``: the hidden fraction and the
   link-order gap of the bound).
   With ``memory`` (default), per batch size, every pipeline contender then
   runs untimed epochs measuring what it holds (``benchmarks/measuring/memory.py``);
   at the largest batch size SparseDist of both libraries is also built and
   measured once per memory option set.
2. Overhead.  The same rounds on the tiny model, where the pipeline's own
   Python work dominates a step.

A contender that raises (on any rank) is reported "n/a" with the reason and
left out of later rounds; each contender has its own process group, so one
that leaves a collective half done can't wedge the others.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
import inspect
import json
import logging
import os
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from benchmarks.contenders.build import (
    COMPILED_PLAIN,
    EVAL,
    TRAIN,
    CompiledPlainLoop,
    Contender,
    PipelineContender,
    PlainLoop,
    StageProbe,
    Variant,
    combine_stage_times,
    discover,
    group_twin,
    make_contender,
    takes_input_dist_group,
)
from benchmarks.figures import qps_chart
from benchmarks.measuring import memory
from benchmarks.running import recording, run_header
from benchmarks.settings import netns
from benchmarks.settings.config import BenchConfig
from benchmarks.tables import report
from trec_pipelines.data.validation import batch_problem
from trec_pipelines.observe.memory import peak_rss_bytes
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm_sharded import make_spec_batches
from trec_pipelines.testing.dlrm_spec import ModelSpec, tiny_spec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINK_REASON_ENV = "TREC_BENCH_LINK_REASON"
# Passes over an epoch's batches when timing batch validation; the report takes the median pass.
VALIDATION_PASSES = 25


class Progress:
    """A tqdm bar on rank 0; silent elsewhere."""

    def __init__(self, enabled: bool, total: int) -> None:
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="run", dynamic_ncols=True, smoothing=0.05)

    def step(self, label: str, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.set_description(label[:48], refresh=False)
            self._bar.update(n)

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class Session:
    """Runs contenders in lockstep on every rank and keeps what they measured."""

    def __init__(self, cfg: BenchConfig, bar: Progress) -> None:
        self.cfg = cfg
        self.bar = bar
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.errors: Dict[str, str] = {}
        self.timeout = datetime.timedelta(seconds=cfg.pg_timeout_s)
        # Solo: rank 0 trains alone on a one-rank group, so no step waits for
        # another rank; the other ranks idle (the overhead measurement).
        self.solo = False
        # Graphs compiled during the last epoch() (the largest over ranks).
        self.last_compiles = 0

    def guarded(self, key: str, fn: Callable[[], Any]) -> Tuple[Optional[str], List[Any]]:
        """Run ``fn`` on every rank (all call this with the same ``key``, in the same order).

        Returns ``(None, every rank's value)``, or the first error any rank
        raised and ``[]``: all ranks agree on the outcome.
        """
        error: Optional[Tuple[str, str]] = None
        value: Any = None
        try:
            value = fn()
        except Exception as exc:  # reported as n/a: the benchmark goes on
            error = (f"{type(exc).__name__}: {exc}".splitlines()[0][:240], traceback.format_exc())
        gathered: List[Any] = [None] * self.world
        dist.all_gather_object(gathered, (error, value))
        for rank, (err, _) in enumerate(gathered):
            if err is not None:
                self.errors.setdefault(key, f"[rank {rank}] {err[1]}")
                return f"{err[0]} (rank {rank})", []
        return None, [v for _, v in gathered]

    def build(self, contender: Contender, spec: ModelSpec) -> Optional[str]:
        """Build ``contender`` on a new group: all ranks, or (solo) rank 0 alone."""
        ranks = [0] if self.solo else None
        pg = dist.new_group(ranks=ranks, backend=devices.backend(), timeout=self.timeout)

        def do() -> None:
            if self.active:
                contender.build(
                    spec,
                    self.cfg.sharding_type,
                    pg,
                    self.cfg.seed,
                    self.cfg.emb_lr,
                    self.cfg.dense_lr,
                )

        err, _ = self.guarded(contender.key, do)
        return err

    @property
    def active(self) -> bool:
        """Whether this rank runs the contenders (in a solo phase only rank 0 does)."""
        return not self.solo or self.rank == 0

    def epoch(
        self, contender: Contender, batches: Sequence[Any]
    ) -> Tuple[Optional[str], float, Dict[str, float]]:
        """One timed epoch; seconds are the slowest rank's."""

        def do() -> Tuple[float, Dict[str, float], int]:
            gc.collect()  # nobody pays for the garbage of the contender before
            dist.barrier()
            if not self.active:
                return 0.0, {}, 0
            compiled_before = graphs_compiled()
            start = time.perf_counter()
            contender.run_epoch(batches)
            seconds = time.perf_counter() - start
            stages = contender.last.as_dict() if isinstance(contender, StageProbe) else {}
            return seconds, stages, graphs_compiled() - compiled_before

        err, values = self.guarded(contender.key, do)
        self.last_compiles = 0
        if err is not None:
            return err, 0.0, {}
        seconds = max(v[0] for v in values)
        self.last_compiles = max(v[2] for v in values)
        return None, seconds, combine_stage_times([v[1] for v in values])

    def close(self, contenders: Sequence[Contender]) -> None:
        for contender in contenders:
            pg = contender.pg
            contender.close()
            contender.pg = None
            if pg is not None:
                dist.destroy_process_group(pg)
        dist.barrier()


def graphs_compiled() -> int:
    """Graphs compiled so far in this process: dynamo's and compiled autograd's captures.

    Measured around each timed epoch: anything above zero there is a
    recompilation after the warm-up epoch.
    """
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]) + int(counters["compiled_autograd"]["captures"])


def _entry(contender: Contender) -> Dict[str, Any]:
    return {
        "variant": contender.variant,
        "base_variant": contender.base_variant,
        "input_dist_group": getattr(contender, "input_dist_group", None),
        "side": contender.side,
        "mode": contender.mode,
        "shimmed": contender.shimmed,
        "status": report.OK,
        "reason": "",
        "seconds": [],
        "compiles": 0,  # graphs compiled during the timed epochs (recompiles)
    }


def _contenders(variants: Sequence[Variant], cfg: BenchConfig, probe: bool) -> List[Contender]:
    out: List[Contender] = []
    for variant in variants:
        ours = make_contender(variant, "ours")
        out.append(ours)
        if cfg.torchrec and variant.theirs is not None:
            out.append(make_contender(variant, "torchrec"))
        if probe:  # the throughput phase: each input_dist_group setting asked for
            out += _group_settings(ours, cfg.input_dist_groups)
            if cfg.agreement_off:
                out += _agreement_twin(ours)
    out.append(PlainLoop(TRAIN))
    if any(v.plain_mode == EVAL for v in variants):
        out.append(PlainLoop(EVAL))
    if probe and cfg.stages and any(v.name == "TrainPipelineSparseDist" for v in variants):
        out.append(StageProbe())
    return out


def _group_settings(ours: Contender, groups: Sequence[str]) -> List[Contender]:
    """Set ``ours`` to the first of ``groups``; a twin row for each other one.

    Only for our pipelines that take ``input_dist_group``; the twin's key is
    ``ours:<Variant> [<group>]``.
    """
    if not isinstance(ours, PipelineContender) or not takes_input_dist_group(ours):
        return []
    first, *others = groups
    if first != "dedicated":
        ours.extra_kwargs = {**ours.extra_kwargs, "input_dist_group": first}
    return [group_twin(ours, group) for group in others]


def _agreement_twin(ours: Contender) -> List[Contender]:
    """Our pipeline again with ``sync_exhaustion=False``, as the row
    ``"<Variant> [no agreement]"`` (only for pipelines that take the option)."""
    if not isinstance(ours, PipelineContender) or ours.side != "ours":
        return []
    if "sync_exhaustion" not in inspect.signature(ours.cls).parameters:
        return []
    twin = make_contender(ours.info, "ours")
    assert isinstance(twin, PipelineContender)
    twin.variant = f"{ours.info.name} {report.NO_AGREEMENT}"
    twin.key = f"ours:{twin.variant}"
    twin.extra_kwargs = {**ours.extra_kwargs, "sync_exhaustion": False}
    return [twin]


def _unvalidated_twins(contenders: Sequence[Contender]) -> List[Contender]:
    """Each of our pipelines that validates batches, again with ``validate_batches=False``.

    The overhead table then shows what the check (on by default) costs per
    step next to everything else the pipeline does; key ``<key>+unvalidated``.
    """
    twins: List[Contender] = []
    for contender in contenders:
        if not isinstance(contender, PipelineContender) or contender.side != "ours":
            continue
        if "validate_batches" not in inspect.signature(contender.cls).parameters:
            continue
        twin = make_contender(contender.info, "ours")
        assert isinstance(twin, PipelineContender)
        twin.key += report.UNVALIDATED
        twin.extra_kwargs = {"validate_batches": False}
        twins.append(twin)
    return twins


def _compiles(contender: Contender) -> bool:
    """A contender running compiled code: a compiled variant, or the plain loop doing its compiled work."""
    return contender.base_variant in report.COMPILED_VARIANTS or isinstance(
        contender, CompiledPlainLoop
    )


def _phase(
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
    cfg, bar = session.cfg, session.bar
    session.solo = solo
    entries = {c.key: _entry(c) for c in contenders}
    alive: List[Contender] = []
    for contender in contenders:
        err = session.build(contender, spec)
        bar.step(f"build {contender.key}")
        if err is None:
            alive.append(contender)
        else:
            entries[contender.key].update(status=report.NA, reason=f"failed to build: {err}")
            bar.write(f"n/a {contender.key}: failed to build: {err}")

    def drop(contender: Contender, why: str) -> None:
        entries[contender.key].update(status=report.NA, reason=why, seconds=[])
        alive.remove(contender)
        bar.write(f"n/a {contender.key}: {why}")

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
        seconds: Dict[str, List[float]] = {c.key: [] for c in contenders}
        for contender in list(alive):
            err, _, _ = session.epoch(contender, warmup)
            if err is None and _compiles(contender):
                # Dynamo's caches are per code object, shared by every model
                # of the run: an epoch over the timed batches lets the shapes
                # they bring turn dynamic here, not in the first timed round
                # of whichever contender happens to run first.
                err, _, _ = session.epoch(contender, batches)
            bar.step(f"b{batch_size} warm-up {contender.key}")
            if err is not None:
                drop(contender, f"warm-up epoch failed: {err}")
        rounds = cfg.repeats if repeats is None else repeats
        block["rounds"] = rounds
        for round_index in range(rounds):
            for contender in _round_order(alive, round_index):
                err, elapsed, stages = session.epoch(contender, batches)
                bar.step(f"b{batch_size} round {round_index + 1}/{rounds} {contender.key}")
                if err is not None:
                    drop(contender, f"timed epoch failed: {err}")
                    continue
                seconds[contender.key].append(elapsed)
                entries[contender.key]["compiles"] += session.last_compiles
                if stages:
                    block["stages"].append(stages)
        for key, entry in entries.items():
            block["contenders"][key] = dict(
                entry, seconds=seconds[key] if entry["status"] == report.OK else []
            )
        if measure_validation:
            block["validation"] = _validation(session, batches, batch_size)
        if record:
            pictures, block["recorded"] = _recorded(
                session, alive, batches, batch_size, timelines_dir
            )
            timelines += pictures
        if measure_memory:
            block["memory"] = _memory(session, alive, spec, batch_size, timelines_dir)
            if timelines_dir is not None:
                timelines += [
                    m["ranks"][0]["timeline"]
                    for m in block["memory"].values()
                    if m["status"] == report.OK and m["ranks"] and m["ranks"][0].get("timeline")
                ]
        blocks.append(block)
    session.close(contenders)
    sparse_dist = next(
        (c for c in contenders if c.variant == memory.OPTIONS_VARIANT and c.side == "ours"), None
    )
    if measure_memory and cfg.memory_options and sparse_dist is not None:
        # At the largest batch size only: each option set builds a model of its own.
        largest = max(range(len(sizes)), key=lambda k: sizes[k][0])
        blocks[largest]["memory_options"] = _memory_options(
            session, sparse_dist, spec, sizes[largest][0]
        )
    return blocks, timelines


def time_batch_validation(batches: Sequence[Any], passes: int = VALIDATION_PASSES) -> List[float]:
    """Microseconds per batch that ``batch_problem`` takes, one value per pass over ``batches``.

    Each pass is a tight loop over the batches, as ``validate_batches=True``
    checks them one per ``progress()``; the first, untimed pass also makes
    sure none is malformed (the time of a batch that fails is not the cost
    every training step pays).
    """
    if not batches or passes < 1:
        raise ValueError(
            f"need batches and passes >= 1, got {len(batches)} batches and {passes} passes"
        )
    for index, batch in enumerate(batches):
        problem = batch_problem(batch)
        if problem is not None:
            raise ValueError(f"benchmark batch {index} is malformed: {problem}")
    per_batch: List[float] = []
    for _ in range(passes):
        start = time.perf_counter()
        for batch in batches:
            batch_problem(batch)
        per_batch.append(1e6 * (time.perf_counter() - start) / len(batches))
    return per_batch


def _validation(session: Session, batches: Sequence[Any], batch_size: int) -> Dict[str, Any]:
    """Every rank times ``batch_problem`` on its own epoch batches, between timed epochs.

    The batches are the ones the rounds just trained on, in the state the
    pipelines left them (whatever a pipeline cached on a host KJT, e.g. its
    offsets, is there in all but the first epoch too).
    """

    def measure() -> List[float]:
        gc.collect()  # as before a timed epoch: no garbage of the contenders' to collect meanwhile
        dist.barrier()  # the ranks time together, as they train together
        return time_batch_validation(batches)

    err, values = session.guarded(f"validation:b{batch_size}", measure)
    session.bar.step(f"b{batch_size} batch validation")
    if err is not None:
        session.bar.write(f"no batch-validation timing at batch {batch_size}: {err}")
    return {
        "status": report.OK if err is None else report.NA,
        "reason": err or "",
        "passes": VALIDATION_PASSES,
        "batches": len(batches),
        "us_per_batch": values,  # per rank: microseconds per batch, one value per pass
    }


def _measure_memory(
    contender: Contender,
    held_batches: List[Any],
    ledger_batches: List[Any],
    picture: Optional[str],
    *,
    timeline: bool,
) -> Dict[str, Any]:
    """What ``contender`` holds over an epoch; for ours also the ledger's
    account (drawn to ``picture`` when given)."""
    result = memory.held_epoch(contender, held_batches)
    stash_plan = getattr(getattr(contender, "pipeline", None), "stash_plan", None)
    if contender.side == "ours" and callable(stash_plan):
        result["stash"] = dataclasses.asdict(stash_plan())
    if contender.side == "ours":
        result["ledger"] = memory.ledger_epoch(contender, ledger_batches, picture)
        if timeline:
            result["timeline"] = picture if result["ledger"] is not None else None
    return result


def _memory_batches(session: Session, spec: ModelSpec, batch_size: int, salt: int) -> List[Any]:
    # Fresh batches per epoch (the freeing options empty the storage of the ones
    # they train on), the same content for every contender: their bytes compare exactly.
    cfg = session.cfg
    return make_spec_batches(
        spec, cfg.memory_steps, batch_size, cfg.seed + 100 + salt, session.rank
    )


def _copying(batches: List[Any]) -> List[Any]:
    for batch in batches:
        batch.copying = True
    return batches


def _memory(
    session: Session,
    contenders: Sequence[Contender],
    spec: ModelSpec,
    batch_size: int,
    out_dir: Optional[str],
) -> Dict[str, Any]:
    """What each pipeline contender holds, from outside (and ours' ledger), per rank.

    With ``out_dir`` rank 0 also draws each of ours' ledger epochs with its
    memory track, to ``memory_<Variant>_b<batch>.png``.
    """
    out: Dict[str, Any] = {}
    for contender in contenders:
        if contender.side not in ("ours", "torchrec"):
            continue
        held_batches = _memory_batches(session, spec, batch_size, 0)
        ledger_batches = _memory_batches(session, spec, batch_size, 1)

        picture = None
        if out_dir is not None and session.rank == 0 and contender.side == "ours":
            picture = os.path.join(out_dir, f"memory_{contender.variant}_b{batch_size}.png")

        measure = functools.partial(
            _measure_memory, contender, held_batches, ledger_batches, picture, timeline=True
        )
        err, values = session.guarded(f"memory:{contender.key}", measure)
        session.bar.step(f"b{batch_size} memory {contender.key}")
        out[contender.key] = {
            "status": report.OK if err is None else report.NA,
            "reason": err or "",
            "ranks": values,
        }
        if err is not None:
            session.bar.write(f"no memory measurement for {contender.key}: {err}")
    return out


def _memory_options(
    session: Session, ours: Contender, spec: ModelSpec, batch_size: int
) -> List[Dict[str, Any]]:
    """SparseDist of each library, built afresh per memory option set, measured from outside."""
    assert isinstance(ours, PipelineContender)
    rows: List[Dict[str, Any]] = []
    sides = ["ours"] + (
        ["torchrec"] if session.cfg.torchrec and ours.info.theirs is not None else []
    )
    for side in sides:
        for label, kwargs in memory.OPTION_SETS:
            contender = make_contender(ours.info, side)
            assert isinstance(contender, PipelineContender)
            contender.extra_kwargs = dict(kwargs)
            err = session.build(contender, spec)
            values: List[Any] = []
            if err is None:
                # Batches whose to() copies, as a GPU's H2D does: what the options
                # can free is the pipeline's copy, not the loader's own batch.
                held_batches = _copying(_memory_batches(session, spec, batch_size, 0))
                ledger_batches = _copying(_memory_batches(session, spec, batch_size, 1))

                # The ledger too for ours: clear_data_dist_inputs acts mid-step.
                measure = functools.partial(
                    _measure_memory, contender, held_batches, ledger_batches, None, timeline=False
                )
                err, values = session.guarded(f"memory-options:{side}:{label}", measure)
            session.close([contender])
            session.bar.step(f"b{batch_size} memory options {side} {label}")
            rows.append(
                {
                    "side": side,
                    "label": label,
                    "options": dict(kwargs),
                    "status": report.OK if err is None else report.NA,
                    "reason": err or "",
                    "ranks": values,
                }
            )
    return rows


def _round_order(alive: Sequence[Contender], round_index: int) -> List[Contender]:
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


def _recorded(
    session: Session,
    contenders: Sequence[Contender],
    batches: Sequence[Any],
    batch_size: int,
    out_dir: Optional[str],
) -> Tuple[List[str], Dict[str, List[Any]]]:
    """A separate recorded epoch per variant of ours (``benchmarks/running/recording.py``).

    Returns the timeline pictures drawn (``<Variant>_b<batch>.png`` in
    ``out_dir``, when given) and every rank's recorded epoch per variant.
    """
    written: List[str] = []
    epochs: Dict[str, List[Any]] = {}
    recorded = batches[: session.cfg.timeline_steps]
    for contender in contenders:
        pipeline = getattr(contender, "pipeline", None)
        if contender.side != "ours" or pipeline is None:
            continue
        if not hasattr(pipeline, "enable_schedule_recording"):
            session.bar.write(
                f"no recorded epoch for {contender.variant}: it has no enable_schedule_recording()"
            )
            continue
        path = (
            os.path.join(out_dir, recording.picture_name(contender.variant, batch_size))
            if out_dir is not None
            else None
        )

        record = functools.partial(
            recording.recorded_epoch,
            pipeline,
            contender.model,
            functools.partial(contender.run_epoch, recorded),
            path if session.rank == 0 else None,
            title=recording.timeline_title(contender.variant, batch_size),
            loop=contender if hasattr(contender, "step_span") else None,  # Staged: the loop steps
            on_cpu=devices.device_type() == "cpu",
        )
        err, values = session.guarded(f"recorded:{contender.key}", record)
        session.bar.step(f"recorded {contender.variant} b{batch_size}")
        if err is None:
            epochs[contender.variant] = values
            if path is not None:
                written.append(path)
        else:
            session.bar.write(f"no recorded epoch for {contender.variant}: {err}")
    return written, epochs


def _quiet(rank: int) -> None:
    """Keep torchrec's and torch's routine warnings off the console (they repeat per model).

    trec_pipelines' own warnings stay on, from rank 0 only.
    """
    if rank != 0:
        logging.getLogger("trec_pipelines").setLevel(logging.ERROR)
    for category in (FutureWarning, UserWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    for name in (
        "torchrec",
        "torch",
        "fbgemm_gpu",
        "torch.distributed",
        "torch.fx",
        "torch._dynamo",
    ):
        logging.getLogger(name).setLevel(logging.ERROR)


def _total_runs(
    n_main: int, n_ours: int, n_overhead: int, cfg: BenchConfig, n_pipelines: int = 0
) -> int:
    main = n_main + len(cfg.batch_sizes) * (n_main * (1 + cfg.repeats) + 1)  # + 1: batch validation
    if cfg.timelines or cfg.stages:
        main += len(cfg.batch_sizes) * n_ours
    if cfg.memory:
        main += len(cfg.batch_sizes) * n_pipelines
        if cfg.memory_options:
            main += len(memory.OPTION_SETS) * (2 if cfg.torchrec else 1)
    overhead = n_overhead * (2 + cfg.overhead_repeats) if cfg.overhead else 0
    return main + overhead


def out_dir(cfg: BenchConfig) -> str:
    base = cfg.out_dir if os.path.isabs(cfg.out_dir) else os.path.join(REPO, cfg.out_dir)
    return os.path.join(base, cfg.run_name())


def link_facts(cfg: BenchConfig) -> Dict[str, Any]:
    qdisc = netns.qdisc_in_effect()
    return {
        "requested_gbit": cfg.link_gbit,
        "emulated": qdisc is not None,
        "qdisc": qdisc,
        "not_emulated_because": os.environ.get(LINK_REASON_ENV)
        if cfg.link_gbit is not None and qdisc is None
        else None,
    }


def worker(cfg: BenchConfig) -> int:
    _quiet(int(os.environ.get("RANK", "0")))
    torch.set_num_threads(cfg.threads)
    devices.bind()
    dist.init_process_group(
        backend=devices.backend(), timeout=datetime.timedelta(seconds=cfg.pg_timeout_s)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    variants, notes = discover(cfg.variants, cfg.include_compiled)
    main = _contenders(variants, cfg, probe=True)
    overhead = _contenders(variants, cfg, probe=False) if cfg.overhead else []
    if overhead:
        # Compiled variants get a second reference there: the plain loop doing their compiled work.
        overhead += [CompiledPlainLoop(v.name) for v in variants if v.name in COMPILED_PLAIN]
        overhead += _unvalidated_twins(overhead)
    n_ours = sum(1 for c in main if c.side == "ours")
    n_pipelines = sum(1 for c in main if c.side in ("ours", "torchrec"))
    bar = Progress(
        cfg.progress and rank == 0, _total_runs(len(main), n_ours, len(overhead), cfg, n_pipelines)
    )
    for note in notes:
        bar.write(note)
    session = Session(cfg, bar)
    target = out_dir(cfg)
    timelines_dir = os.path.join(target, "timelines") if cfg.timelines else None
    if rank == 0:
        os.makedirs(timelines_dir or target, exist_ok=True)
    dist.barrier()
    started = time.time()

    sizes = [(bs, cfg.steps_for(bs)) for bs in cfg.batch_sizes]
    blocks, timelines = _phase(
        session,
        cfg.model_spec(),
        main,
        sizes,
        timelines_dir,
        measure_memory=cfg.memory,
        measure_validation=True,
        record=cfg.timelines or cfg.stages,
    )
    raw: Dict[str, Any] = {
        "world": world,
        # What the bound needs (benchmarks/measuring/schedule_bound.py): the cores the
        # ranks share and the rate of the link, if one was emulated.
        "cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "link_gbit": cfg.link_gbit if netns.qdisc_in_effect() is not None else None,
        "throughput": blocks,
        "overhead": None,
    }
    if overhead:
        tiny, _ = _phase(
            session,
            tiny_spec(),
            overhead,
            [(cfg.overhead_batch_size, cfg.overhead_steps)],
            None,
            solo=True,
            repeats=cfg.overhead_repeats,
        )
        raw["overhead"] = tiny[0]
    bar.close()
    peaks: List[Any] = [None] * world
    dist.all_gather_object(peaks, peak_rss_bytes())
    raw["peak_rss"] = peaks

    if rank == 0:
        write_results(cfg, raw, notes, timelines, session.errors, target, time.time() - started)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def write_results(
    cfg: BenchConfig,
    raw: Dict[str, Any],
    notes: Sequence[str],
    timelines: Sequence[str],
    errors: Dict[str, str],
    target: str,
    seconds: float,
) -> None:
    link = link_facts(cfg)
    header = run_header.header(
        cfg, raw["world"], devices.backend(), devices.device_type(), seconds, link, notes
    )
    text = report.format_report(raw, cfg.repeats, header)
    print("\n" + text, flush=True)
    document = {
        "name": cfg.run_name(),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds": round(seconds, 1),
        "config": cfg.to_dict(),
        "versions": report.versions(REPO),
        "host": report.host_facts(),
        "link": link,
        "notes": list(notes),
        "summary": report.summary(raw),
        "raw": raw,
        "timelines": [os.path.relpath(p, target) for p in timelines],
        "errors": errors,
    }
    with open(os.path.join(target, "results.json"), "w") as f:
        json.dump(document, f, indent=1)
    with open(os.path.join(target, "table.txt"), "w") as f:
        f.write(text)
    qps_chart.write_chart(raw, os.path.join(target, "qps.png"))
    print(
        f"results: {os.path.relpath(target, os.getcwd())}/ (results.json, table.txt, qps.png"
        + (", timelines/" if timelines else "")
        + ")",
        flush=True,
    )
