"""What SemiSync says at its start: when torchrec's ``start_batch`` keeps a run synchronous,
and when its optimizer holds parameters the fused optimizer updates."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from trec_pipelines.model.rewrite import PipelinedModule
from trec_pipelines.sparse.deferred_lookup import DeferralPlan

logger: logging.Logger = logging.getLogger("trec_pipelines.pipelines.semi_sync")

# torchrec's default start_batch: shorter runs never leave the synchronous start.
TORCHREC_START_BATCH = 900


def say_synchronous_start(name: str, first_index: Optional[int], start_batch: int) -> None:
    """One INFO line when the first batch (``first_index``) trains synchronously.

    Until ``start_batch`` each lookup waits for the previous update, as
    SparseDist's does: a run shorter than that (torchrec's default is 900
    batches) trains bit for bit as SparseDist and nothing else shows it.
    """
    if first_index is None or first_index >= start_batch:
        return
    default = ", torchrec's default" if start_batch == TORCHREC_START_BATCH else ""
    logger.info(
        "%s: synchronous until batch %d (start_batch=%d%s): until then each batch is looked "
        "up after the previous batch's update, as TrainPipelineSparseDist trains; pass "
        "start_batch=0 (or another number) to overlap them sooner",
        name,
        start_batch,
        start_batch,
        default,
    )


def report_shared_parameters(
    name: str,
    optimizer: torch.optim.Optimizer,
    pipelined: Sequence[PipelinedModule],
    deferral: Optional[DeferralPlan],
    strict: bool,
) -> None:
    """Warn (``strict``: raise ``ValueError``) when ``optimizer`` holds parameters of
    ``pipelined`` modules.

    The tables looked up in the forward (``deferral``'s deferred ones: dense kernel,
    ``data_parallel`` ones among them) have no fused optimizer: the optimizer is meant
    to hold them.
    """
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    shared = [
        p.name
        for p in pipelined
        if any(
            id(param) in held and not (deferral is not None and deferral.is_deferred(p.name, n))
            for n, param in p.module.named_parameters()
        )
    ]
    if not shared:
        return
    message = (
        f"{name}: the optimizer holds parameters of the pipelined "
        f"module(s) {shared}. Their gradients arrive in embedding_backward, and "
        "semi-sync training expects the fused (in-backward) optimizer to update "
        "them there; stepping them with the dense optimizer as well can hurt "
        "convergence. Pass an optimizer over the other parameters only, e.g. "
        "KeyedOptimizerWrapper(dict(in_backward_optimizer_filter("
        "model.named_parameters())), ...)"
    )
    if strict:
        raise ValueError(message + ", or strict=False to only warn.")
    logger.warning(message + ".")
