"""The overhead table: each pipeline's per-step cost over the plain loop on the tiny model.

Built from the raw ``"overhead"`` block (layout in :mod:`benchmarks.tables.report`): per
contender its ms/step and, paired within each round, its overhead over the plain loop
doing the same work (the compiled variants' own plain loop where there is one).
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from benchmarks.settings.variants import COMPILED_PLAIN
from benchmarks.tables.memory_report import aligned_table
from benchmarks.tables.report import (
    UNVALIDATED,
    _measure,
    _num,
    _plain_mode,
    _variants,
)


@dataclass
class OverheadRow:
    variant: str
    mode: str
    ours_ms: Optional[float]
    torchrec_ms: Optional[float]
    plain_ms: Optional[float]
    ours_note: str = ""
    torchrec_note: str = ""
    # Why a side has no figure (shown as a numbered note under the table).
    ours_reason: str = ""
    torchrec_reason: str = ""
    # The plain loop the overhead is taken against: "train", "eval", or for a
    # compiled variant "train+<its compiled work>" (COMPILED_PLAIN).
    reference: str = "train"
    # ms/step per round (same order for every contender), for the paired overheads.
    ours_samples: List[float] = field(default_factory=list)
    torchrec_samples: List[float] = field(default_factory=list)
    plain_samples: List[float] = field(default_factory=list)

    def _overhead(self, ms: Optional[float], samples: List[float]) -> Optional[float]:
        # Paired: per round, the contender's ms/step minus the plain loop's in
        # the same round, then the median; drift between rounds cancels.
        if samples and len(samples) == len(self.plain_samples):
            return statistics.median(
                a - b for a, b in zip(samples, self.plain_samples, strict=True)
            )
        return None if ms is None or self.plain_ms is None else ms - self.plain_ms

    @property
    def ours_overhead(self) -> Optional[float]:
        return self._overhead(self.ours_ms, self.ours_samples)

    @property
    def torchrec_overhead(self) -> Optional[float]:
        return self._overhead(self.torchrec_ms, self.torchrec_samples)

    @property
    def overhead_ratio(self) -> Optional[float]:
        """ours / torchrec overhead; only meaningful when torchrec's is positive."""
        ours, theirs = self.ours_overhead, self.torchrec_overhead
        if ours is None or theirs is None or theirs <= 0:
            return None
        return ours / theirs


@dataclass
class OverheadTable:
    batch_size: int
    steps: int
    rows: List[OverheadRow]
    plain_ms: Dict[str, Optional[float]]


def overhead_table(raw: Dict[str, Any]) -> Optional[OverheadTable]:
    block = raw.get("overhead")
    if not block:
        return None
    steps, contenders = block["steps"], block["contenders"]
    # Every plain loop of the phase, by what follows "plain:" in its key.
    plain_measures = {
        key.split(":", 1)[1]: _measure(entry, steps, True, "not run")
        for key, entry in contenders.items()
        if entry["side"] == "plain"
    }
    plain = {reference: m.median for reference, m in plain_measures.items()}
    rows = []
    for variant, mode in _variants(contenders):
        ours = _measure(contenders.get(f"ours:{variant}"), steps, True, "not run")
        theirs = _measure(
            contenders.get(f"torchrec:{variant}"), steps, True, "torchrec has no class of this name"
        )
        references = [_plain_mode(mode)]
        if variant in COMPILED_PLAIN and f"train+{COMPILED_PLAIN[variant]}" in plain_measures:
            references.append(f"train+{COMPILED_PLAIN[variant]}")
        unvalidated = contenders.get(f"ours:{variant}{UNVALIDATED}")
        runs = [(variant, ours)]
        if unvalidated is not None:
            runs.append(
                (
                    f"{variant}, validate_batches=False",
                    _measure(unvalidated, steps, True, "not run"),
                )
            )
        for (label, ours), reference in itertools.product(runs, references):
            rows.append(
                OverheadRow(
                    variant=label,
                    mode=mode,
                    ours_ms=ours.median,
                    torchrec_ms=theirs.median,
                    plain_ms=plain.get(reference),
                    ours_note="" if ours.median is not None else "n/a",
                    torchrec_note="(shimmed)"
                    if theirs.shimmed
                    else ("" if theirs.median is not None else "n/a"),
                    ours_reason="" if ours.median is not None else ours.reason,
                    torchrec_reason="" if theirs.median is not None else theirs.reason,
                    reference=reference,
                    ours_samples=list(ours.samples),
                    torchrec_samples=list(theirs.samples),
                    plain_samples=list(plain_measures[reference].samples)
                    if reference in plain_measures
                    else [],
                )
            )
    return OverheadTable(block["batch_size"], steps, rows, plain)


def _reference_cell(reference: str) -> str:
    """A plain loop's name in the overhead table: "train", "eval", "train, compiled autograd"."""
    return reference.replace("+", ", ")


def format_overhead(table: OverheadTable, repeats: int) -> str:
    body = []
    notes: List[str] = []

    def cell(ms: Optional[float], note: str, reason: str) -> str:
        if reason:
            if reason not in notes:
                notes.append(reason)
            note = f"{note} [{notes.index(reason) + 1}]"
        return _num(ms, 2) + (f" {note}" if note else "")

    for row in table.rows:
        ratio = row.overhead_ratio
        body.append(
            [
                row.variant + (" (eval)" if row.mode == "eval" else ""),
                cell(row.ours_ms, row.ours_note, row.ours_reason),
                cell(row.torchrec_ms, row.torchrec_note, row.torchrec_reason),
                _reference_cell(row.reference),
                _num(row.ours_overhead, 2),
                _num(row.torchrec_overhead, 2),
                "-" if ratio is None else f"{ratio:.2f}",
            ]
        )
    plain = ", ".join(
        f"{_reference_cell(mode)} {_num(v, 2)} ms" for mode, v in table.plain_ms.items()
    )
    title = (
        f"Per-step overhead on the tiny model (rank 0 alone on a one-rank group, batch {table.batch_size}, "
        f"{table.steps}-step epochs, {repeats} rounds): ms/step (median), and overhead = median over rounds "
        f"of ms/step minus the plain loop's in the same round (plain loops: {plain}). A compiled variant "
        "has a second row against the plain loop running the same compiled code, which leaves the "
        "pipeline's own work"
    )
    return "\n".join(
        [title]
        + aligned_table(
            [
                "variant",
                "ours ms/step",
                "torchrec ms/step",
                "against",
                "ours overhead",
                "torchrec overhead",
                "ours/torchrec",
            ],
            body,
        )
        + [f"  [{i}] {reason}" for i, reason in enumerate(notes, 1)]
    )
