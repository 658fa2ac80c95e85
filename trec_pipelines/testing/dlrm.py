"""A small DLRM, its synthetic data, and helpers to shard, train and compare it.

Everything here is deterministic: the same seed gives the same weights and the
same batches, so two training runs that do the same arithmetic in the same
order end with bit-identical outputs and weights.  The tests use that to check
pipelines against a plain, non-pipelined training loop.

Public helpers (see each docstring):

    Batch, NestedBatch                  -- Pipelineable inputs
    DLRM, NestedDLRM                    -- models, forward(batch) -> (loss, pred)
    make_batches(n, seed, nested=False) -- per-rank synthetic batches
    make_sharded(model_factory, sharding_type, seed, ...) -> (dmp, optimizer)
    current_group()                     -- the per-test process group
    plain_loop(model, optimizer, batches) -> Run (list of per-step preds + .weights)
    run_pipeline(pipeline, batches)       -> Run
    weights(model)                        -> Dict[str, Tensor]
    assert_runs_equal(a, b)
"""

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.optim import (
    _apply_optimizer_in_backward as apply_optimizer_in_backward,
)
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor
from torchrec.streamable import Pipelineable

from trec_pipelines.testing import devices, plans
from trec_pipelines.testing.dlrm_net import SpecDLRM
from trec_pipelines.testing.dlrm_spec import ModelSpec

# --------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------

DENSE_IN = 8
BATCH_SIZE = 16
NUM_BATCHES = 8

# (table name, feature name, rows, dim, max ids per sample).  Mixed dims so
# column-wise sharding splits some tables and not others; several features
# carry more than one id per sample so pooling actually sums.
TABLE_SPECS = [
    ("t0", "f0", 100, 8, 1),
    ("t1", "f1", 200, 16, 4),
    ("t2", "f2", 150, 8, 3),
    ("t3", "f3", 300, 16, 6),
]
FEATURES = [spec[1] for spec in TABLE_SPECS]

# The same shapes as the spec SpecDLRM builds the tests' DLRM from: an 8-16-8
# bottom MLP and a 16-wide top MLP over the tables above (the batches come
# from make_batches, not from the spec's pooling).
TESTS_SPEC = ModelSpec(
    rows=max(spec[2] for spec in TABLE_SPECS),
    table_rows=tuple(spec[2] for spec in TABLE_SPECS),
    dims=tuple(spec[3] for spec in TABLE_SPECS),
    pooling=1,
    dense_in=DENSE_IN,
    dense_arch=(16, 8),
    over_arch=(16,),
)

SHARDING_TYPES = ("table_wise", "column_wise", "data_parallel")

# Adagrad rather than SGD for the embeddings: SGD steps on these tiny
# gradients barely move the predictions (~1e-5), Adagrad steps are ~lr, so a
# pipeline that looked up stale or wrong embedding rows shows up clearly.
EMB_LR = 0.1  # fused (in-backward) embedding optimizer
DENSE_LR = 0.05  # dense optimizer


def table_configs() -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=name,
            feature_names=[feat],
            num_embeddings=rows,
            embedding_dim=dim,
            pooling=PoolingType.SUM,
        )
        for name, feat, rows, dim, _ in TABLE_SPECS
    ]


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


class FieldwiseBatch(Pipelineable):
    """Base of a dataclass batch whose fields are all tensors or KJTs: moved to
    a device and recorded on a stream field by field (``pin_memory`` is a no-op)."""

    def to(self, device: torch.device, non_blocking: bool = False) -> "FieldwiseBatch":
        values = (
            getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in dataclasses.fields(self)
        )  # type: ignore[arg-type]
        return type(self)(*values)

    def record_stream(self, stream: torch.Stream) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            getattr(self, f.name).record_stream(stream)

    def pin_memory(self) -> "FieldwiseBatch":
        return self


