"""The one DLRM network: a bottom MLP, pooled embeddings, an interaction and a top MLP.

:class:`SpecDLRM` builds it from a :class:`~trec_pipelines.testing.dlrm_spec.ModelSpec`.  The
tests' :class:`~trec_pipelines.testing.dlrm.DLRM` is this network at the tests' shapes
(``TESTS_SPEC``); the benchmark builds it at its presets'
shapes, its tables on the meta device.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torchrec.modules.crossnet import LowRankCrossNet
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedTensor

from trec_pipelines.testing.dlrm_spec import ModelSpec


def mlp(
    sizes: Sequence[int], last_activation: bool, device: Optional[torch.device] = None
) -> nn.Sequential:
    """Linear layers through ``sizes``, a ReLU after each (after the last one only with ``last_activation``)."""
    layers: List[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b, device=device))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class SpecDLRM(nn.Module):
    """Bottom MLP on the dense features, pooled embeddings, top MLP to one logit.

    The interaction (``spec.interaction``) joins the bottom MLP's output and
    the pooled embeddings, concatenated by feature name (a sharded EBC orders
    its output keys by shard placement, so ``.values()`` would make the
    arithmetic depend on the plan): as they are, or crossed by a low-rank
    DCNv2 cross network (torchrec's ``LowRankCrossNet``).

    ``forward(batch)`` reads ``batch.dense``, ``batch.sparse`` and
    ``batch.labels`` and returns ``(loss, logits)``: the BCE loss (the 0-dim
    mean, or with ``per_sample_loss`` the unreduced ``[B]`` vector) and the
    detached logits.  ``device``: where the parameters are built;
    ``table_device``: where the tables are, if elsewhere (``meta`` leaves
    their memory and initialisation to the sharding).
    """

    def __init__(
        self,
        spec: ModelSpec,
        device: Optional[torch.device] = None,
        per_sample_loss: bool = True,
        table_device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        self.features = spec.features
        self.reduction = "none" if per_sample_loss else "mean"
        tables = table_device if table_device is not None else device
        self.ebc = EmbeddingBagCollection(tables=spec.table_configs(), device=tables)
        self.dense_arch = mlp(
            (spec.dense_in, *spec.dense_arch), last_activation=True, device=device
        )
        over_in = spec.dense_arch[-1] + sum(spec.dims)
        self.cross: Optional[nn.Module] = (
            LowRankCrossNet(over_in, num_layers=spec.dcn_layers, low_rank=spec.dcn_rank)
            if spec.interaction == "dcn"
            else None
        )
        self.over_arch = mlp((over_in, *spec.over_arch, 1), last_activation=False, device=device)

    def head(
        self, dense: torch.Tensor, pooled: KeyedTensor, labels: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The loss and detached logits from the dense features and the pooled embeddings."""
        by_name = pooled.to_dict()
        x = torch.cat([self.dense_arch(dense)] + [by_name[f] for f in self.features], dim=1)
        if self.cross is not None:
            x = self.cross(x)
        logits = self.over_arch(x).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(
            logits, labels, reduction=self.reduction
        )
        return loss, logits.detach()

    def forward(self, batch: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.head(batch.dense, self.ebc(batch.sparse), batch.labels)


__all__ = ["SpecDLRM", "mlp"]
