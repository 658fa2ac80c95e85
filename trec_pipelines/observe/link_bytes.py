"""What a training step puts on the link, by collective, from a model's shapes alone.

Three collectives cross the link in a step of a sharded model:

* ``input dist``: each rank sends every other rank the ids (int64) and bag
  lengths (int32) of the tables that rank holds, for its own batch;
* ``output dist``: the embeddings a rank's tables give for every other rank's
  batch (float32: pooled, one vector per bag; sequence, one per id) forward,
  and their gradients backward;
* ``gradient all-reduce``: DDP's ring all-reduce of the dense parameters'
  gradients (float32): each rank sends ``2 (W - 1) / W`` times their size.

The arithmetic assumes table-wise sharding with the tables spread evenly
over the ranks (the fraction ``(W - 1) / W`` of a batch's ids and embeddings
crosses the link), and leaves out the splits all-to-alls (a few bytes per
table).  Bytes are every rank's together: what one shared link carries, as
the benchmark's emulated link does (the performance guide's regime map).
``python -m trec_pipelines.advise`` prints them for a user's model
(:mod:`trec_pipelines.advise.link`); the benchmark for its own
(``benchmarks/measuring/link_bytes.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

ID_BYTES = 8  # int64 ids
LENGTH_BYTES = 4  # int32 lengths
FLOAT_BYTES = 4


@dataclass(frozen=True)
class LinkBytes:
    """Bytes one training step puts on the link, every rank together, by collective.

    Attributes:
        input_dist: the ids and lengths all-to-all.
        output_dist: the embeddings' all-to-all forward and their gradients'
            backward.
        allreduce: DDP's all-reduce of the dense gradients.
    """

    input_dist: float
    output_dist: float
    allreduce: float

    @property
    def model(self) -> float:
        """The model's own collectives: everything but the input dist."""
        return self.output_dist + self.allreduce

    @property
    def total(self) -> float:
        return self.input_dist + self.model

    def shares(self) -> Dict[str, float]:
        """Each collective's fraction of the step's bytes."""
        total = self.total or 1.0
        return {
            "input dist": self.input_dist / total,
            "output dist": self.output_dist / total,
            "gradient all-reduce": self.allreduce / total,
        }


def step_bytes(
    *, id_bytes: float, output_floats: float, dense_params: int, world: int
) -> LinkBytes:
    """:class:`LinkBytes` of one training step on ``world`` ranks.

    ``id_bytes``: the ids and lengths of one rank's batch, in bytes
    (``ID_BYTES`` an id, ``LENGTH_BYTES`` a bag); ``output_floats``: the
    embedding floats the sharded tables give for one rank's batch;
    ``dense_params``: the parameters outside the sharded tables (what DDP
    all-reduces).
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    remote = (world - 1) / world  # the share of the tables another rank holds
    return LinkBytes(
        input_dist=world * remote * id_bytes,
        output_dist=2 * world * remote * output_floats * FLOAT_BYTES,
        allreduce=world * 2 * remote * dense_params * FLOAT_BYTES,
    )


def link_ms(n_bytes: float, link_gbit: float) -> float:
    """Milliseconds ``n_bytes`` take at ``link_gbit`` Gbit/s."""
    return n_bytes * 8 / (link_gbit * 1e9) * 1e3


__all__ = ["FLOAT_BYTES", "ID_BYTES", "LENGTH_BYTES", "LinkBytes", "link_ms", "step_bytes"]
