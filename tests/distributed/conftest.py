"""Process-group setup for the distributed tier.

These tests are meant to be launched by torchrun, one pytest process per rank:

    .venv/bin/torchrun --standalone --nproc_per_node=2 \
        -m pytest -q -p no:cacheprovider tests/distributed

Every rank runs the same tests in the same order, so collectives line up.
"""

import gc
import os
import time
import zlib
from datetime import timedelta
from typing import Set

import pytest
import torch
import torch.distributed as dist

from tests.distributed.threads import threads_named
from trec_pipelines.core import lifetime
from trec_pipelines.core.input_dist_group import dedicated_of, release_input_dist_groups
from trec_pipelines.testing import devices

# A collective that never completes (e.g. one rank failed an assert before an
# all-to-all) turns into an error after this long instead of hanging CI.
# Override with TREC_TEST_PG_TIMEOUT=<seconds>.
PG_TIMEOUT = timedelta(seconds=float(os.environ.get("TREC_TEST_PG_TIMEOUT", "120")))

_LAUNCH_HINT = (
    "tests/distributed must be run under torchrun with 2 ranks, e.g.\n"
    "    .venv/bin/torchrun --standalone --nproc_per_node=2 "
    "-m pytest -q -p no:cacheprovider tests/distributed\n"
)


@pytest.fixture(scope="session", autouse=True)
def process_group():
    """Initialise the default process group from torchrun's env vars (gloo on
    CPU, NCCL on CUDA: see trec_pipelines/testing/devices.py)."""
    missing = [
        v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
    ]
    if missing:
        pytest.fail(
            f"not launched by torchrun (missing env vars {missing}). " + _LAUNCH_HINT,
            pytrace=False,
        )
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size < 2:
        pytest.fail(
            f"WORLD_SIZE={world_size}: need at least 2 ranks to exercise "
            "the all-to-alls. " + _LAUNCH_HINT,
            pytrace=False,
        )
    # Two ranks share two cores: one intra-op thread each avoids
    # oversubscription and keeps CPU kernels on a single, stable code path.
    torch.set_num_threads(1)
    # What is alive now (torch, torchrec, pytest and every test module: some
    # 400,000 objects) lives until exit: moved out of the collector's sight, a
    # full collection (the advisor's per contender, the compiled-autograd tests'
    # clean-up, Python's own now and then) takes milliseconds instead of
    # 250-550 ms.  Only objects made before the tests are frozen; the tests'
    # own garbage is collected as before.
    gc.collect()
    gc.freeze()
    created = False
    if not dist.is_initialized():
        devices.bind()
        dist.init_process_group(backend=devices.backend(), init_method="env://", timeout=PG_TIMEOUT)
        created = True
    yield dist.group.WORLD
    if created and dist.is_initialized():
        dist.destroy_process_group()


