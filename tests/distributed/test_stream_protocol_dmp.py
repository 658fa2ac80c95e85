"""The stream protocol of every variant on real sharded models (DistributedModelParallel).

``tests/unit/test_stream_protocol.py`` checks each variant's streams on stand-in
modules; here the same checker (:mod:`trec_pipelines.testing`) watches the
pipelines drive torchrec's own sharded modules over the process group: the
input_dist's splits and tensors all-to-alls, the fused TBE lookup and its
update inside the backward, the output all-to-all, for an
EmbeddingBagCollection with weighted features, an EmbeddingCollection and the
tests' DLRM, sharded table-, row- and column-wise.  A recording runs each
pipeline on a stand-in device with streams (the tensors stay on the CPU) and
replays what a GPU would order; see the stream-protocol guide.

Not here: EvalPipelineCPUSparse, which pins its host lookups for a device
with streams, and the stand-in has no pinned memory (its streams are checked in
the unit tier).

Runs on any number of ranks (the plans are made for the group's world size):
2 in the distributed tier, 4 in the 4-rank tier.  Few batches, small tables.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import (  # type: ignore[attr-defined]
    _apply_optimizer_in_backward as apply_optimizer_in_backward,
)
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

import trec_pipelines
from tests.unit.test_stream_protocol import train_staged_with_sdd_stages
from trec_pipelines.pipelines.pt2 import TorchCompileConfig
from trec_pipelines.sparse import forwards as forwards_module
from trec_pipelines.sparse.stashing import Stashing
from trec_pipelines.testing import (
    StreamRecorder,
    check_stream_protocol,
    devices,
    host_memory_of,
    summarize,
)
from trec_pipelines.testing.dlrm import (
    DLRM,
    FieldwiseBatch,
    current_group,
    make_batches,
    make_sharded,
    run_pipeline,
)
from trec_pipelines.testing.stream_records import OpRecord

DEVICE = devices.device()
N_BATCHES = 4
SEED = 11

pytestmark = devices.cpu_only("the stream recording stands in for a GPU's streams")

# ------------------------------------------------------------------ models


@dataclass
class TowersBatch(FieldwiseBatch):
    dense: torch.Tensor
    user: KeyedJaggedTensor  # weighted ids
    seq: KeyedJaggedTensor  # sequence ids
    labels: torch.Tensor


class Towers(nn.Module):
    """A weighted EmbeddingBagCollection and an EmbeddingCollection over a dense tower."""

    def __init__(self) -> None:
        super().__init__()
        self.user = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="u0", embedding_dim=8, num_embeddings=40, feature_names=["u0"]
                ),
                EmbeddingBagConfig(
                    name="u1", embedding_dim=8, num_embeddings=30, feature_names=["u1"]
                ),
            ],
            is_weighted=True,
            device=DEVICE,
        )
        self.seq = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name="s0", embedding_dim=8, num_embeddings=50, feature_names=["s0"])
            ],
            device=DEVICE,
        )
        self.dense = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.over = nn.Linear(8 + 8 + 8, 1)

    def forward(self, batch: TowersBatch) -> Tuple[torch.Tensor, torch.Tensor]:
        user, seq = self.user(batch.user), self.seq(batch.seq)
        seq_summary = seq["s0"].values().sum(0, keepdim=True).expand(batch.labels.size(0), 8)
        x = torch.cat([self.dense(batch.dense), user["u0"] + user["u1"], seq_summary], 1)
        logits = self.over(x).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def towers_batches(n: int = N_BATCHES, size: int = 6) -> List[TowersBatch]:
    g = torch.Generator().manual_seed(3 + dist.get_rank())

    def kjt(keys: List[str], max_len: int, rows: int, weighted: bool) -> KeyedJaggedTensor:
        lengths = torch.randint(0, max_len + 1, (len(keys) * size,), generator=g)
        values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
        w = torch.rand(int(lengths.sum()), generator=g) if weighted else None
        return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=w)

    return [
        TowersBatch(
            torch.rand(size, 4, generator=g),
            kjt(["u0", "u1"], 3, 30, weighted=True),
            kjt(["s0"], 4, 50, weighted=False),
            torch.randint(0, 2, (size,), generator=g).float(),
        )
        for _ in range(n)
    ]


def _spec(sharding_type: str, index: int, world: int) -> Any:
    if sharding_type == "table_wise":
        return table_wise(rank=index % world, compute_kernel="fused")
    if sharding_type == "row_wise":
        return row_wise(compute_kernel="fused")
    assert sharding_type == "column_wise"
    return column_wise(ranks=[0, world - 1], compute_kernel="fused")


def towers(sharding_type: str) -> Tuple[DistributedModelParallel, CombinedOptimizer]:
    """:class:`Towers` sharded by an explicit plan (row_wise has no planner path on CPU)."""
    torch.manual_seed(SEED)
    model = Towers()
    for module in (model.user, model.seq):
        apply_optimizer_in_backward(torch.optim.Adagrad, module.parameters(), {"lr": 0.1})
    pg = current_group()
    world = dist.get_world_size(pg)

    def module_plan(module: nn.Module, tables: List[str]) -> Any:
        return construct_module_sharding_plan(
            module,
            {t: _spec(sharding_type, i, world) for i, t in enumerate(tables)},
            world_size=world,
            local_size=world,
            device_type=DEVICE.type,
        )

    plan = ShardingPlan(
        {"user": module_plan(model.user, ["u0", "u1"]), "seq": module_plan(model.seq, ["s0"])}
    )
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(pg),
        device=DEVICE,
        plan=plan,
        sharders=[EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()],  # type: ignore[list-item]
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=0.05),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


@dataclass(frozen=True)
class Model:
    build: Callable[[], Tuple[nn.Module, Any]]
    batches: Callable[[], List[Any]]


MODELS: Dict[str, Model] = {
    **{
        f"towers-{s}": Model(lambda s=s: towers(s), towers_batches)  # type: ignore[misc]
        for s in ("table_wise", "row_wise", "column_wise")
    },
    # The tests' DLRM (an EmbeddingBagCollection), whose sites the experimental classes name.
    "dlrm-table_wise": Model(
        lambda: make_sharded(DLRM, "table_wise", seed=SEED),
        lambda: make_batches(N_BATCHES, seed=SEED),
    ),
}

# ---------------------------------------------------------------- variants


@dataclass(frozen=True)
class Variant:
    """How to build one variant on ``(dmp, optimizer)``, and the side streams it must use."""

    make: Callable[[nn.Module, Any], Any]
    side_streams: Tuple[str, ...]
    # Side streams the variant makes that these models leave without work: the
    # fused CPU kernels have no cache to prefetch into.
    idle: Tuple[str, ...] = ()


def _named(name: str, **kwargs: Any) -> Callable[[nn.Module, Any], Any]:
    return lambda dmp, optimizer: getattr(trec_pipelines, name)(dmp, optimizer, DEVICE, **kwargs)


def _evaluating(name: str, **kwargs: Any) -> Callable[[nn.Module, Any], Any]:
    return lambda dmp, _: getattr(trec_pipelines, name)(dmp.eval(), None, DEVICE, **kwargs)


def _without_stashing(make: Callable[[nn.Module, Any], Any]) -> Callable[[nn.Module, Any], Any]:
    # On the stand-in device (it has streams) the stash variants would hand the
    # recording's streams to torchrec's global MemoryStashingManager; what is
    # checked is ours: the stash points and their streams.
    def build(dmp: nn.Module, optimizer: Any) -> Any:
        with mock.patch("trec_pipelines.pipelines.stash.stashing_for", lambda *_: Stashing()):
            return make(dmp, optimizer)

    return build


MAIN = ("memcpy", "data_dist")
VARIANTS: Dict[str, Variant] = {
    "Base": Variant(_named("TrainPipelineBase"), ("memcpy",)),
    "PT2": Variant(
        _named("TrainPipelinePT2", compile_configs=TorchCompileConfig(compile_on_iter=10**6)), ()
    ),
    "SparseDist": Variant(_named("TrainPipelineSparseDist"), MAIN),
    "SparseDistLite": Variant(_named("TrainPipelineSparseDistLite"), ("memcpy",)),
    "Fused-data_dist": Variant(_named("TrainPipelineFusedSparseDist"), MAIN),
    "Fused-new": Variant(
        _named("TrainPipelineFusedSparseDist", emb_lookup_stream="new"), (*MAIN, "emb_lookup")
    ),
    "SemiSync": Variant(_named("TrainPipelineSemiSync", start_batch=1), MAIN),
    "Prefetch": Variant(_named("PrefetchTrainPipelineSparseDist"), MAIN, idle=("prefetch",)),
    "PEC": Variant(_named("TrainPipelinePEC"), MAIN),
    "EvalSparseDist": Variant(_evaluating("EvalPipelineSparseDist"), MAIN),
    "EvalFused": Variant(
        _evaluating("EvalPipelineFusedSparseDist", emb_lookup_stream="new"),
        (*MAIN, "emb_lookup"),
    ),
    "EvalFused-prefetch": Variant(
        _evaluating(
            "EvalPipelineFusedSparseDist",
            emb_lookup_stream="new",
            enable_embedding_lookup_prefetch=True,
        ),
        (*MAIN, "emb_lookup"),
    ),
}
# torchrec's experimental classes, on the DLRM their sites name.
EXPERIMENTAL: Dict[str, Variant] = {
    "SparseDistT": Variant(_named("TrainPipelineSparseDistT"), MAIN),
    "BwdOpt": Variant(_named("TrainPipelineSparseDistBwdOpt", site_fqn="ebc"), MAIN),
    "TrainEvalHybrid": Variant(_named("TrainEvalHybridPipelineBase"), MAIN),
    "OptStash": Variant(
        _without_stashing(_named("TrainPipelineSparseDistOptStash", site_fqn="ebc")), MAIN
    ),
    "EmbStash": Variant(
        _without_stashing(_named("TrainPipelineSparseDistEmbStash", site_fqn="over_arch")), MAIN
    ),
    "PrefetchEMS": Variant(
        _without_stashing(_named("TrainPipelinePrefetchEMS", site_fqn="over_arch")), MAIN
    ),
}

# --------------------------------------------------------------- recording


def record(
    model: Model,
    variant: Variant,
    patch: Callable[[], Any] = contextlib.nullcontext,
    host_memory: bool = True,
) -> StreamRecorder:
    """Run ``variant`` on ``model`` to the end of its batches inside a recording."""
    dmp, optimizer = model.build()  # before the recording: the tables are external memory
    batches = model.batches()
    held = host_memory_of(dmp) if host_memory else []
    with StreamRecorder(host_memory=held) as recorder, patch():
        pipeline = recorder.watch(variant.make(dmp, optimizer))
        run = run_pipeline(pipeline, batches, model=dmp)
        assert len(run) == len(batches)
        # Dropped inside the recording: its last frees are recorded too.
        del pipeline, run
    return recorder


def assert_clean(recorder: StreamRecorder, variant: Variant) -> None:
    """Every rule holds, and the run crossed streams (or the clean check says nothing)."""
    recorder.assert_protocol()
    summary = summarize(recorder)
    assert set(summary.ops) <= {"default", *variant.side_streams, *variant.idle}, summary.ops
    for stream in variant.side_streams:
        assert summary.ops.get(stream, 0) > 0, f"no kernel ran on '{stream}': {summary.ops}"
    if variant.side_streams:
        assert summary.cross_stream_accesses > 0 and summary.waits > 0, summary
        assert summary.record_streams > 0 and summary.handed_over_frees > 0, summary


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_on_a_weighted_ebc_and_an_ec_table_wise(name: str) -> None:
    assert_clean(record(MODELS["towers-table_wise"], VARIANTS[name]), VARIANTS[name])


# The variants whose streams differ by sharding: input_dist's all-to-alls (rw
# buckets ids, cw replicates them), the output all-to-all and its reduction.
BY_SHARDING = ["SparseDist", "Fused-data_dist", "SemiSync", "Prefetch", "EvalFused-prefetch"]


@pytest.mark.parametrize("name", BY_SHARDING)
@pytest.mark.parametrize("model", ["towers-row_wise", "towers-column_wise"])
def test_variant_by_sharding_type(model: str, name: str) -> None:
    assert_clean(record(MODELS[model], VARIANTS[name]), VARIANTS[name])


@pytest.mark.parametrize("name", sorted(EXPERIMENTAL))
def test_experimental_variant_on_the_dlrm(name: str) -> None:
    assert_clean(record(MODELS["dlrm-table_wise"], EXPERIMENTAL[name]), EXPERIMENTAL[name])


# ------------------------------------------------------------------ staged


@pytest.mark.parametrize("extra_stage", [None, "prefetch", "start_embedding_lookup"])
@pytest.mark.parametrize("model", ["towers-table_wise", "towers-row_wise"])
def test_staged_with_sparse_data_dist_stages(model: str, extra_stage: Optional[str]) -> None:
    """StagedTrainPipeline with SparseDataDistUtil's stages, driven by the user's loop."""
    dmp, optimizer = MODELS[model].build()
    batches = MODELS[model].batches()
    with StreamRecorder(host_memory=host_memory_of(dmp)) as recorder:
        sdd = train_staged_with_sdd_stages(recorder, dmp, optimizer, batches, extra_stage, DEVICE)
        sdd.detach()
        del sdd
    recorder.assert_protocol()
    summary = summarize(recorder)
    # The prefetch stage has nothing to do on these kernels (no cache).
    busy = ["h2d", "start_sparse_data_dist"]
    if extra_stage == "start_embedding_lookup":
        busy.append(extra_stage)
    assert all(summary.ops.get(s, 0) > 0 for s in busy), summary.ops
    assert summary.cross_stream_accesses > 0 and summary.record_streams > 0, summary


# ------------------------------------------- the cases the rules were made precise for


def _ops_in(recorder: StreamRecorder, task: str, stream: str) -> List[OpRecord]:
    return [
        r
        for r in recorder.records
        if isinstance(r, OpRecord)
        and r.where.span is not None
        and r.where.span.task == task
        and r.stream.name == stream
    ]


def test_forward_finishes_its_input_dist_on_data_dist_and_joins_it() -> None:
    """Rule (d), safe: SparseDist's forward completes the input_dist's tensors
    all-to-all (and the KJT permute) on data_dist, where it was issued, as
    torchrec's does, and the default stream waits for data_dist before the
    Forward verb ends: what runs after the verb on default is ordered after that
    work as if it had run there.  Unjoined, the same kernels are reported.

    Row-wise: every rank receives every feature from every rank, so the wait
    permutes the received ids (table-wise with one table per rank has nothing
    to permute, at 4 ranks)."""
    model, variant = MODELS["towers-row_wise"], VARIANTS["SparseDist"]
    recorder = record(model, variant)
    assert _ops_in(recorder, "Forward", "data_dist"), "the case is not exercised"
    assert_clean(recorder, variant)

    def hand_off_without_the_wait(obj: Any, producer: Any) -> None:
        consumer = forwards_module.current_stream(DEVICE)
        forwards_module.record_stream(obj, consumer)

    patch = lambda: mock.patch.object(forwards_module, "hand_off", hand_off_without_the_wait)  # noqa: E731
    violations = check_stream_protocol(record(model, variant, patch))
    unjoined = [v for v in violations if v.rule == "d"]
    assert unjoined, violations
    assert "P0 Forward[i0]@default is recorded on stream 'default'" in unjoined[0].message
    assert "ran on stream 'data_dist'" in unjoined[0].message
    assert "had not waited for that work when the step ended" in unjoined[0].message
    # What the forward then reads of it is a race too.
    assert any(v.rule == "a" for v in violations), violations


def test_lookup_output_buffers_are_recorded_on_the_forward_stream() -> None:
    """Rule (b), unsafe without the hand-over: Fused's lookup issues the output
    all-to-all on data_dist, whose buffer the forward's wait reads on default
    and drops at once; data_dist then allocates for the next input_dist without
    having waited for default.  The forward records the buffer on default first
    (``record_stream_held``): the allocator keeps the block until default's
    read is done.  Without it, rule (b) names the buffer."""
    model, variant = MODELS["towers-table_wise"], VARIANTS["Fused-data_dist"]
    assert_clean(record(model, variant), variant)
    patch = lambda: mock.patch.object(forwards_module, "record_stream_held", lambda *_: 0)  # noqa: E731
    violations = check_stream_protocol(record(model, variant, patch))
    assert violations and {v.rule for v in violations} == {"b"}, violations
    message = violations[0].message
    assert message.startswith("missing record_stream: tensor float32[")
    assert "allocated on stream 'data_dist'" in message and "EmbLookup[i0]@data_dist" in message
    assert "was used on stream 'default'" in message and "Forward[i0]@default" in message


def test_learning_rate_is_host_memory() -> None:
    """fbgemm keeps each TBE's learning rate in a host tensor on every device;
    the fused optimizer's zero_grad() and step() fill it on the host while the
    Fused lookup (on data_dist) clones it: host work in program order, no race.
    Recorded as if it were device memory, it is the only thing reported."""
    model, variant = MODELS["dlrm-table_wise"], VARIANTS["Fused-data_dist"]
    violations = check_stream_protocol(record(model, variant, host_memory=False))
    assert violations and {v.rule for v in violations} == {"a"}, violations
    assert all("tensor float32[] " in v.message for v in violations), violations
    assert any("aten.fill_.Scalar" in v.message for v in violations), violations
