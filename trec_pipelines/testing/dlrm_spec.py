"""The shapes of a DLRM: tables, arches, pooling and interaction, as one frozen spec.

:class:`ModelSpec` describes the network :class:`~trec_pipelines.testing.dlrm_net.SpecDLRM`
builds: the tests' small DLRM (``trec_pipelines.testing.dlrm.TESTS_SPEC``), the benchmark's models (its presets)
and :func:`tiny_spec`, whose step is so cheap that a pipeline's own Python work dominates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
INTERACTIONS = ("concat", "dcn")


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of the benchmark model.

    Attributes:
        rows: rows of every embedding table (unless ``table_rows`` gives them per table).
        dims: one embedding dimension per table (the number of tables).
        pooling: mean ids per sample and feature; lengths are uniform in
            ``[0, 2 * pooling]``, so some bags are empty.  Unused with ``poolings``.
        dense_in: dense input features.
        dense_arch: hidden sizes of the bottom MLP (its last size feeds the interaction).
        over_arch: hidden sizes of the top MLP, before the final logit.
        poolings: fixed ids per sample of each table (every bag of table ``i``
            holds exactly ``poolings[i]`` ids, as in a multi-hot data set such
            as MLPerf's DLRM-DCNv2); empty: random lengths around ``pooling``.
        interaction: how the dense output and the pooled embeddings meet before
            the top MLP: ``"concat"`` (concatenated) or ``"dcn"`` (concatenated,
            then a low-rank DCNv2 cross network, as in MLPerf's DLRM-DCNv2).
        dcn_layers: cross layers of the ``"dcn"`` interaction.
        dcn_rank: rank of each cross layer's low-rank weight (``"dcn"``).
        table_rows: rows of each table, one per table; empty: ``rows`` for every table.
        stash_weights: mark every table ``stash_weights`` (the embedding-stash
            variants' contenders: what they move off a GPU between lookup and
            backward; nothing else reads it).
    """

    rows: int
    dims: Tuple[int, ...]
    pooling: int
    dense_in: int
    dense_arch: Tuple[int, ...]
    over_arch: Tuple[int, ...]
    stash_weights: bool = False
    poolings: Tuple[int, ...] = ()
    interaction: str = "concat"
    dcn_layers: int = 3
    dcn_rank: int = 64
    table_rows: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.table_rows and len(self.table_rows) != len(self.dims):
            raise ValueError(
                f"table_rows takes one row count per table ({len(self.dims)}), "
                f"got {len(self.table_rows)}"
            )
        if self.poolings and len(self.poolings) != len(self.dims):
            raise ValueError(
                f"poolings takes one bag size per table ({len(self.dims)}), got {len(self.poolings)}"
            )
        if self.poolings and min(self.poolings) < 1:
            raise ValueError(f"poolings must be positive, got {self.poolings}")
        if self.interaction not in INTERACTIONS:
            raise ValueError(
                f"interaction must be one of {', '.join(INTERACTIONS)}, got {self.interaction!r}"
            )
        if self.dcn_layers < 1 or self.dcn_rank < 1:
            raise ValueError(
                f"dcn_layers and dcn_rank must be >= 1, got {self.dcn_layers}, {self.dcn_rank}"
            )

    @property
    def ids_per_sample(self) -> float:
        """Ids per sample over every table (the mean with random lengths)."""
        return float(sum(self.poolings)) if self.poolings else float(self.pooling * len(self.dims))

    def lengths(self, batch_size: int, g: torch.Generator) -> torch.Tensor:
        """One batch's bag lengths, key-major (a KJT's layout): fixed per table with ``poolings``."""
        if self.poolings:
            return torch.tensor(self.poolings).repeat_interleave(batch_size)
        return torch.randint(0, 2 * self.pooling + 1, (len(self.dims) * batch_size,), generator=g)

    def rows_of(self, table: int) -> int:
        """Rows of table ``table`` (``table_rows[table]``, else ``rows``)."""
        return self.table_rows[table] if self.table_rows else self.rows

    @property
    def features(self) -> List[str]:
        """The feature names, one per table: ``f0``, ``f1``, ..."""
        return [f"f{i}" for i in range(len(self.dims))]

    def table_configs(self) -> List[EmbeddingBagConfig]:
        return [
            EmbeddingBagConfig(
                name=f"t{i}",
                feature_names=[f"f{i}"],
                num_embeddings=self.rows_of(i),
                embedding_dim=dim,
                pooling=PoolingType.SUM,
                stash_weights=self.stash_weights,
            )
            for i, dim in enumerate(self.dims)
        ]


def tiny_spec() -> ModelSpec:
    """Two small tables and one-layer arches: a step costs well under a millisecond of compute."""
    return ModelSpec(rows=100, dims=(8, 8), pooling=2, dense_in=4, dense_arch=(8,), over_arch=(8,))


__all__ = ["INTERACTIONS", "SHARDING_TYPES", "ModelSpec", "tiny_spec"]