class _RankBarrier:
    """Meets all ranks through torchrun's TCP store, not through a process
    group, so it still works when a group is wedged or dead, and can wait
    longer than a collective's timeout."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size,
            is_master=False,
            timeout=timedelta(seconds=30),
        )
        self.count = 0

    def any_rank(self, flag: bool, timeout_s: float) -> bool:
        """Whether ``flag`` is true on any rank (every rank calls it, as ``wait``)."""
        self.count += 1
        key = f"trec_pipelines_tests/any/{self.count}"
        self.store.add(key, int(flag))
        self.wait(timeout_s)
        return self.store.add(key, 0) > 0

    def wait(self, timeout_s: float) -> None:
        self.count += 1
        key = f"trec_pipelines_tests/barrier/{self.count}"
        self.store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while self.store.add(key, 0) < self.world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"barrier {self.count}: not every rank arrived")
            time.sleep(0.005)


_barrier = None
_peer_lost = None


# Node ids of the tests whose torchrec reference ran under torchrec_shim.
_shimmed_tests = []


@pytest.fixture(autouse=True)
def per_test_group(process_group, request):
    """A fresh group per test (the default group's backend), used by
    dlrm.make_sharded by default.

    If a test fails on one rank only while the other waits in a collective,
    that collective times out (PG_TIMEOUT) and its group is dead: with a
    single group every later test would fail too ("Connection closed by
    peer").  Instead every test gets a group of its own, and ends with a store
    barrier that waits long enough for a rank stuck in the test's collective
    to time out and catch up.  If a rank never turns up, the remaining tests
    fail at once instead of waiting again.  Only then does the test's group
    go, with every other group the test made: a rank that destroyed them
    sooner (a skipped test is over in milliseconds) would close connections a
    slower rank may still be making in its ``new_group``, which then fails
    with "Gloo connectFullMesh failed ... Connection closed by peer" (seen in
    the 4-rank tier, a test of four ranks failing on one).
    """
    global _barrier
    from trec_pipelines.testing import dlrm, torchrec_cpu as torchrec_shim

    if _peer_lost:
        pytest.fail(_peer_lost, pytrace=False)
    if _barrier is None:
        _barrier = _RankBarrier(dist.get_world_size())
    groups_before = _live_groups()
    group = dist.new_group(backend=devices.backend(), timeout=PG_TIMEOUT)
    dlrm.set_current_group(group)
    shim_entries_before = torchrec_shim.shim_entries()
    yield group
    if torchrec_shim.shim_entries() > shim_entries_before:
        _shimmed_tests.append(request.node.nodeid)
    dlrm.set_current_group(None)
    _meet_every_rank()
    _destroy_groups_made_since(groups_before)


def _meet_every_rank() -> None:
    """The store barrier at a test's end; a rank that never turns up fails the
    remaining tests at once (see per_test_group)."""
    global _peer_lost
    try:
        _barrier.wait(2 * PG_TIMEOUT.total_seconds() + 30)
    except TimeoutError as e:
        _peer_lost = f"another rank stopped responding in the test before ({e})"


# torchrec.distributed.comm's process-wide groups, made on first use and kept.
_TORCHREC_KEPT = ("_INTRA_PG", "_CROSS_PG", "_INTRA_PG_2D", "_CROSS_PG_2D")


def _live_groups() -> Set[dist.ProcessGroup]:
    """The process groups torch knows now (the default one included)."""
    return set(dist.distributed_c10d._world.pg_map)


def _destroy_groups_made_since(groups_before: Set[dist.ProcessGroup]) -> None:
    """Destroy every group made during a test: its own, and any the test made
    itself (a group with a shorter timeout, one per rank pair, ...), with the
    dedicated input_dist groups made for them.

    torch keeps a group until it is destroyed, and a gloo group keeps three
    threads, one of them waking every few milliseconds.  Left to accumulate
    (some 200 groups a rank by the tier's end), they cost the pinned stack's
    2-rank tier a minute of its nine (measured on 2026-11-28: 529 s before,
    469 s after, with 14% less CPU).  The kept compiled-autograd group and
    its dedicated group stay (see ``compiled_autograd_group``), and so do the
    node groups torchrec makes once per process and keeps for every later model
    (``torchrec.distributed.comm``: table-row-wise and 2D sharding use them).
    """
    from torchrec.distributed import comm

    kept = {_compiled_autograd_group} | {getattr(comm, name, None) for name in _TORCHREC_KEPT}
    kept |= {dedicated_of(g) for g in kept if g is not None}
    made = _live_groups() - groups_before - kept
    for group in made:
        release_input_dist_groups(group)
    for group in made:
        lifetime.release_group(group)  # where releasing the others left it standing
    _collect_unreachable_groups()


# gloo's threads of a destroyed group run until the group object is freed, and a
# test's models, pipelines and optimizers often hold theirs in reference cycles
# that only a full collection frees.  Each group keeps a loop thread that wakes
# every few milliseconds: 40 to 70 of them lived on at any time through the
# pinned 2-rank tier, 18% of a system-wide profile's samples (perf, 2026-11-28).
# A full collection walks every object made since the last freeze, so it runs
# only once this many loops beyond those left after the last one have piled up.
_LOOPS_BEYOND_LAST_COLLECTION = 8
_loops_after_collection = 0


def _collect_unreachable_groups() -> None:
    """A full collection, once destroyed groups' loops have piled up (Linux,
    where the threads can be counted by name; elsewhere nothing).

    What outlives it between two tests lives on: the modules the tests imported
    since the session began, and the caches of the compiler, which the
    compiled-autograd tests fill with some 380,000 objects.  It is frozen as
    at the session's start, or every later collection, Python's own included,
    walks it again: 0.4-0.5 s each from the compiled-autograd tests on, 18% of
    each rank's CPU over the pinned 2-rank tier (measured, 2026-11-28).  A
    frozen object is still freed when its last reference goes; only a cycle
    among frozen objects would stay until the session ends.  The kept
    compiled-autograd models are such cycles: they are thawed before they are
    dropped (``_drop_compiled_autograd_group``).  Over the pinned tier a rank
    made as many full collections with the freeze as without it (168), so
    groups' loop threads did not pile up behind frozen cycles.
    """
    global _loops_after_collection
    try:
        loops = threads_named("gloo_tcp_loop")
    except OSError:
        return
    if loops > _loops_after_collection + _LOOPS_BEYOND_LAST_COLLECTION:
        gc.collect()
        gc.freeze()
        _loops_after_collection = threads_named("gloo_tcp_loop")


# The group the compiled-autograd tests build their models on, kept across them
# while they pass (see compiled_autograd_group).
_compiled_autograd_group = None


def _drop_compiled_autograd_group():
    """Drop the kept group and what compiled autograd keeps of models built on it."""
    global _compiled_autograd_group
    group, _compiled_autograd_group = _compiled_autograd_group, None
    if group is None:
        return
    # The compiled graphs keep their models alive: they go while the group exists
    # (thawed first: a collection between tests may have frozen them).
    torch._dynamo.reset()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    release_input_dist_groups(group)
    dist.destroy_process_group(group)


@pytest.fixture(scope="session")
def _compiled_autograd_session(process_group):
    yield
    _drop_compiled_autograd_group()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Each phase's report on the test, for fixtures' teardown to read.
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"_trec_report_{report.when}", report)


@pytest.fixture
def compiled_autograd_group(_compiled_autograd_session, per_test_group, request):
    """The group the compiled-autograd tests build their models on, kept while they pass.

    Compiling a backward takes 15 to 35 s here, nearly all of it dynamo tracing
    the captured graph and AOT autograd (inductor's own work comes from its
    cache).  Compiled autograd keeps what it compiled, keyed by the graph's
    shape, and dynamo checks its guards before reusing it; the only guards a
    new model of the same shape fails are its process group's name (DDP's
    all-reduce, torchrec's all-to-all).  So those models are built on one group
    kept from test to test, and a test that trains one with a backward compiled
    before (another model of the same shape) reuses that compilation instead of
    making its own.  After a test that failed on any rank (the ranks agree
    through the store, as at each test's end) the group is replaced, with
    what was compiled for it: a collective a failed test left waiting cannot
    break the next test, as with ``per_test_group``.
    """
    global _compiled_autograd_group
    if _compiled_autograd_group is None:
        _compiled_autograd_group = dist.new_group(backend=devices.backend(), timeout=PG_TIMEOUT)
    yield _compiled_autograd_group
    failed = any(
        getattr(getattr(request.node, f"_trec_report_{when}", None), "failed", False)
        for when in ("setup", "call")
    )
    if _barrier.any_rank(failed, 2 * PG_TIMEOUT.total_seconds() + 30):
        _drop_compiled_autograd_group()


# Known, understood noise from torchrec 1.8.0 / fbgemm on CPU.  The fbgemm one
# ("autograd kernel was not registered ... silently incorrect") comes from the
# data_parallel tables' dense kernel; test_harness's
# test_sharded_training_matches_unsharded_global_batch shows their gradients
# are right.
_KNOWN_WARNINGS = (
    "ignore:`broadcast_buffers` is deprecated:FutureWarning",
    "ignore:HeuristicalStorageReservation is known to cause issues:FutureWarning",
    "ignore:.*dense_embedding_codegen_lookup_function.*autograd kernel was not registered:UserWarning",
)


def _in_shard(nodeid: str, shard: str) -> bool:
    """Whether a test belongs to ``shard`` ("k/n": the k-th of n parts, from 0).

    The part is a hash of the test's id, so every rank (and every run) picks the
    same tests, and the parts are disjoint and cover the tier.
    """
    index, count = (int(x) for x in shard.split("/"))
    if not 0 <= index < count:
        raise pytest.UsageError(f"TREC_TEST_SHARD={shard!r}: want k/n with 0 <= k < n")
    return zlib.crc32(nodeid.encode()) % count == index


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.path).startswith(here + os.sep):
            for spec in _KNOWN_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(spec))
    # TREC_TEST_SHARD=k/n runs one part of the tier (deselecting the rest), e.g. a
    # part of the 4-rank tier (Makefile: DIST4_SHARD).
    shard = os.environ.get("TREC_TEST_SHARD", "")
    if shard:
        kept = [item for item in items if _in_shard(item.nodeid, shard)]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say which torchrec references needed the CPU shim, and what it patched."""
    # Every rank runs the same tests; one list is enough.
    if not _shimmed_tests or os.environ.get("RANK") != "0":
        return
    import torchrec

    from trec_pipelines.testing import torchrec_cpu as torchrec_shim

    write = terminalreporter.write_line
    write(
        f"{len(_shimmed_tests)} tests ran torchrec {torchrec.__version__}'s "
        "reference under trec_pipelines/testing/torchrec_cpu.py (torchrec's side only), patching:"
    )
    for patch in torchrec_shim.patches():
        write(f"    {patch}")
    for nodeid in _shimmed_tests:
        write(f"    shimmed reference: {nodeid}")
