"""Where a user's model sits on the regime map: its link bytes per step, and what they imply.

advise measures over whatever link the ranks have -- often one machine's
loopback, where a step's collectives cost next to nothing -- so its ratios
say little of a slow network.  What a step puts on the link is arithmetic
over the model's shapes (:mod:`trec_pipelines.observe.link_bytes`): the
ids of one batch (read from its ``KeyedJaggedTensor``), the embedding dims
of the tables the sharded modules hold, and the dense parameters outside
them.  At a link speed, those bytes take a time; next to the plain loop's
step measured here (its compute, the loopback's collectives being small),
they bound what hiding the input dist can gain: a pipeline overlaps the
next batch's ids with the current step, so a step of ``compute + ids +
model`` (the model's own collectives) takes at least ``max(compute +
model, ids)``.  That is the regime map's axis, in
``docs/guides/performance.md`` ("Where pipelining pays: the regime map").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from torch import nn

from trec_pipelines.model.rewrite import kjt_fields, sharded_modules
from trec_pipelines.observe.link_bytes import (
    ID_BYTES,
    LENGTH_BYTES,
    LinkBytes,
    link_ms,
    step_bytes,
)

# The link speeds the regime map is drawn at.
LINK_GBITS = (1.0, 10.0)
# Where the map's regimes part, by the most hiding the ids can gain.
PAYS = 1.10  # the map's `pipelining` preset end: the ids' all-to-all binds
FEW_PERCENT = 1.02  # DLRM-DCNv2's points: a few percent at most
MAP = 'docs/guides/performance.md, "Where pipelining pays: the regime map"'


@dataclass(frozen=True)
class LinkEstimate:
    """A model's link bytes per step, from its shapes and one batch.

    Attributes:
        bytes: by collective, every rank together
            (:class:`~trec_pipelines.observe.link_bytes.LinkBytes`).
        batch_size: the batch per rank it was computed at (the first batch's).
        world: the ranks.
    """

    bytes: LinkBytes
    batch_size: int
    world: int


def _tables(model: nn.Module) -> Dict[str, Tuple[int, bool]]:
    """Feature name -> (embedding dim, pooled), over the sharded modules' tables."""
    features: Dict[str, Tuple[int, bool]] = {}
    for module in sharded_modules(model).values():
        for attr, pooled in (("_embedding_bag_configs", True), ("_embedding_configs", False)):
            for config in getattr(module, attr, None) or []:
                for name in getattr(config, "feature_names", None) or []:
                    features[name] = (int(config.embedding_dim), pooled)
    return features


def _dense_params(model: nn.Module) -> int:
    """Parameters outside the sharded modules: what DDP all-reduces."""
    sharded = {id(p) for m in sharded_modules(model).values() for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in sharded)


def estimate(model: nn.Module, batch: Any, world: int) -> Optional[LinkEstimate]:
    """The link bytes of a step of ``model`` on ``batch`` (this rank's) over ``world`` ranks
    (None: no sharded table reads a feature of the batch's ``KeyedJaggedTensor``s)."""
    tables = _tables(model)
    id_bytes, output_floats, batch_size = 0.0, 0.0, 0
    for _, kjt in kjt_fields(batch):
        lengths = kjt.length_per_key()
        for key, ids in zip(kjt.keys(), lengths, strict=True):
            if key not in tables:
                continue
            dim, pooled = tables[key]
            batch_size = max(batch_size, int(kjt.stride()))
            id_bytes += ids * ID_BYTES + kjt.stride() * LENGTH_BYTES
            output_floats += dim * (kjt.stride() if pooled else ids)
    if batch_size == 0:
        return None
    bytes_ = step_bytes(
        id_bytes=id_bytes,
        output_floats=output_floats,
        dense_params=_dense_params(model),
        world=world,
    )
    return LinkEstimate(bytes_, batch_size, world)


def gain_bound(b: LinkBytes, compute_ms: float, link_gbit: float) -> float:
    """The most hiding the ids' all-to-all can gain at ``link_gbit``: plain / pipelined step."""
    ids, own = link_ms(b.input_dist, link_gbit), link_ms(b.model, link_gbit)
    plain = compute_ms + ids + own
    return plain / max(compute_ms + own, ids, 1e-9)


def _regime(bound: float) -> str:
    if bound >= PAYS:
        return (
            "the ids' all-to-all is a large share of the step: the map's end where pipelining pays"
        )
    if bound >= FEW_PERCENT:
        return "the model's own collectives and compute bind: a few percent to gain, at most"
    return "nothing measurable to gain from hiding the input dist"


def describe(link: LinkEstimate, step_seconds: Optional[float]) -> List[str]:
    """The table's lines: the bytes by kind, then each of the map's link speeds' regime
    (with ``step_seconds``, the plain loop's step measured here; without it, the times only)."""
    b = link.bytes
    shares = b.shares()
    kinds = ", ".join(
        f"{label} {n / 1e6:.2f} MB ({100 * shares[kind]:.0f}%)"
        for label, kind, n in (
            ("input dist ids", "input dist", b.input_dist),
            ("output dist", "output dist", b.output_dist),
            ("gradient all-reduce", "gradient all-reduce", b.allreduce),
        )
    )
    lines = [
        f"link bytes per step, from your model's shapes (batch {link.batch_size}/rank, "
        f"{link.world} ranks, table-wise, every rank's on one link): {kinds}"
    ]
    for gbit in LINK_GBITS:
        ids, own = link_ms(b.input_dist, gbit), link_ms(b.model, gbit)
        line = f"  at {gbit:g} Gbit/s: ids {ids:.1f} ms, output dist + all-reduce {own:.1f} ms"
        if step_seconds is not None:
            compute = 1e3 * step_seconds
            bound = gain_bound(b, compute, gbit)
            line += (
                f", next to the plain loop's {compute:.1f} ms step here: hiding the ids "
                f"gains at most {100 * (bound - 1):.0f}%; {_regime(bound)}"
            )
        lines.append(line)
    lines.append(f"  (where this sits on the regime map: {MAP})")
    return lines


__all__ = ["LINK_GBITS", "LinkEstimate", "describe", "estimate", "gain_bound"]
