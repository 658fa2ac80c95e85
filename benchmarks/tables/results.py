"""The whole report of a run: the text of ``table.txt`` and the summary, versions and host facts of ``results.json``.

Composes the tables of :mod:`benchmarks.tables.report` (throughput),
:mod:`benchmarks.tables.overhead`, :mod:`benchmarks.tables.agreement`,
:mod:`benchmarks.tables.bound_report` and :mod:`benchmarks.tables.memory_report`.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import asdict
from typing import Any, Dict, Sequence

from benchmarks.tables import bound_report, memory_report
from benchmarks.tables.agreement import agreement_costs, format_agreement
from benchmarks.tables.overhead import format_overhead, overhead_table
from benchmarks.tables.report import Measure, format_throughput, throughput_tables


def format_report(raw: Dict[str, Any], repeats: int, header: Sequence[str] = ()) -> str:
    parts = list(header)
    rss = memory_report.peak_rss_line(raw)
    if rss is not None:
        parts.append(rss)
    for table in throughput_tables(raw):
        parts.append(format_throughput(table, repeats))
        agreement = format_agreement(table)
        if agreement is not None:
            parts.append(agreement)
    overhead = overhead_table(raw)
    if overhead is not None:
        parts.append(format_overhead(overhead, raw["overhead"].get("rounds", repeats)))
    return "\n\n".join(parts) + "\n"


def _measure_json(m: Measure) -> Dict[str, Any]:
    return {
        "status": m.status,
        "reason": m.reason,
        "shimmed": m.shimmed,
        "median": m.median,
        "samples": m.samples,
        "graphs_compiled_in_timed_epochs": m.compiles,
    }


def summary(raw: Dict[str, Any]) -> Dict[str, Any]:
    """Derived numbers, next to the raw ones in the JSON file."""
    out: Dict[str, Any] = {"throughput": [], "overhead": None}
    for table in throughput_tables(raw):
        out["throughput"].append(
            {
                "batch_size": table.batch_size,
                "global_batch": table.batch_size * table.world,
                "steps": table.steps,
                "unit": "global examples/s",
                "variants": [
                    {
                        "variant": r.variant,
                        "mode": r.mode,
                        "ours": _measure_json(r.ours),
                        "torchrec": _measure_json(r.torchrec),
                        "plain": _measure_json(r.plain),
                        "ours_vs_torchrec": r.ours_vs_torchrec,
                        "ours_vs_torchrec_paired": r.paired,
                        "ours_vs_plain": r.ours_vs_plain,
                        "torchrec_vs_plain": r.torchrec_vs_plain,
                    }
                    for r in table.rows
                ],
                "plain": {mode: _measure_json(m) for mode, m in table.plain.items()},
                "agreement": [asdict(c) for c in agreement_costs(table)],
                "memory": memory_report.summary(
                    {"memory": table.memory, "memory_options": table.memory_options},
                    [r.variant for r in table.rows],
                )
                if table.memory
                else None,
                "batch_validation": None
                if table.validation is None
                else {
                    "status": table.validation.status,
                    "reason": table.validation.reason,
                    "us_per_batch": table.validation.us_per_batch,
                    "us_per_batch_per_rank": table.validation.rank_us,
                    "passes": table.validation.passes,
                    "batches": table.validation.batches,
                    "sparse_dist_ms_per_step": table.validation.step_ms,
                    "percent_of_sparse_dist_step": table.validation.percent_of_step,
                },
                "bound": bound_report.summary(table.bound),
            }
        )
    overhead = overhead_table(raw)
    if overhead is not None:
        out["overhead"] = {
            "batch_size": overhead.batch_size,
            "steps": overhead.steps,
            "unit": "ms/step; overhead = median over rounds of (ms/step - plain loop ms/step in that round)",
            "plain_ms": overhead.plain_ms,
            "variants": [
                {
                    "variant": r.variant,
                    "mode": r.mode,
                    "ours_ms": r.ours_ms,
                    "torchrec_ms": r.torchrec_ms,
                    "against_plain_loop": r.reference,
                    "ours_overhead_ms": r.ours_overhead,
                    "torchrec_overhead_ms": r.torchrec_overhead,
                    "ours_over_torchrec_overhead": r.overhead_ratio,
                }
                for r in overhead.rows
            ],
        }
    return out


def versions(repo: str) -> Dict[str, Any]:
    import fbgemm_gpu
    import torch
    import torchrec

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrec": getattr(torchrec, "__version__", "unknown"),
        "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "unknown"),
        "trec_pipelines": git_revision(repo),
    }


def git_revision(repo: str) -> str:
    """``<sha>`` or ``<sha>-dirty`` of the checkout at ``repo`` ("unknown" outside git)."""
    try:
        sha = subprocess.run(
            ["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def host_facts() -> Dict[str, Any]:
    facts: Dict[str, Any] = {
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "cpu_model": platform.processor() or "unknown",
        "memory_gib": None,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    facts["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    facts["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
                    break
    except OSError:
        pass
    return facts
