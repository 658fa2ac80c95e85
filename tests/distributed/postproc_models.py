"""Two-tower models with postproc modules, their data, and how to shard them.

Our own stand-ins for what real models put between the batch and their sharded
modules, arranged as in upstream's postproc tests (test_postproc.py and
test_train_pipelines.py), not copied from them:

* :class:`AddNegatives` rewrites the whole batch (appends a "neg" id per
  sample built from its "a" ids, rescales the dense features, halves the
  weights) and is shared by both sharded modules;
* :class:`Keep` selects features of a KJT and returns it in a one-element list;
* :class:`PositionScale` has a trainable parameter, so it must not run ahead;
* :class:`DenseTenth` / :class:`MixIn` take collections of batch fields,
  constants and another postproc's output.

``TwoTowers(layout)`` picks the forward; every layout reads ``batch.ids``
(unweighted, into ``ebc``) and ``batch.scored`` (weighted, into ``webc``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from trec_pipelines.testing import devices, plans
from trec_pipelines.testing.dlrm import FieldwiseBatch, Run, current_group, run_pipeline, weights

DEVICE = devices.device()
ROWS = 64
DENSE = 4
IDS = ["a", "b", "c"]
SCORED = ["s", "t"]
NUM_BATCHES = 7


@dataclass
class Batch(FieldwiseBatch):
    dense: torch.Tensor
    ids: KeyedJaggedTensor
    scored: KeyedJaggedTensor  # weighted
    labels: torch.Tensor


def make_batches(n: int = NUM_BATCHES, size: int = 8, seed: int = 11) -> List[Batch]:
    """Per-rank batches (the rank is mixed into the seed)."""
    g = torch.Generator().manual_seed(seed + dist.get_rank())

    def kjt(keys: Sequence[str], weighted: bool) -> KeyedJaggedTensor:
        lengths = torch.randint(1, 4, (len(keys) * size,), generator=g)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
        w = torch.rand(int(lengths.sum()), generator=g) if weighted else None
        return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths, weights=w)

    return [
        Batch(
            torch.rand(size, DENSE, generator=g),
            kjt(IDS, False),
            kjt(SCORED, True),
            torch.randint(0, 2, (size,), generator=g).float(),
        )
        for _ in range(n)
    ]


# ------------------------------------------------------------------ postprocs


class AddNegatives(nn.Module):
    """A negative-sampler stand-in: appends feature "neg" = (a's ids + shift) % ROWS,
    rescales the dense features and halves the weights.  A buffer, no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.tensor(5))
        self.calls = 0  # how many times it really ran

    def forward(self, batch: Batch) -> Batch:
        self.calls += 1
        ids = batch.ids
        a = ids["a"]
        neg = KeyedJaggedTensor(
            keys=["neg"], values=(a.values() + self.shift) % ROWS, lengths=a.lengths()
        )
        scored = batch.scored
        halved = KeyedJaggedTensor(
            keys=scored.keys(),
            values=scored.values(),
            lengths=scored.lengths(),
            weights=scored.weights() * 0.5,
        )
        return Batch(batch.dense * 1.5, KeyedJaggedTensor.concat([ids, neg]), halved, batch.labels)


