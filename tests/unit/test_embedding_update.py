"""The embedding backward cut at torchrec's collective waits (SemiSync's table update).

A stand-in for torchrec's ``*_Req`` functions (whose backward waits for the
gradient collective) marks the cut; the checks are against the gradients one
whole backward gives.
"""

from __future__ import annotations

import threading
from typing import Any, List, Tuple

import pytest
import torch

from trec_pipelines.sparse import embedding_update
from trec_pipelines.sparse.embedding_update import EmbeddingUpdate, waiting_edges

CPU = torch.device("cpu")
# Threads the stand-in's backward ran on.
RAN_ON: List[str] = []


class _Req(torch.autograd.Function):
    """Identity; its backward stands where torchrec's waits for a collective."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        RAN_ON.append(threading.current_thread().name)
        if getattr(_Req, "fail", False):
            raise OSError("link down")
        return grad


@pytest.fixture(autouse=True)
def stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedding_update, "_WAITING", (_Req,))
    monkeypatch.setattr(_Req, "fail", False, raising=False)
    RAN_ON.clear()


def graph(bypass: bool = False) -> Tuple[torch.nn.Parameter, torch.Tensor]:
    """``out = 3 * Req(2 * w)`` (plus ``w`` itself, which skips the wait, with ``bypass``)."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    out = 3 * _Req.apply(2 * w)
    return w, out + w if bypass else out


def test_the_cut_is_where_the_backward_waits() -> None:
    _, out = graph()
    edges = waiting_edges([out])
    assert edges is not None and len(edges) == 1
    assert edges[0].node.__class__.__name__ == "_ReqBackward"


def test_no_cut_when_a_path_skips_the_wait_or_none_waits() -> None:
    assert waiting_edges([graph(bypass=True)[1]]) is None
    w = torch.nn.Parameter(torch.ones(2))
    assert waiting_edges([w * 5]) is None


def test_deferred_update_lands_at_join_with_the_whole_backwards_gradient() -> None:
    w, out = graph()
    update = EmbeddingUpdate(CPU)
    update.send([out], [torch.ones(2)], defer=True)
    assert w.grad is None and RAN_ON == []  # sent up to the wait only
    update.start(batch=7)
    update.join()
    assert torch.equal(w.grad, torch.full((2,), 6.0))
    assert RAN_ON == ["trec_pipelines-embedding-update"]  # the CPU's worker thread
    assert not update.in_flight


def test_not_deferred_or_uncuttable_runs_whole_at_once() -> None:
    for defer, bypass in ((False, False), (True, True)):
        w, out = graph(bypass)
        update = EmbeddingUpdate(CPU)
        update.send([out], [torch.ones(2)], defer=defer)
        expected = 7.0 if bypass else 6.0
        assert torch.equal(w.grad, torch.full((2,), expected))
        update.start(batch=0)
        assert not update.in_flight


def test_on_an_accelerator_the_second_half_runs_in_join() -> None:
    w, out = graph()
    update = EmbeddingUpdate(torch.device("meta"))  # anything but the CPU: no worker
    update.send([out], [torch.ones(2)], defer=True)
    update.start(batch=1)
    assert update.in_flight and w.grad is None
    update.join()
    assert torch.equal(w.grad, torch.full((2,), 6.0))
    assert RAN_ON == [threading.current_thread().name]


def test_a_failed_update_raises_at_join_naming_the_batch() -> None:
    _Req.fail = True  # type: ignore[attr-defined]
    _, out = graph()
    update = EmbeddingUpdate(CPU)
    update.send([out], [torch.ones(2)], defer=True)
    update.start(batch=5)
    with pytest.raises(
        RuntimeError, match="embedding update of batch 5 failed: OSError: link down"
    ):
        update.join()
    update.join()  # reported once


def test_drop_forgets_what_was_sent_and_not_started() -> None:
    w, out = graph()
    update = EmbeddingUpdate(CPU)
    update.send([out], [torch.ones(2)], defer=True)
    update.drop()
    update.start(batch=0)
    update.join()
    assert w.grad is None
