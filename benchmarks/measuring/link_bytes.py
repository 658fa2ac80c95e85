"""What a training step of the bench's model puts on the link, by collective, from its shapes.

The stage probe measures two byte counts per step on an emulated link: the
input dist's and everything else the step sends (``fwd+bwd+opt``).  This
module splits the second by collective, by arithmetic over the shapes, so a
results table can say which of them fills the link:

* ``input dist``: each rank sends every other rank the ids (int64) and bag
  lengths (int32) of the tables that rank holds, for its own batch.
* ``output dist``: the pooled embeddings of a rank's tables for every other
  rank's batch (float32) forward, and their gradients backward.
* ``gradient all-reduce``: DDP's ring all-reduce of the dense parameters'
  gradients (float32): each rank sends ``2 (W - 1) / W`` times their size.

It assumes table-wise sharding with the tables spread evenly over the ranks
(the fraction ``(W - 1) / W`` of a batch's ids and embeddings crosses the
link), and leaves out the splits all-to-alls (a few bytes per table).  The
measured totals sit next to it in the results, so a gap shows.  The
arithmetic is the package's (``trec_pipelines/observe/link_bytes.py``, which
the advisor uses for a user's model); this module feeds it the bench's
``ModelSpec``.
"""

from __future__ import annotations

from typing import Optional

from trec_pipelines.observe.link_bytes import (
    FLOAT_BYTES,
    ID_BYTES,
    LENGTH_BYTES,
    LinkBytes,
    link_ms,
    step_bytes as _step_bytes,
)
from trec_pipelines.testing.dlrm_spec import ModelSpec


def dense_parameters(spec: ModelSpec) -> int:
    """Parameters of the model outside its embedding tables (what DDP all-reduces)."""
    import torch

    from trec_pipelines.testing.dlrm_net import SpecDLRM

    model = SpecDLRM(spec, table_device=torch.device("meta"))  # the tables take no memory
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith("ebc."))


def step_bytes(
    spec: ModelSpec, batch_size: int, world: int, dense_params: Optional[int] = None
) -> LinkBytes:
    """:class:`LinkBytes` of one training step at ``batch_size`` per rank on ``world`` ranks.

    ``dense_params``: the dense parameter count when known (else counted
    from ``spec``).
    """
    if world < 1 or batch_size < 1:
        raise ValueError(f"world and batch_size must be >= 1, got {world}, {batch_size}")
    per_sample_ids = spec.ids_per_sample * ID_BYTES + len(spec.dims) * LENGTH_BYTES
    return _step_bytes(
        id_bytes=batch_size * per_sample_ids,
        output_floats=batch_size * sum(spec.dims),
        dense_params=dense_parameters(spec) if dense_params is None else dense_params,
        world=world,
    )


def describe(spec: ModelSpec, batch_size: int, world: int, link_gbit: Optional[float]) -> str:
    """One line: the step's link bytes by collective (and their time at the link's rate)."""
    b = step_bytes(spec, batch_size, world)
    shares = b.shares()
    parts = []
    for name, n in (
        ("input dist", b.input_dist),
        ("output dist", b.output_dist),
        ("gradient all-reduce", b.allreduce),
    ):
        at_rate = f" = {link_ms(n, link_gbit):.1f} ms" if link_gbit else ""
        parts.append(f"{name} {n / 1e6:.2f} MB{at_rate} ({100 * shares[name]:.0f}%)")
    return (
        f"link bytes per step at batch {batch_size}/rank, from the shapes (table-wise, all ranks): "
        + ", ".join(parts)
        + (f" at {link_gbit:g} Gbit/s" if link_gbit else "")
    )


__all__ = [
    "FLOAT_BYTES",
    "ID_BYTES",
    "LENGTH_BYTES",
    "LinkBytes",
    "dense_parameters",
    "describe",
    "link_ms",
    "step_bytes",
]