class PositionScale(AddNegatives):
    """AddNegatives plus a trainable scale on the dense features."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((DENSE,), 0.9))

    def forward(self, batch: Batch) -> Batch:
        out = super().forward(batch)
        return Batch(out.dense * self.scale, out.ids, out.scored, out.labels)


class Keep(nn.Module):
    """Keeps ``keys`` of a KJT, in a one-element list."""

    def __init__(self, keys: Sequence[str]) -> None:
        super().__init__()
        self.keys = list(keys)

    def forward(self, kjt: KeyedJaggedTensor) -> List[KeyedJaggedTensor]:
        return [KeyedJaggedTensor.from_jt_dict({k: kjt[k] for k in self.keys})]


class DenseTenth(nn.Module):
    def forward(self, batch: Batch) -> torch.Tensor:
        return batch.dense * 0.1


class MixIn(nn.Module):
    """Adds every entry of a list and a dict to the dense features (not in place)."""

    def forward(self, batch: Batch, extra: List[Any], named: Dict[str, Any]) -> Batch:
        dense = batch.dense
        for value in list(extra) + list(named.values()):
            dense = dense + value
        return Batch(dense, batch.ids, batch.scored, batch.labels)


# --------------------------------------------------------------------- models

# layout -> (features of ebc, features of webc)
LAYOUTS: Dict[str, Tuple[List[str], List[str]]] = {
    "plain": (IDS, SCORED),  # no postproc: the reference for attach/detach without one
    "shared": (IDS + ["neg"], SCORED),  # one AddNegatives feeds both towers
    "keep": (["a", "b"], ["s"]),  # a Keep per tower, reading batch fields
    "shared_then_keep": (["a", "neg"], ["s"]),  # AddNegatives -> a Keep per tower
    "trainable": (IDS + ["neg"], SCORED),  # PositionScale feeds both towers
    "trainable_then_keep": (["a", "neg"], ["s"]),
    "inline_edit": (["a", "b"], ["s"]),  # ids rebuilt inline before their Keep
    "collections": (["a", "b"], ["s"]),  # DenseTenth -> MixIn(list, dict) -> Keeps
}


class TwoTowers(nn.Module):
    def __init__(self, layout: str) -> None:
        super().__init__()
        ids, scored = LAYOUTS[layout]
        self.layout = layout
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"t_{f}", embedding_dim=4, num_embeddings=ROWS, feature_names=[f]
                )
                for f in ids
            ],
            device=DEVICE,
        )
        self.webc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"w_{f}", embedding_dim=4, num_embeddings=ROWS, feature_names=[f]
                )
                for f in scored
            ],
            is_weighted=True,
            device=DEVICE,
        )
        self.dense = nn.Sequential(nn.Linear(DENSE, 4), nn.ReLU())
        self.over = nn.Linear(4 + 4 * len(ids) + 4 * len(scored), 1)
        self._ids, self._scored = ids, scored
        if layout in ("shared", "shared_then_keep"):
            self.postproc = AddNegatives()
        if layout in ("trainable", "trainable_then_keep"):
            self.postproc = PositionScale()
        if layout.endswith("keep") or layout in ("inline_edit", "collections"):
            self.keep_ids = Keep(ids)
            self.keep_scored = Keep(scored)
        if layout == "collections":
            self.tenth = DenseTenth()
            self.mix = MixIn()

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        layout = self.layout  # a plain attribute: FX traces one branch
        if layout in ("shared", "trainable", "shared_then_keep", "trainable_then_keep"):
            batch = self.postproc(batch)
        if layout == "collections":
            tenth = self.tenth(batch)
            batch = self.mix(
                batch, [1, batch.dense, tenth], {"one": 1, "dense": batch.dense, "tenth": tenth}
            )
        ids, scored = batch.ids, batch.scored
        if layout == "inline_edit":
            ids = KeyedJaggedTensor.from_lengths_sync(ids.keys(), ids.values(), ids.lengths())
        if layout in ("plain", "shared", "trainable"):
            pooled, wpooled = self.ebc(ids), self.webc(scored)
        else:
            pooled, wpooled = (
                self.ebc(self.keep_ids(ids)[0]),
                self.webc(self.keep_scored(scored)[0]),
            )
        # By feature name: a sharded EBC orders its output keys by shard placement.
        embedded = [pooled[f] for f in self._ids] + [wpooled[f] for f in self._scored]
        x = torch.cat([self.dense(batch.dense)] + embedded, dim=1)
        logits = self.over(x).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def build(
    layout: str,
    sharding_type: str = "table_wise",
    wrap: Optional[Callable[[nn.Module], nn.Module]] = None,
) -> Tuple[nn.Module, Any]:
    """``(dmp, optimizer)`` for ``TwoTowers(layout)`` (inside ``wrap(...)`` if
    given), the same weights every call."""
    torch.manual_seed(3)
    model: nn.Module = TwoTowers(layout)
    if wrap is not None:
        model = wrap(model)
    towers = [m for m in model.modules() if isinstance(m, EmbeddingBagCollection)]
    for tower in towers:
        apply_optimizer_in_backward(torch.optim.Adagrad, tower.parameters(), {"lr": 0.1})
    pg = current_group()
    sharders = [EmbeddingBagCollectionSharder()]
    tables = [c.name for tower in towers for c in tower.embedding_bag_configs()]
    constraints = {t: ParameterConstraints(sharding_types=[sharding_type]) for t in tables}
    plan = plans.plan(model, sharders, pg, constraints)
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(pg), device=DEVICE, plan=plan, sharders=sharders
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda p: torch.optim.Adagrad(p, lr=0.05),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def plain_step(dmp: nn.Module, optimizer: Any, batch: Batch) -> torch.Tensor:
    """One non-pipelined training step, as the pipelines order it."""
    optimizer.zero_grad()
    loss, pred = dmp(batch)
    torch.sum(loss, dim=0).backward()
    optimizer.step()
    return pred.detach().clone()


def plain(
    layout: str,
    batches: Optional[List[Batch]] = None,
    wrap: Optional[Callable[[nn.Module], nn.Module]] = None,
) -> Run:
    dmp, optimizer = build(layout, wrap=wrap)
    batches = batches if batches is not None else make_batches()
    return Run([plain_step(dmp, optimizer, b) for b in batches], weights(dmp))


def run(
    pipeline_cls: Any,
    layout: str,
    shim: Optional[Any] = None,
    wrap: Optional[Callable[[nn.Module], nn.Module]] = None,
    **kwargs: Any,
) -> Tuple[Run, Any, nn.Module]:
    """Train ``TwoTowers(layout)`` with ``pipeline_cls`` to the end of the data."""
    dmp, optimizer = build(layout, wrap=wrap)
    pipeline = pipeline_cls(dmp, optimizer, DEVICE, **kwargs)
    with shim() if shim is not None else contextlib.nullcontext():
        return run_pipeline(pipeline, make_batches(), model=dmp), pipeline, dmp
