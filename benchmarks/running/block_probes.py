"""The untimed measurements that follow a batch size's timed rounds.

What ``batch_problem`` costs per batch, each variant of ours' recorded epoch
(its timeline), and the memory each pipeline contender holds, with and without
the memory options.  Nothing here is timed as throughput.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from benchmarks.contenders.build import (
    Contender,
    PipelineContender,
    make_contender,
)
from benchmarks.figures import timelines
from benchmarks.measuring import memory
from benchmarks.running import recording
from benchmarks.running.session import Session
from benchmarks.tables import report
from trec_pipelines.data.validation import batch_problem
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm_sharded import make_spec_batches
from trec_pipelines.testing.dlrm_spec import ModelSpec

# Passes over an epoch's batches when timing batch validation; the report takes the median pass.
VALIDATION_PASSES = 25


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


def validation_block(session: Session, batches: Sequence[Any], batch_size: int) -> Dict[str, Any]:
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
        stored: Optional[Dict[str, Any]] = {} if picture is not None else None
        result["ledger"] = memory.ledger_epoch(contender, ledger_batches, stored)
        if picture is not None and stored:
            # Drawn from what results.json stores, as `replot` draws it again.
            timelines.draw_stored(stored, picture, stored["title"])
            result["memory_timeline"] = stored
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


def memory_block(
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
            picture = os.path.join(
                out_dir, timelines.memory_picture_name(contender.variant, batch_size)
            )

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


def memory_options_block(
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


def recorded_block(
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
            os.path.join(out_dir, timelines.picture_name(contender.variant, batch_size))
            if out_dir is not None
            else None
        )

        record = functools.partial(
            recording.recorded_epoch,
            pipeline,
            contender.model,
            functools.partial(contender.run_epoch, recorded),
            path if session.rank == 0 else None,
            title=timelines.timeline_title(contender.variant, batch_size),
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
