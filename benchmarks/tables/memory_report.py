"""The memory side of the results: columns next to QPS, a table per batch size, the options table.

Raw layout, per throughput block (plain JSON types; see ``benchmarks/measuring/memory.py``)::

    block["memory"] = {key: {"status": "ok"|"n/a", "reason": str,
                             "ranks": [HeldEpoch (+ "ledger" for ours), one per rank]}}
    block["memory_options"] = [{"side": "ours"|"torchrec", "label": str, "options": {...},
                                "status", "reason", "ranks": [HeldEpoch, ...]}, ...]
    raw["peak_rss"] = [bytes per rank]

A number shown for a contender is the largest over its ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

from benchmarks.measuring import memory_places
from trec_pipelines.observe.memory import KINDS, PLACES

MiB = float(2**20)


def _ok_ranks(entry: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
    if not entry or entry.get("status") != "ok":
        return []
    return [r for r in entry.get("ranks") or [] if r]


def held_peak(entry: Optional[Dict[str, Any]]) -> Optional[float]:
    """Peak bytes held after a ``progress()`` (outside measurement), max over ranks."""
    ranks = _ok_ranks(entry)
    return max(r["held_peak"] for r in ranks) if ranks else None


def rss_peak(entry: Optional[Dict[str, Any]]) -> Optional[float]:
    """Peak resident memory sampled during the measured epoch, max over ranks."""
    ranks = _ok_ranks(entry)
    return max(r["rss_peak"] for r in ranks) if ranks else None


def rss_growth(entry: Optional[Dict[str, Any]]) -> Optional[float]:
    """How far resident memory rose above its level before the measured epoch, max over ranks."""
    ranks = [r for r in _ok_ranks(entry) if r.get("rss_before")]
    return max(r["rss_peak"] - r["rss_before"] for r in ranks) if ranks else None


def _rank_at_peak(entry: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    ranks = _ok_ranks(entry)
    return max(ranks, key=lambda r: r["held_peak"]) if ranks else None


def ledger(entry: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The per-action ledger of the rank with the largest ledger peak (ours only)."""
    ledgers = [r["ledger"] for r in _ok_ranks(entry) if r.get("ledger")]
    return max(ledgers, key=lambda d: d["peak"]) if ledgers else None


def mib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / MiB:,.2f}"


def throughput_cells(memory: Dict[str, Any], variant: str) -> List[str]:
    """The memory columns of a throughput row: held MiB ours / torchrec, RSS MiB ours / torchrec."""
    ours, theirs = memory.get(f"ours:{variant}"), memory.get(f"torchrec:{variant}")
    return [
        mib(held_peak(ours)),
        mib(held_peak(theirs)),
        mib(rss_peak(ours)),
        mib(rss_peak(theirs)),
    ]


THROUGHPUT_HEADER = ["held MiB ours", "held MiB torchrec", "RSS MiB ours", "RSS MiB torchrec"]


def aligned_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> List[str]:
    """``header``, a rule and ``body``: the first column left-aligned, the others right-aligned."""
    widths = [
        max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)
    ]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=False))
        ).rstrip()

    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in body]


def _places(rank: Optional[Dict[str, Any]]) -> str:
    """A rank's bytes at its peak by place (host/device/context/embeddings/other);
    by kind, the batches in one, for results measured before places."""
    if not rank:
        return "-"
    by_place = rank.get("held_by_place")
    if by_place is None:
        return "by kind " + "/".join(mib(rank["held_by_kind"].get(k, 0)) for k in KINDS)
    return "/".join(mib(by_place.get(p, 0)) for p in PLACES)


def _batches(figures: Optional[memory_places.PlaceFigures], place: str) -> str:
    if figures is None:
        return "-"
    return str(figures.host_batches if place == "host" else figures.device_batches)


def _ledger_batches(book: Optional[Dict[str, Any]]) -> str:
    if not book:
        return "-"
    if "max_host_batches" not in book:
        return str(book["max_batches"])
    return f"{book['max_host_batches']}+{book['max_device_batches']}"


