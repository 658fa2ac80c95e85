"""The ranks' shared state during a run: the progress bar and the session that builds and times contenders in lockstep.

:class:`Session` runs each build and epoch on every rank, guarded (a failure on
one rank is every rank's failure, so no rank waits in a collective the others
left), and keeps the errors and the compile counts.
"""

from __future__ import annotations

import datetime
import gc
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from benchmarks.contenders.build import (
    Contender,
)
from benchmarks.contenders.stage_probe import StageProbe, combine_stage_times
from benchmarks.settings.config import BenchConfig
from benchmarks.tables import report
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm_spec import ModelSpec


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
        # CPU seconds every rank process was charged during the last epoch() (every
        # thread, user and kernel time), added over ranks: [Note: the measured CPU]
        # in benchmarks/measuring/schedule_bound.py.
        self.last_cpu_seconds = 0.0

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

        def do() -> Tuple[float, Dict[str, float], int, float]:
            gc.collect()  # nobody pays for the garbage of the contender before
            dist.barrier()
            if not self.active:
                return 0.0, {}, 0, 0.0
            compiled_before = graphs_compiled()
            start, cpu_start = time.perf_counter(), time.process_time()
            contender.run_epoch(batches)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            stages = contender.last.as_dict() if isinstance(contender, StageProbe) else {}
            return seconds, stages, graphs_compiled() - compiled_before, cpu

        err, values = self.guarded(contender.key, do)
        self.last_compiles = 0
        self.last_cpu_seconds = 0.0
        if err is not None:
            return err, 0.0, {}
        seconds = max(v[0] for v in values)
        self.last_compiles = max(v[2] for v in values)
        self.last_cpu_seconds = sum(v[3] for v in values)
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


def new_entry(contender: Contender) -> Dict[str, Any]:
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
