"""The peer-failure watch of a model's forward wraps the forward, not hooks on the model.

:class:`~trec_pipelines.core.forward_watch.WatchedForward` replaces
``model.forward`` on the instance while a ``SparseDataDistUtil`` is attached:
the model's hooks stay as the user (and torchrec's class) left them, the
forward's result and errors pass through unchanged, and ``remove()`` gives the
model back the forward it had.  With a fake of the process's failure news
(several ranks are not needed to see what the watch tells them): each forward
is a new step, a forward that went through retracts a standing failure, and
one that raised, or whose forward hook raised, is published with its batch.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any, List, Optional, Tuple

import pytest
import torch

from tests.hook_parity import model_hooks
from trec_pipelines.core import forward_watch, peer_failure


class Doubles(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("bad batch\nsecond line")
        return 2 * x


class Before:
    def __init__(self) -> None:
        self.calls: List[Tuple[Any, Any]] = []

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        self.calls.append((module, args))


def _watch(model: torch.nn.Module, before: Before) -> forward_watch.WatchedForward:
    return forward_watch.WatchedForward(model, lambda: 7, before=before)


def test_the_model_keeps_its_hooks_and_gets_its_forward_back() -> None:
    model, before = Doubles(), Before()
    user_hook = model.register_forward_hook(lambda *args: None)
    hooks = model_hooks(model)
    watch = _watch(model, before)
    assert model_hooks(model) == hooks  # the user's one hook, nothing more
    x = torch.ones(2)
    assert torch.equal(model(x), 2 * x)
    assert len(before.calls) == 1 and before.calls[0][0] is model
    assert torch.equal(before.calls[0][1][0], x)
    model.fail = True
    with pytest.raises(ValueError, match="bad batch"):
        model(x)
    assert len(before.calls) == 2
    watch.remove()
    assert "forward" not in model.__dict__
    model.fail = False
    model(x)
    assert len(before.calls) == 2  # no longer watched
    assert model_hooks(model) == hooks
    user_hook.remove()


def test_the_forward_reads_as_the_models_own_while_watched() -> None:
    """Code that inspects ``model.forward`` (its signature, name, docstring) sees the
    model's forward, as without a pipeline attached."""
    model = Doubles()
    signature, name = inspect.signature(model.forward), model.forward.__name__
    watch = _watch(model, Before())
    assert model.forward is watch
    assert inspect.signature(model.forward) == signature
    assert list(signature.parameters) == ["x"]
    assert model.forward.__name__ == name == "forward"
    watch.remove()
    assert inspect.signature(model.forward) == signature


def test_an_instance_forward_of_the_users_is_put_back() -> None:
    model, before = Doubles(), Before()

    def own(x: torch.Tensor) -> torch.Tensor:
        return 3 * x

    model.forward = own  # type: ignore[method-assign]
    watch = _watch(model, before)
    assert torch.equal(model(torch.ones(1)), torch.full((1,), 3.0))
    watch.remove()
    assert model.__dict__["forward"] is own


def test_a_wrapper_put_on_after_the_watch_stays_and_the_watch_passes_through() -> None:
    model, before = Doubles(), Before()
    watch = _watch(model, before)
    theirs = model.forward

    def wrapper(x: torch.Tensor) -> torch.Tensor:
        return theirs(x) + 1

    model.forward = wrapper  # type: ignore[method-assign]
    watch.remove()
    assert model.__dict__["forward"] is wrapper
    assert torch.equal(model(torch.ones(1)), torch.full((1,), 3.0))
    assert before.calls == []  # removed: it only passes the call on


class FakeNews:
    """Stands in for the process's failure news of several ranks."""

    def __init__(self) -> None:
        self.step: Optional[int] = None
        self._step_numbers = itertools.count(1)
        self.failures: List[Tuple[str, Optional[int]]] = []
        self.retracts = 0

    def begin_step(self) -> None:
        self.step = next(self._step_numbers)

    def failed(self, description: str, index: Optional[int]) -> None:
        self.failures.append((description, index))

    def retract(self) -> None:
        self.retracts += 1


@pytest.fixture
def news(monkeypatch: pytest.MonkeyPatch) -> FakeNews:
    fake = FakeNews()
    monkeypatch.setattr(peer_failure, "news", lambda: fake)
    return fake


def test_each_forward_is_a_step_and_a_raising_one_is_published(news: FakeNews) -> None:
    model = Doubles()
    _watch(model, Before())
    model(torch.ones(1))
    assert (news.step, news.retracts, news.failures) == (1, 1, [])
    model.fail = True
    with pytest.raises(ValueError) as raised:
        model(torch.ones(1))
    assert news.step == 2
    assert news.failures == [("the model's forward raised ValueError: bad batch", 7)]
    notes = "".join(getattr(raised.value, "__notes__", []))
    assert "this rank's forward raised" in notes and "ends its process" in notes, notes


def test_a_forward_hook_that_raises_is_published_as_the_forward(news: FakeNews) -> None:
    """What the util's forward hook does (wait for the next batch's input) is part
    of the model's call: its error is told to the other ranks too."""
    model = Doubles()
    watch = _watch(model, Before())

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        try:
            raise RuntimeError("the wait failed")
        except RuntimeError:
            watch.raised()
            raise

    model.register_forward_hook(hook)
    with pytest.raises(RuntimeError, match="the wait failed"):
        model(torch.ones(1))
    assert news.failures == [("the model's forward raised RuntimeError: the wait failed", 7)]