def format_memory(
    memory: Dict[str, Any], variants: Sequence[str], batch_size: int, world: int
) -> str:
    """Per variant: held at peak (both libraries, by place), host and device batches
    against torchrec's, ours' ledger, resident memory's rise."""
    body = []
    for variant in variants:
        ours, theirs = memory.get(f"ours:{variant}"), memory.get(f"torchrec:{variant}")
        if ours is None and theirs is None:
            continue
        o, t = held_peak(ours), held_peak(theirs)
        ratio = "-" if o is None or t is None or t == 0 else f"{o / t:.2f}"
        places_o, places_t = memory_places.figures(ours), memory_places.figures(theirs)
        book = ledger(ours)
        body.append(
            [
                variant,
                mib(o) if ours and ours.get("status") == "ok" else "n/a",
                mib(t) if theirs and theirs.get("status") == "ok" else ("n/a" if theirs else "-"),
                ratio,
                _places(_rank_at_peak(ours)),
                _places(_rank_at_peak(theirs)),
                f"{_batches(places_o, 'host')}/{_batches(places_t, 'host')}",
                f"{_batches(places_o, 'device')}/{_batches(places_t, 'device')}",
                memory_places.verdict(places_o, places_t),
                mib(book["peak"]) if book else "-",
                mib(book["steady"]) if book else "-",
                _ledger_batches(book),
                f"{mib(rss_growth(ours))}/{mib(rss_growth(theirs))}",
            ]
        )
    header = [
        "variant",
        "held ours",
        "held torchrec",
        "ours/torchrec",
        "ours " + "/".join(p.split()[0] for p in PLACES),
        "torchrec " + "/".join(p.split()[0] for p in PLACES),
        "host batches o/t",
        "device batches o/t",
        "by place vs torchrec",
        "ledger peak",
        "ledger steady",
        "ledger batches h+d",
        "RSS rise o/t",
    ]
    title = (
        f"Pipeline-held memory at batch {batch_size}/rank x {world} ranks (MiB, largest rank): tensor storage "
        "reachable from the pipeline object after each progress(), model and optimizer excluded, each storage once"
    )
    notes = [
        "  held = the largest over an epoch's steps; by place at that step: host = host batches (pulled from "
        "the iterator, not yet copied to the device), device = device batches (copied, or in the pipeline's "
        "device-side work), then context/embeddings/other; batches = most of each seen after a step (ours/torchrec)",
        "  by place vs torchrec: '<=' holds no more host and no more device batches than torchrec's class; "
        "'+1 host (agreement)' one host batch more, see below; 'ABOVE' more than that",
        "  ledger = ours only, measured after every recorded action, progress()'s local variables included "
        "(the batch being trained, its losses); its peak is within a step, so it can exceed 'held'",
        "  RSS rise = resident memory at its peak during the epoch minus before it (ours/torchrec); the RSS "
        "columns above are the whole process's, every contender's model included",
    ]
    agreement = memory_places.agreement_note(memory, variants)
    if agreement is not None:
        notes.insert(2, agreement)
    return "\n".join([title] + aligned_table(header, body) + notes)


def format_options(rows: Sequence[Dict[str, Any]], batch_size: int) -> str:
    """What each memory option saves on SparseDist, per library, against the same library's baseline."""
    baseline: Dict[str, Optional[float]] = {}
    for row in rows:
        if row["label"] == "none":
            baseline[row["side"]] = held_peak(row)
    body = []
    for row in rows:
        value = held_peak(row)
        base = baseline.get(row["side"])
        saved = "-" if value is None or base is None else mib(base - value)
        kinds = _places(_rank_at_peak(row))
        book = ledger(row)
        body.append(
            [
                row["side"],
                row["label"],
                mib(value) if row["status"] == "ok" else f"n/a: {row['reason'][:60]}",
                saved,
                kinds,
                mib(book["peak"]) if book else "-",
                mib(book["steady"]) if book else "-",
            ]
        )
    title = (
        f"TrainPipelineSparseDist memory options at batch {batch_size}/rank (held MiB at peak, largest rank; "
        "a fresh pipeline per option set)"
    )
    header = [
        "library",
        "options",
        "held",
        "saved vs none",
        "/".join(p.split()[0] for p in PLACES),
        "ledger peak",
        "ledger steady",
    ]
    notes = [
        "  ledger (ours): measured after every action, so it also sees what is freed and re-filled within a "
        "step (clear_data_dist_inputs frees the in-flight all-to-all inputs mid-step)",
        "  these batches' to() copies, as a GPU's host-to-device copy does; with a plain CPU batch the device "
        "batch is the loader's own, which ours never frees (torchrec's free_features_storage_early frees it, "
        "destroying the data for the next epoch); ours' 'other' here is the loader's batches of the steps in "
        "flight, kept to retry a failed step from them: host memory on a GPU, not device memory",
    ]
    return "\n".join([title] + aligned_table(header, body) + notes)