@dataclass
class Batch(Pipelineable):
    """Flat input: dense features, one KJT of sparse ids, binary labels.

    ``record_stream`` forwards to the tensors, as torchrec's KJT does, so it
    raises on CPU (``Tensor.record_stream`` rejects a CPU stream): a pipeline
    must not call it when there is no accelerator.  torchrec's Base and
    SparseDist pipelines don't; TrainPipelineSemiSync does and fails on CPU.
    """

    dense: torch.Tensor  # [B, DENSE_IN] float
    sparse: KeyedJaggedTensor
    labels: torch.Tensor  # [B] float in {0, 1}
    # Make new tensors in to() even for the batch's own device, as a real
    # host-to-device copy does (the benchmark's memory-options measurement).
    # Off, to() on CPU hands over these very tensors.
    copying: bool = False

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        if self.copying:
            return Batch(
                dense=self.dense.to(device=device, copy=True),
                sparse=KeyedJaggedTensor.from_lengths_sync(
                    keys=self.sparse.keys(),
                    values=self.sparse.values().to(device=device, copy=True),
                    lengths=self.sparse.lengths().to(device=device, copy=True),
                ),
                labels=self.labels.to(device=device, copy=True),
            )
        return Batch(
            dense=self.dense.to(device=device, non_blocking=non_blocking),
            sparse=self.sparse.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense.record_stream(stream)
        self.sparse.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return Batch(
            dense=self.dense.pin_memory(),
            sparse=self.sparse.pin_memory(),
            labels=self.labels.pin_memory(),
        )


@dataclass
class NestedBatch(Pipelineable):
    """Same data, but the KJT is only reachable as ``features["sparse"]``.

    This makes the pipelines' FX trace of the model follow a getattr *and* a
    getitem from the placeholder to the sharded module's input.
    """

    dense: torch.Tensor  # [B, DENSE_IN] float
    features: Dict[str, KeyedJaggedTensor]  # {"sparse": kjt}
    labels: torch.Tensor  # [B] float in {0, 1}

    def to(self, device: torch.device, non_blocking: bool = False) -> "NestedBatch":
        return NestedBatch(
            dense=self.dense.to(device=device, non_blocking=non_blocking),
            features={
                k: v.to(device=device, non_blocking=non_blocking) for k, v in self.features.items()
            },
            labels=self.labels.to(device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense.record_stream(stream)
        for v in self.features.values():
            v.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> "NestedBatch":
        return NestedBatch(
            dense=self.dense.pin_memory(),
            features={k: v.pin_memory() for k, v in self.features.items()},
            labels=self.labels.pin_memory(),
        )


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# The process group make_sharded uses when none is passed.  conftest.py points
# it at a fresh group for every test, so a test that leaves a collective
# half-done on one rank (and times out) does not poison the tests after it.
_current_group: Optional[dist.ProcessGroup] = None


def set_current_group(group: Optional[dist.ProcessGroup]) -> None:
    global _current_group
    _current_group = group


def current_group() -> dist.ProcessGroup:
    """The group for this test (conftest sets it), else the default group."""
    return _current_group if _current_group is not None else dist.group.WORLD


def make_batches(
    n: int = NUM_BATCHES,
    seed: int = 0,
    nested: bool = False,
    batch_size: int = BATCH_SIZE,
    rank: Optional[int] = None,
) -> List[Union[Batch, NestedBatch]]:
    """``n`` deterministic synthetic batches for this rank.

    The generator seed mixes ``seed`` and the rank, so ranks see different
    data (as real data-parallel training would) but each rank's data is the
    same every time it is asked for.  Id lists have variable length,
    including empty bags.
    """
    if rank is None:
        rank = _rank()
    g = torch.Generator().manual_seed(seed * 1000 + rank * 7919 + 17)
    out: List[Union[Batch, NestedBatch]] = []
    for _ in range(n):
        dense = torch.randn(batch_size, DENSE_IN, generator=g)
        labels = torch.randint(0, 2, (batch_size,), generator=g).float()
        lengths, values = [], []
        for _name, _feat, rows, _dim, max_len in TABLE_SPECS:
            # lengths in [0, max_len]: empty bags happen now and then
            ln = torch.randint(0, max_len + 1, (batch_size,), generator=g)
            lengths.append(ln)
            values.append(torch.randint(0, rows, (int(ln.sum()),), generator=g))
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=list(FEATURES),
            values=torch.cat(values).long(),
            lengths=torch.cat(lengths).int(),
        )
        if nested:
            out.append(NestedBatch(dense=dense, features={"sparse": kjt}, labels=labels))
        else:
            out.append(Batch(dense=dense, sparse=kjt, labels=labels))
    return out


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------


class DLRM(SpecDLRM):
    """The network of :mod:`trec_pipelines.testing.dlrm_net` at the tests' shapes (:data:`TESTS_SPEC`).

    ``forward(batch)`` returns ``(loss, pred)``: ``loss`` is the 0-dim mean
    BCE-with-logits (``torch.sum(loss, dim=0)`` is valid on a 0-dim tensor, so
    torchrec's pipelines accept it), ``pred`` the detached logits ``[B]``.
    With ``per_sample_loss=True`` the loss is the unreduced ``[B]`` vector
    instead (use ``functools.partial(DLRM, per_sample_loss=True)`` as the
    factory): a pipeline that calls ``loss.backward()`` instead of
    ``torch.sum(loss, dim=0).backward()`` fails on it.
    """

    def __init__(
        self, device: Optional[torch.device] = None, per_sample_loss: bool = False
    ) -> None:
        super().__init__(TESTS_SPEC, device=device, per_sample_loss=per_sample_loss)

    def _head(self, dense: torch.Tensor, pooled: KeyedTensor, labels: torch.Tensor):
        return self.head(dense, pooled, labels)


class NestedDLRM(DLRM):
    """Same model reading its KJT from ``batch.features["sparse"]``."""

    def forward(self, batch: NestedBatch):  # type: ignore[override]
        pooled = self.ebc(batch.features["sparse"])
        return self._head(batch.dense, pooled, batch.labels)


# --------------------------------------------------------------------------
# Sharding
# --------------------------------------------------------------------------


def _copy_into(dst_state: Dict[str, object], src_state: Dict[str, torch.Tensor]) -> None:
    """Write full (unsharded) tensors into a sharded model's state in place."""
    for key, dst in dst_state.items():
        if key not in src_state:
            raise KeyError(f"sharded state key {key!r} not in the unsharded model")
        src = src_state[key]
        if isinstance(dst, ShardedTensor):
            for shard in dst.local_shards():
                idx = tuple(
                    slice(off, off + size)
                    for off, size in zip(
                        shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True
                    )
                )
                shard.tensor.copy_(src[idx])
        elif hasattr(dst, "to_local"):  # DTensor
            raise NotImplementedError(f"DTensor state for {key!r} not handled")
        else:
            assert isinstance(dst, torch.Tensor), (key, type(dst))
            dst.copy_(src)


def make_sharded(
    model_factory: Callable[..., nn.Module],
    sharding_type: str,
    seed: int = 0,
    emb_optimizer: type = torch.optim.Adagrad,
    emb_lr: float = EMB_LR,
    dense_lr: float = DENSE_LR,
    pg: Optional[dist.ProcessGroup] = None,
):
    """Build ``(dmp, optimizer)``: ``model_factory()`` sharded over ``pg``
    (default :func:`current_group`, i.e. all ranks).  The model must keep its
    EmbeddingBagCollection at ``.ebc`` (DLRM, NestedDLRM and subclasses do).

    * Weights come from ``model_factory()`` built under ``torch.manual_seed(seed)``
      on every rank (so all ranks agree), then copied into the sharded model:
      the starting point is the same for every build with the same seed,
      whatever the sharding type.
    * Every embedding table is forced to ``sharding_type`` through
      ``ParameterConstraints`` ("table_wise", "column_wise", "data_parallel").
    * Embedding params get an in-backward optimizer (``emb_optimizer``,
      Adagrad by default) before sharding.  For table/column-wise the sharder
      turns it into the fused TBE kernel's optimizer (the update happens
      inside backward; ``dmp.fused_optimizer.step()`` is a no-op).  For
      data_parallel torchrec uses the "dense" kernel, which ignores it: the
      replicated tables become ordinary DDP params (no ``_in_backward_optimizers``)
      and are trained by the dense optimizer below, with DDP-averaged grads.
    * ``optimizer`` is a ``CombinedOptimizer`` of the DMP's fused optimizer and
      an Adagrad (``dense_lr``) over every parameter without an in-backward
      optimizer -- the usual torchrec recipe.
    """
    if sharding_type not in SHARDING_TYPES:
        raise ValueError(f"sharding_type must be one of {SHARDING_TYPES}")
    assert dist.is_initialized(), "make_sharded needs the default process group"
    device = devices.device()
    pg = pg if pg is not None else current_group()

    torch.manual_seed(seed)
    model = model_factory()
    reference_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    apply_optimizer_in_backward(emb_optimizer, model.ebc.parameters(), {"lr": emb_lr})

    kernel = "dense" if sharding_type == "data_parallel" else "fused"
    constraints = {
        name: ParameterConstraints(sharding_types=[sharding_type], compute_kernels=[kernel])
        for name, *_ in TABLE_SPECS
    }
    sharders = [EmbeddingBagCollectionSharder()]
    plan = plans.plan(model, sharders, pg, constraints)
    for pname, ps in plan.plan["ebc"].items():  # type: ignore[union-attr]
        assert ps.sharding_type == sharding_type, (pname, ps.sharding_type)

    dmp = DistributedModelParallel(
        module=model,
        env=ShardingEnv.from_process_group(pg),
        device=device,
        plan=plan,
        sharders=sharders,
    )
    with torch.no_grad():
        _copy_into(dmp.state_dict(), reference_state)

    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=dense_lr),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense_opt])
    return dmp, optimizer


