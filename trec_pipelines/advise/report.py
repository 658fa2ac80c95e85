"""One variant's row of what advise found: its measurements, its ratios, why not.

Apart from :mod:`trec_pipelines.advise.advice` so that the verdict
(:mod:`trec_pipelines.advise.verdict`) can read rows without importing the
advice that holds its answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class VariantReport:
    """One variant (or the plain loop) as advise measured it.

    Attributes:
        name: the pipeline class name, or ``"plain loop"``.
        applicable: False when the model lacks what it needs (``reason`` says what).
        ran: it trained every round on every rank.
        reason: why it is not applicable; empty otherwise.
        error: the first failure (rank and message) when it did not run.
        seconds: the timed epoch per round, the slowest rank's.
        steps: steps per timed epoch.
        qps: examples (all ranks) per second, median over rounds; steps/s
            when the batches have no KeyedJaggedTensor to count samples by.
        vs_plain: ``qps`` / the plain loop's ``qps`` (ratio of medians, as the bench).
        paired: per round, its ratio to the plain loop of that round.
        band: twice the standard error of ``vs_plain`` over the rounds: the
            ``±`` of the table (None: one round; how the verdict reads it:
            the *Choosing a variant* guide).
        held_peak: the memory ledger's peak bytes held by the pipeline (model
            and optimizer excluded), largest rank.
        held_steady: the same, in the steady state.
        held_host: the ledger's largest bytes in host batches (pulled from the
            iterator, not yet copied to the device: host memory on a GPU),
            largest rank; part of ``held_peak``.
        held_device: the same in device batches (copied, or in the pipeline's
            device-side work: device memory on a GPU).
        rss_peak: largest resident memory after a step of its measured
            epochs, largest rank (the whole process, model included).  The
            contenders run one after another in one process and freed memory
            seldom leaves it, so a later contender's figure includes what
            earlier ones left behind: compare variants by ``held_peak``.
        device_peak: the device allocator's max allocated, largest rank (None on CPU).
        hidden_input_dist: 1 - its training-thread input-dist time per steady
            step / the plain loop's (each the median over steps, then over
            rounds), clipped to [0, 1], mean over ranks.
        unpipelined: sharded modules its rewrite left unpipelined, and why.
        within_budget: whether ``held_peak`` fits the budget (None: no budget).
    """

    name: str
    applicable: bool = True
    ran: bool = False
    reason: str = ""
    error: str = ""
    seconds: Tuple[float, ...] = ()
    steps: int = 0
    qps: Optional[float] = None
    vs_plain: Optional[float] = None
    paired: Tuple[float, ...] = ()
    band: Optional[float] = None
    held_peak: Optional[int] = None
    held_steady: Optional[int] = None
    held_host: Optional[int] = None
    held_device: Optional[int] = None
    rss_peak: Optional[int] = None
    device_peak: Optional[int] = None
    hidden_input_dist: Optional[float] = None
    unpipelined: Tuple[Tuple[str, str], ...] = ()
    within_budget: Optional[bool] = None

    @property
    def status(self) -> str:
        if not self.applicable:
            return "not applicable"
        return "ok" if self.ran else "failed"
