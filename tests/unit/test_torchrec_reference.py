"""testing.torchrec_reference.takes: what a reference class's signature names."""

from __future__ import annotations

from typing import Any

from trec_pipelines.testing.torchrec_reference import takes


class Named:
    def __init__(self, model: Any, *args: Any, option: bool = False, **kwargs: Any) -> None:
        pass


def test_a_named_parameter_is_taken_and_kwargs_alone_takes_nothing() -> None:
    assert takes(Named, "model") and takes(Named, "option")
    assert not takes(Named, "enable_embedding_lookup_prefetch")
    assert not takes(Named, "self")
