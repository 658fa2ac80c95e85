"""Every method of torchrec's same-named class is honoured, allowed with a warning, or refused (generated).

For each of our classes and each method a subclass of torchrec's class could
override (public and protected, on this torchrec, and the class attribute
``_pipelined_forward_type``), one of:

* honoured: ours defines it with torchrec's parameters, in torchrec's order
  (ours may add keyword-only ones or ones with defaults);
* uncalled: neither torchrec's class nor ours calls it, so a subclass that
  defines it is created, with one warning naming the hook, however many times
  its class statement runs;
* refused: torchrec's class calls it and ours cannot honour it, so a subclass
  that defines it is a ``TypeError`` as the class is created, naming the hook
  and what to override instead.

That ours calls the honoured hooks as torchrec does, and that neither calls
the uncalled ones, is checked on 2 ranks (tests/distributed/test_hooks.py);
so is that each class leaves on the user's model the module and parameter
hooks torchrec's leaves (tests/distributed/test_model_hooks.py), counted by
``model_hooks``, whose own check is here.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, List

import pytest
import torch

from tests.hook_parity import model_hooks, ours, pairs, parameters, reached, torchrec_class
from trec_pipelines.core.subclass_hooks import (
    Refused,
    Uncalled,
    UncalledHookWarning,
    decided_hooks,
    refused_hooks,
    uncalled_hooks,
)

PAIRS = pairs()


def test_the_pairs_cover_every_class_this_torchrec_has() -> None:
    assert len({name for name, _ in PAIRS}) >= 18
    assert len(PAIRS) > 400
    assert ("TrainPipelineSparseDist", "_pipelined_forward_type") in PAIRS


def _user_subclass(cls: type, hook: str) -> type:
    """A subclass as a user writes one (outside this package) that defines ``hook``."""
    stub: Any = PipelinedStub if hook == "_pipelined_forward_type" else _stub
    return type("UserSubclass", (cls,), {hook: stub, "__module__": "user"})


def _stub(self: Any, *args: Any, **kwargs: Any) -> None:
    pass


class PipelinedStub:
    """A forward wrapper class of the user's own (for ``_pipelined_forward_type``)."""


@pytest.mark.parametrize(("name", "hook"), PAIRS, ids=[f"{n}.{h}" for n, h in PAIRS])
def test_hook_is_honoured_with_torchrecs_signature_or_allowed_with_a_warning_or_refused(
    name: str, hook: str
) -> None:
    cls = ours(name)
    decision = decided_hooks(cls).get(hook)
    if isinstance(decision, Refused):
        with pytest.raises(TypeError) as refusal:
            _user_subclass(cls, hook)
        message = str(refusal.value)
        assert hook in message and "torchrec's" in message and "instead" in message, message
        assert decision.instead in message, message
        return
    if isinstance(decision, Uncalled):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # The same class statement run twice (as in a function) warns once.
            first, again = _user_subclass(cls, hook), _user_subclass(cls, hook)
        assert issubclass(first, cls) and issubclass(again, cls)
        assert first.__dict__[hook] is again.__dict__[hook]
        ours_warned = [w for w in caught if issubclass(w.category, UncalledHookWarning)]
        assert len(ours_warned) == 1, [str(w.message) for w in ours_warned]
        message = str(ours_warned[0].message)
        assert f"overrides {hook}," in message, message
        assert "does not call" in message and "nor does torchrec's" in message, message
        assert "no effect" in message and decision.instead in message, message
        # It points at the class statement, not at our code.
        assert ours_warned[0].filename != inspect.getsourcefile(decided_hooks), message
        return
    assert hasattr(cls, hook), f"{name} neither defines nor decides on torchrec's {hook}"
    theirs = torchrec_class(name)
    assert theirs is not None
    if hook == "_pipelined_forward_type" or not callable(getattr(theirs, hook)):
        return
    try:
        expected = parameters(theirs, hook)
    except (TypeError, ValueError):  # a builtin without a signature
        return
    got = parameters(cls, hook)
    assert got[: len(expected)] == expected, (name, hook, expected, got)
    extra = inspect.signature(getattr(cls, hook)).parameters
    for extra_name in got[len(expected) :]:
        parameter = extra[extra_name]
        assert parameter.default is not inspect.Parameter.empty or parameter.kind in (
            inspect.Parameter.VAR_KEYWORD,
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.KEYWORD_ONLY,
        ), (name, hook, extra_name)


