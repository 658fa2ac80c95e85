"""Every method of torchrec's same-named class is honoured or refused out loud (generated).

For each of our classes and each method a subclass of torchrec's class could
override (public and protected, on this torchrec): either ours refuses it (a
subclass defining it is a ``TypeError`` as the class is created, naming the
hook and what to override instead), or ours defines it with torchrec's
parameters, in torchrec's order (ours may add keyword-only ones).  That ours
then calls it as torchrec does is checked on 2 ranks
(tests/distributed/test_hooks.py).
"""

from __future__ import annotations

import inspect

import pytest

from tests.hook_parity import ours, pairs, parameters, torchrec_class
from trec_pipelines.core.hooks import refused_hooks

PAIRS = pairs()


def test_the_pairs_cover_every_class_this_torchrec_has() -> None:
    assert len({name for name, _ in PAIRS}) >= 18
    assert len(PAIRS) > 400


@pytest.mark.parametrize(("name", "hook"), PAIRS, ids=[f"{n}.{h}" for n, h in PAIRS])
def test_hook_is_honoured_with_torchrecs_signature_or_refused(name: str, hook: str) -> None:
    cls = ours(name)
    refused = refused_hooks(cls)
    if hook in refused:
        with pytest.raises(TypeError) as refusal:
            type("UserSubclass", (cls,), {hook: lambda self, *a, **k: None, "__module__": "user"})
        message = str(refusal.value)
        assert hook in message and "instead" in message, message
        return
    assert hasattr(cls, hook), f"{name} neither defines nor refuses torchrec's {hook}"
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


def test_our_own_subclasses_are_not_checked() -> None:
    """The refusals are for users' subclasses: our variants define what they replace."""
    from trec_pipelines.pipelines.semi_sync import TrainPipelineSemiSync

    assert "_optimizer_step" in refused_hooks(TrainPipelineSemiSync)