# --------------------------------------------------------------------------
# Training loops and comparison
# --------------------------------------------------------------------------


class Run(list):
    """A list of per-step outputs, plus ``.weights``: the model's final state
    (see :func:`weights`) taken when the run ended."""

    def __init__(self, outputs: Iterable[torch.Tensor], final_weights: Dict[str, torch.Tensor]):
        super().__init__(outputs)
        self.weights = final_weights


def _snapshot(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    raise TypeError(f"expected a tensor output per step, got {type(out)}")


def plain_loop(model: nn.Module, optimizer, batches: Iterable) -> Run:
    """The non-pipelined reference: per batch the same four calls, in the same
    order, that torchrec's TrainPipelineSparseDist makes in training mode:
    ``zero_grad``, forward, ``torch.sum(loss, dim=0).backward()``, ``step``."""
    model.train()
    outputs = []
    for batch in batches:
        optimizer.zero_grad()
        loss, out = model(batch)
        torch.sum(loss, dim=0).backward()
        optimizer.step()
        outputs.append(_snapshot(out))
    return Run(outputs, weights(model))


def plain_loop_with_eval_pass(
    model: nn.Module, optimizer, train: List, evaluation: List, at: int
) -> Tuple[Run, List[torch.Tensor], Run]:
    """The plain loop trains ``train[:at]``, evaluates ``evaluation`` in eval mode
    under ``no_grad``, then trains ``train[at:]``: (first run, eval outputs, rest)."""
    first = plain_loop(model, optimizer, train[:at])
    model.eval()
    with torch.no_grad():
        evaluated = [model(b)[1] for b in evaluation]
    model.train()
    rest = plain_loop(model, optimizer, train[at:])
    return first, evaluated, rest


def run_pipeline(
    pipeline, batches: Iterable, model: Optional[nn.Module] = None, max_steps: int = 10_000
) -> Run:
    """Drive ``pipeline.progress(it)``, ``it = iter(batches)``, until it
    raises StopIteration.  Final weights are read from ``model`` (default:
    ``pipeline._model``, which torchrec's pipelines keep)."""
    it = iter(batches)
    outputs = []
    for _ in range(max_steps):
        try:
            out = pipeline.progress(it)
        except StopIteration:
            break
        outputs.append(_snapshot(out))
    else:
        raise AssertionError(f"pipeline did not stop within {max_steps} steps")
    return Run(outputs, weights(model if model is not None else pipeline._model))


def weights(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Copies of every state tensor, on this rank.

    A ``ShardedTensor`` becomes one entry per local shard
    (``"<key>@<offsets>"``); a key whose shards all live on other ranks has no
    entry on this rank.  Two runs sharded by the same plan therefore compare
    like for like, on every rank.
    """
    out: Dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                offs = ",".join(str(o) for o in shard.metadata.shard_offsets)
                out[f"{key}@{offs}"] = shard.tensor.detach().clone()
        elif hasattr(value, "to_local"):  # DTensor
            out[key] = value.to_local().detach().clone()
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
    return out


def _first_tensor_difference(
    a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]
) -> Optional[str]:
    if a.keys() != b.keys():
        return (
            f"state keys differ: only in first {sorted(a.keys() - b.keys())}, "
            f"only in second {sorted(b.keys() - a.keys())}"
        )
    for key in sorted(a):
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{key}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}"
        if not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item()
            return f"{key}: not bit-identical (max abs diff {diff:.3g})"
    return None


def assert_runs_equal(a: Run, b: Run, names: Sequence[str] = ("a", "b")) -> None:
    """Same number of steps, every step's output ``torch.equal``, and final
    weights ``torch.equal``; the message names the first difference."""
    rank = _rank()
    na, nb = names
    # The common steps first (the first differing one is the better message), then the count.
    for step, (x, y) in enumerate(zip(a, b, strict=False)):
        if x.shape != y.shape or not torch.equal(x, y):
            detail = (
                f"shapes {tuple(x.shape)} vs {tuple(y.shape)}"
                if x.shape != y.shape
                else f"max abs diff {(x.double() - y.double()).abs().max().item():.3g}"
            )
            raise AssertionError(f"[rank {rank}] step {step}: output of {na} != {nb} ({detail})")
    if len(a) != len(b):
        raise AssertionError(f"[rank {rank}] {na} ran {len(a)} steps, {nb} ran {len(b)}")
    problem = _first_tensor_difference(a.weights, b.weights)
    if problem:
        raise AssertionError(f"[rank {rank}] final weights {na} vs {nb}: {problem}")