def test_a_subclass_that_stubs_the_first_pipeline_api_is_created() -> None:
    """torchrec's own Eval test stubs _start_sparse_data_dist and _wait_sparse_data_dist
    with ``pass``: harmless on torchrec (nothing calls them), and so here."""
    from trec_pipelines import EvalPipelineSparseDist

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        class StubbingPipeline(EvalPipelineSparseDist[Any, Any]):
            def _start_sparse_data_dist(self, batch: Any) -> None:
                pass

            def _wait_sparse_data_dist(self) -> None:
                pass

    warned = sorted(
        str(w.message).split(" overrides ")[1].split(",")[0]
        for w in caught
        if issubclass(w.category, UncalledHookWarning)
    )
    assert warned == ["_start_sparse_data_dist", "_wait_sparse_data_dist"]
    assert all(w.filename == __file__ for w in caught), [w.filename for w in caught]
    assert issubclass(StubbingPipeline, EvalPipelineSparseDist)


DECIDED = [(n, h) for n, h in PAIRS if h in decided_hooks(ours(n))]


@pytest.mark.parametrize(("name", "hook"), DECIDED, ids=[f"{n}.{h}" for n, h in DECIDED])
def test_the_decision_follows_torchrecs_source(name: str, hook: str) -> None:
    """Refused only where torchrec's class reaches the hook from its constructor,
    progress(), attach/detach/reset or finaliser; allowed with a warning only where it
    never does.  One reached hook is still never called: _submit_inplace_copy, behind
    the async_inplace_copy flag, in a class whose constructor does not take it."""
    theirs = torchrec_class(name)
    assert theirs is not None
    decision = decided_hooks(ours(name))[hook]
    called = hook in reached(theirs)
    if isinstance(decision, Refused):
        assert called, f"torchrec's {name} never calls {hook}: allow it with a warning"
        return
    takes_flag = "async_inplace_copy" in inspect.signature(theirs.__init__).parameters
    if hook == "_submit_inplace_copy" and not takes_flag:
        return
    assert not called, f"torchrec's {name} calls {hook}: an override takes effect there"


def test_a_hook_is_uncalled_or_refused_never_both() -> None:
    for name, _ in PAIRS:
        cls = ours(name)
        assert not set(uncalled_hooks(cls)) & set(refused_hooks(cls)), name


def test_our_own_classes_are_not_checked() -> None:
    """The decisions are for users' subclasses: our variants define what they decide on."""
    from trec_pipelines.pipelines.sparse_dist import TrainPipelineSparseDist

    assert "_pipelined_forward_type" in refused_hooks(TrainPipelineSparseDist)
    assert "_pipelined_forward_type" in TrainPipelineSparseDist.__dict__


def test_the_census_sees_every_kind() -> None:
    """model_hooks counts each kind where it was registered (so an equal census
    means equal hooks, not two blind counts)."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    inner = model[0]
    handles: List[Any] = [
        model.register_forward_hook(lambda *a: None),
        model.register_forward_hook(lambda *a: None, with_kwargs=True, always_call=True),
        inner.register_forward_pre_hook(lambda *a: None),
        inner.register_forward_pre_hook(lambda *a, **k: None, with_kwargs=True),
        inner.register_full_backward_hook(lambda *a: None),
        inner.register_full_backward_pre_hook(lambda *a: None),
        inner.weight.register_hook(lambda grad: None),
        inner.bias.register_post_accumulate_grad_hook(lambda param: None),
    ]
    assert model_hooks(model) == {
        ("", "forward"): 1,
        ("", "forward+kwargs+always_call"): 1,
        ("0", "forward_pre"): 1,
        ("0", "forward_pre+kwargs"): 1,
        ("0", "backward"): 1,
        ("0", "backward_pre"): 1,
        ("0.weight", "grad"): 1,
        ("0.bias", "post_accumulate_grad"): 1,
    }
    for handle in handles:
        handle.remove()
    assert model_hooks(model) == {}
