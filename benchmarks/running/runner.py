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

import datetime
import inspect
import json
import logging
import os
import time
import warnings
from typing import Any, Dict, List, Sequence

import torch
import torch.distributed as dist

from benchmarks.contenders.build import (
    COMPILED_PLAIN,
    CompiledPlainLoop,
    Contender,
    PipelineContender,
    PlainLoop,
    group_twin,
    make_contender,
    takes_input_dist_group,
)
from benchmarks.contenders.stage_probe import StageProbe
from benchmarks.contenders.variants import EVAL, TRAIN, Variant, discover
from benchmarks.figures import qps_chart
from benchmarks.measuring import memory
from benchmarks.running import run_header
from benchmarks.running.phase import run_phase
from benchmarks.running.session import Progress, Session
from benchmarks.settings import netns
from benchmarks.settings.config import BenchConfig
from benchmarks.tables import report, results
from trec_pipelines.observe.memory import peak_rss_bytes
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm_spec import tiny_spec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINK_REASON_ENV = "TREC_BENCH_LINK_REASON"


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
    blocks, timelines = run_phase(
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
        tiny, _ = run_phase(
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
    text = results.format_report(raw, cfg.repeats, header)
    print("\n" + text, flush=True)
    document = {
        "name": cfg.run_name(),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds": round(seconds, 1),
        "config": cfg.to_dict(),
        "versions": results.versions(REPO),
        "host": results.host_facts(),
        "link": link,
        "notes": list(notes),
        "summary": results.summary(raw),
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