def peak_rss_line(raw: Dict[str, Any]) -> Optional[str]:
    peaks = [p for p in raw.get("peak_rss") or [] if p]
    if not peaks:
        return None
    return "process peak RSS per rank (whole run, every contender): " + ", ".join(
        f"{mib(p)} MiB" for p in peaks
    )


def _asdict(figures: Optional[memory_places.PlaceFigures]) -> Optional[Dict[str, Any]]:
    return None if figures is None else dataclasses.asdict(figures)


def summary(block: Dict[str, Any], variants: Sequence[str]) -> Dict[str, Any]:
    """JSON-ready memory numbers of one throughput block."""
    memory = block.get("memory") or {}
    out: Dict[str, Any] = {"unit": "bytes", "variants": [], "options": []}
    for variant in variants:
        ours, theirs = memory.get(f"ours:{variant}"), memory.get(f"torchrec:{variant}")
        out["variants"].append(
            {
                "variant": variant,
                "ours_held_peak": held_peak(ours),
                "torchrec_held_peak": held_peak(theirs),
                "ours_rss_peak": rss_peak(ours),
                "torchrec_rss_peak": rss_peak(theirs),
                "ours_rss_rise": rss_growth(ours),
                "torchrec_rss_rise": rss_growth(theirs),
                "ours_ledger": ledger(ours),
                "ours_by_place": _asdict(memory_places.figures(ours)),
                "torchrec_by_place": _asdict(memory_places.figures(theirs)),
                "above_torchrec": memory_places.above_torchrec(memory, [variant]).get(variant, []),
            }
        )
    for row in block.get("memory_options") or []:
        out["options"].append(
            {
                "side": row["side"],
                "label": row["label"],
                "held_peak": held_peak(row),
                "ours_ledger": ledger(row),
            }
        )
    return out


def format_stash(memory: Dict[str, Dict[str, Any]], variants: Sequence[str]) -> Optional[str]:
    """What ours' stash variants move to the host and back each step, per rank (None: none ran)."""
    body = []
    for variant in variants:
        ranks = [r.get("stash") for r in _ok_ranks(memory.get(f"ours:{variant}"))]
        plans = [p for p in ranks if p]
        if not plans:
            continue
        body.append(
            [
                variant,
                " / ".join(mib(p["optimizer_state_bytes"]) for p in plans),
                " / ".join(mib(p["embedding_weight_bytes"]) for p in plans),
                " / ".join(",".join(p["embedding_tables"]) or "-" for p in plans),
                "yes" if all(p["moved"] for p in plans) else "no (no streams: host memory already)",
            ]
        )
    if not body:
        return None
    header = ["variant", "optimizer state", "embedding weights", "tables", "moved here"]
    title = (
        "What the stash variants move to the host and back each step (MiB, per rank, rank 0 / rank 1 ...): "
        "computed from the model and optimizer by torchrec's manager's rules (trec_pipelines.StashPlan)"
    )
    notes = [
        "  optimizer state (OptStash): plain tensors of optimizer.state of 1 MiB or more; the fused embedding "
        "optimizers' sharded state stays. embedding weights (EmbStash, PrefetchEMS; their models mark every "
        "table stash_weights): the device weights of the kernels holding a marked table, here their host "
        "weights. On CPU nothing moves and 'held' above equals SparseDist's; on a GPU this much device "
        "memory is free between the stash and the restore, which the ledger does not count (it is the "
        "model's and the optimizer's, not the pipeline's)",
    ]
    return "\n".join([title] + aligned_table(header, body) + notes)


__all__ = [
    "THROUGHPUT_HEADER",
    "format_memory",
    "format_options",
    "format_stash",
    "held_peak",
    "ledger",
    "peak_rss_line",
    "rss_growth",
    "rss_peak",
    "summary",
    "throughput_cells",
]
