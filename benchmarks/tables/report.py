"""The throughput tables: measured epoch times turned into examples/s, ratios and their text.

The runner hands over *raw* measurements (seconds per timed epoch, per
contender); everything derived (examples/s, medians, ratios, the bound and
the hidden input dist, per-step overhead) is computed here or in the modules
it calls, so it can be tested without running anything.

Raw layout (plain JSON types only)::

    {"world": 2, "cores": 2, "link_gbit": 1.0 or None,
     "throughput": [{"batch_size": 512, "steps": 16,
                     "contenders": {key: Entry, ...},
                     "stages": [StageRecord, ...],
                     "recorded": {variant: [recorded epoch per rank]},
                     "validation": {"status": "ok"|"n/a", "reason": str, "passes": 25,
                                    "batches": 16, "us_per_batch": [[us per pass], ...]}}],
     "overhead": {"batch_size": 32, "steps": 60, "contenders": {key: Entry}} or None}

    Entry = {"variant": name or "plain", "side": "ours"|"torchrec"|"plain",
             "mode": "train"|"eval"|"staged", "shimmed": bool,
             "status": "ok"|"n/a", "reason": str, "seconds": [epoch seconds, ...]}

``"validation"`` is ``batch_problem``'s time per batch on the block's epoch
batches, one list per rank (absent in results from before it was measured).

``stages`` (the stage probe's epochs) and ``recorded`` (a recorded epoch per
variant of ours) feed the bound; their layout and lines are in
:mod:`benchmarks.tables.bound_report`.  With ``--memory`` a block also has
``"memory"`` and ``"memory_options"`` and the raw results ``"peak_rss"``;
their layout and tables are in :mod:`benchmarks.tables.memory_report`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.settings.variants import COMPILED_VARIANTS
from benchmarks.tables import bound_report, memory_report
from benchmarks.tables.memory_report import aligned_table

OK, NA = "ok", "n/a"


# --------------------------------------------------------------------------
# Derived numbers
# --------------------------------------------------------------------------


@dataclass
class Measure:
    """One contender at one configuration: examples/s per repeat, or why there is none."""

    status: str
    reason: str = ""
    shimmed: bool = False
    samples: List[float] = field(default_factory=list)  # examples/s (or ms/step) per repeat
    compiles: Optional[int] = None  # graphs compiled during the timed epochs, when counted

    @property
    def median(self) -> Optional[float]:
        return statistics.median(self.samples) if self.status == OK and self.samples else None

    @property
    def spread(self) -> Optional[float]:
        """(max - min) / median over the repeats: how much the machine moved."""
        m = self.median
        if m is None or m == 0 or len(self.samples) < 2:
            return None
        return (max(self.samples) - min(self.samples)) / m


@dataclass
class Row:
    variant: str
    mode: str
    ours: Measure
    torchrec: Measure
    plain: Measure

    @property
    def ours_vs_torchrec(self) -> Optional[float]:
        return _ratio(self.ours.median, self.torchrec.median)

    @property
    def paired(self) -> Optional[float]:
        """Median over rounds of (ours / torchrec) within the same round.

        The two run back to back in every round, so drift of the machine that
        spans rounds cancels out; under a noisy load this is the steadier ratio.
        """
        o, t = self.ours, self.torchrec
        if o.median is None or t.median is None or len(o.samples) != len(t.samples):
            return None
        return statistics.median(a / b for a, b in zip(o.samples, t.samples, strict=True))

    @property
    def ours_vs_plain(self) -> Optional[float]:
        return _ratio(self.ours.median, self.plain.median)

    @property
    def torchrec_vs_plain(self) -> Optional[float]:
        return _ratio(self.torchrec.median, self.plain.median)


@dataclass
class ValidationCost:
    """What ``validate_batches=True`` costs per step at one batch size.

    ``us_per_batch`` is ``batch_problem``'s time per batch on the epoch's
    batches (median over passes, slowest rank); ``step_ms`` ours
    TrainPipelineSparseDist's ms/step at the same batch size (median over
    rounds; None when it was not measured), which already includes that cost.
    """

    status: str
    reason: str = ""
    us_per_batch: Optional[float] = None
    rank_us: List[float] = field(default_factory=list)  # each rank's median
    passes: int = 0
    batches: int = 0
    step_ms: Optional[float] = None

    @property
    def percent_of_step(self) -> Optional[float]:
        """``us_per_batch`` in % of ``step_ms`` (one batch per step), or None without both."""
        if self.us_per_batch is None or not self.step_ms:
            return None
        return 100 * (self.us_per_batch / 1e3) / self.step_ms


# The target for the cost of batch validation, in % of SparseDist's step.
VALIDATION_TARGET_PERCENT = 1.0


@dataclass
class ThroughputTable:
    batch_size: int
    steps: int
    world: int
    rows: List[Row]
    plain: Dict[str, Measure]  # mode -> plain loop
    bound: Optional[bound_report.BoundReport]
    memory: Dict[str, Any] = field(default_factory=dict)  # the block's raw "memory"
    memory_options: List[Dict[str, Any]] = field(default_factory=list)
    validation: Optional[ValidationCost] = None


# Key suffix of our pipeline run with validate_batches=False (the overhead phase only).
UNVALIDATED = "+unvalidated"
# Row-label suffix of our pipeline run with sync_exhaustion=False (--agreement-off).
NO_AGREEMENT = "[no agreement]"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _missing(reason: str) -> Measure:
    return Measure(status=NA, reason=reason)


def _measure(
    entry: Optional[Dict[str, Any]], per_epoch: float, inverse: bool, absent: str
) -> Measure:
    """examples/s (``per_epoch / seconds``) or ms/step (``seconds / per_epoch``) per repeat."""
    if entry is None:
        return _missing(absent)
    if entry["status"] != OK or not entry["seconds"]:
        return Measure(
            status=NA,
            reason=entry.get("reason", "") or "no timed epoch",
            shimmed=entry.get("shimmed", False),
        )
    if inverse:
        samples = [1e3 * s / per_epoch for s in entry["seconds"]]
    else:
        samples = [per_epoch / s for s in entry["seconds"]]
    return Measure(
        status=OK,
        shimmed=entry.get("shimmed", False),
        samples=samples,
        compiles=entry.get("compiles"),
    )


def _plain_mode(mode: str) -> str:
    return "eval" if mode == "eval" else "train"


def _variants(contenders: Dict[str, Dict[str, Any]]) -> List[Tuple[str, str]]:
    seen: Dict[str, str] = {}
    for entry in contenders.values():
        if entry["side"] in ("ours", "torchrec") and entry["variant"] not in seen:
            seen[entry["variant"]] = entry["mode"]
    return list(seen.items())


def _base(contenders: Dict[str, Dict[str, Any]], variant: str) -> str:
    """The class name behind a row label (a twin row "<Variant> [shared]" is <Variant>'s)."""
    entry = contenders.get(f"ours:{variant}") or {}
    return str(entry.get("base_variant") or variant)


def throughput_tables(raw: Dict[str, Any]) -> List[ThroughputTable]:
    world = raw["world"]
    tables = []
    for block in raw["throughput"]:
        bs, steps, contenders = block["batch_size"], block["steps"], block["contenders"]
        per_epoch = float(steps * bs * world)
        plain = {
            mode: _measure(contenders.get(f"plain:{mode}"), per_epoch, False, "not run")
            for mode in ("train", "eval")
            if f"plain:{mode}" in contenders
        }
        rows = []
        for variant, mode in _variants(contenders):
            rows.append(
                Row(
                    variant=variant,
                    mode=mode,
                    ours=_measure(contenders.get(f"ours:{variant}"), per_epoch, False, "not run"),
                    torchrec=_measure(
                        contenders.get(f"torchrec:{_base(contenders, variant)}"),
                        per_epoch,
                        False,
                        "torchrec has no class of this name",
                    ),
                    plain=plain.get(_plain_mode(mode), _missing("not run")),
                )
            )
        achieved = [(r.variant, r.mode, r.ours.median, r.torchrec.median) for r in rows]
        bound = bound_report.bound_report(
            block,
            achieved,
            plain["train"].median if "train" in plain else None,
            world,
            raw.get("cores"),
            raw.get("link_gbit"),
        )
        tables.append(
            ThroughputTable(
                bs,
                steps,
                world,
                rows,
                plain,
                bound,
                memory=block.get("memory") or {},
                memory_options=block.get("memory_options") or [],
                validation=_validation(block),
            )
        )
    return tables


def _validation(block: Dict[str, Any]) -> Optional[ValidationCost]:
    raw = block.get("validation")
    if raw is None:
        return None
    sparse_dist = _measure(
        block["contenders"].get("ours:TrainPipelineSparseDist"), block["steps"], True, "not run"
    )
    passes, batches = raw.get("passes", 0), raw.get("batches", 0)
    ranks = [statistics.median(samples) for samples in raw.get("us_per_batch") or [] if samples]
    if raw["status"] != OK or not ranks:
        reason = raw.get("reason", "") or "not measured"
        return ValidationCost(
            status=NA, reason=reason, passes=passes, batches=batches, step_ms=sparse_dist.median
        )
    return ValidationCost(
        status=OK,
        us_per_batch=max(ranks),
        rank_us=ranks,
        passes=passes,
        batches=batches,
        step_ms=sparse_dist.median,
    )


# --------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------


def _num(value: Optional[float], digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _qps_cell(m: Measure, notes: List[str]) -> str:
    if m.median is None:
        notes.append(m.reason or "not run")
        return f"n/a [{len(notes)}]"
    spread = f" ±{100 * m.spread / 2:.0f}%" if m.spread is not None else ""
    return _num(m.median) + spread + (" (shimmed)" if m.shimmed else "")


def _ratio_cell(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_throughput(table: ThroughputTable, repeats: int) -> str:
    notes: List[str] = []
    body = []
    for row in table.rows:
        body.append(
            [
                row.variant + (" (eval)" if row.mode == "eval" else ""),
                _qps_cell(row.ours, notes),
                _qps_cell(row.torchrec, notes),
                _ratio_cell(row.ours_vs_torchrec),
                _ratio_cell(row.paired),
                _ratio_cell(row.ours_vs_plain),
                _ratio_cell(row.torchrec_vs_plain),
            ]
            + (memory_report.throughput_cells(table.memory, row.variant) if table.memory else [])
        )
    extra = len(memory_report.THROUGHPUT_HEADER) if table.memory else 0
    for mode, m in table.plain.items():
        body.append(
            [f"plain loop ({mode})", _qps_cell(m, notes), "", "", "", "", ""] + [""] * extra
        )
    title = (
        f"Throughput at batch {table.batch_size}/rank x {table.world} ranks: global examples/s, "
        f"median of {repeats} repeats of {table.steps}-step epochs (± half the max-min spread)"
    )
    header = [
        "variant",
        "ours",
        "torchrec",
        "ours/torchrec",
        "paired",
        "ours/plain",
        "torchrec/plain",
    ]
    if table.memory:
        header += memory_report.THROUGHPUT_HEADER
    lines = [title] + aligned_table(header, body)
    lines.append(
        "  ratios are of medians; 'paired' = median over rounds of ours/torchrec within a round "
        "(the two run back to back, in alternating order, so machine drift cancels)"
    )
    lines += [f"  [{i}] {reason}" for i, reason in enumerate(notes, 1)]
    if table.memory:
        lines.append(
            "  held MiB = pipeline-held tensor storage at peak (after a progress(), largest rank); "
            "RSS MiB = process resident memory at peak during that epoch (see the memory table below)"
        )
    if table.bound is not None:
        lines += ["", bound_report.format_bound(table.bound, aligned_table)]
    lines += format_recompiles(table)
    if table.validation is not None:
        lines.append(format_validation(table.validation, table.world))
    if table.memory:
        variants = [row.variant for row in table.rows]
        lines += [
            "",
            memory_report.format_memory(table.memory, variants, table.batch_size, table.world),
        ]
        stash = memory_report.format_stash(table.memory, variants)
        if stash is not None:
            lines += ["", stash]
    if table.memory_options:
        lines += ["", memory_report.format_options(table.memory_options, table.batch_size)]
    return "\n".join(lines)


def format_recompiles(table: ThroughputTable) -> List[str]:
    """For compiled variants: graphs compiled during the timed epochs (0 = no recompilation)."""
    lines = []
    for row in table.rows:
        counts = {
            side: m.compiles
            for side, m in (("ours", row.ours), ("torchrec", row.torchrec))
            if m.compiles is not None
        }
        if row.variant in COMPILED_VARIANTS and counts:
            shown = ", ".join(f"{side} {n}" for side, n in counts.items())
            lines.append(
                f"  {row.variant}: graphs compiled during the timed epochs (after warm-up): {shown}"
            )
    return lines


def format_validation(cost: ValidationCost, world: int) -> str:
    """Batch validation's time per batch and its share of SparseDist's step, then how it was measured."""
    if cost.us_per_batch is None:
        return f"batch validation (validate_batches=True): n/a ({cost.reason})"
    percent = cost.percent_of_step
    if percent is None:
        share = " (TrainPipelineSparseDist's step not measured, so no share of it)"
    else:
        shown = f"{percent:.2f}%" if percent >= 0.01 else "<0.01%"
        share = f" = {shown} of TrainPipelineSparseDist's step ({cost.step_ms:.2f} ms)"
        if percent >= VALIDATION_TARGET_PERCENT:
            share += f", ABOVE the {VALIDATION_TARGET_PERCENT:g}% target"
    ranks = f"slowest of {world} ranks" if world > 1 else "one rank"
    return (
        f"batch validation (validate_batches=True): {cost.us_per_batch:.1f} us/batch{share}\n"
        f"  batch_problem alone on the epoch's {cost.batches} batches, median of {cost.passes} "
        f"passes outside the timed epochs, {ranks}"
    )


# --------------------------------------------------------------------------
# JSON-ready summary
# --------------------------------------------------------------------------


# --------------------------------------------------------------------------
# Versions and host facts
# --------------------------------------------------------------------------
