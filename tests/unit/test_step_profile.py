"""The step profile's rule for giving a call to a part (benchmarks.measuring.step_profile).

Its numbers describe a step and no test holds them; what is held here is the rule:
a call made by a function of ours is that function's part's own, a call made
inside torch or torchrec under one of ours is that part's "in library", and a call
with no frame of ours below it is plain.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from benchmarks.measuring.step_profile import PLAIN, Profile, _Attributor, part_of
from trec_pipelines.data import validation


def _profiled(fn: Any, *args: Any) -> Profile:
    profile = Profile("test")
    with _Attributor(profile).active():
        fn(*args)
    return profile


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"], values=torch.arange(5), lengths=torch.tensor([1, 2, 0, 2])
    )


def test_a_module_of_ours_names_its_part() -> None:
    assert part_of("data/validation.py") == "validation"
    assert part_of("data/agreement.py") == "agreement"
    assert part_of("data/source.py") == "batch source"
    assert part_of("pipelines/sparse_dist.py") == "timeline"
    assert part_of("core/peer_failure.py") == "step guard / peer failure"
    assert part_of("elastic.py") == "other-ours"


def test_calls_of_ours_are_its_parts_and_the_rest_is_plain() -> None:
    kjt = _kjt()
    profile = _profiled(validation.kjt_problem, kjt)
    # Only the validation's functions ran, and what they asked of torch and torchrec.
    assert set(profile.own) <= {"validation", PLAIN}, profile.own
    assert profile.own["validation"] > 0
    # The KJT's own methods called by the validation make calls of their own: in library.
    assert set(profile.library) == {"validation"}, profile.library
    assert all(f.startswith("data/validation.py:") for f in profile.functions), profile.functions
    # A call of the test's own, with nothing of ours below it, is plain; nothing else counts.
    plain = _profiled(lambda: torch.ones(2).sum())
    assert set(plain.own) == {PLAIN} and not plain.library, plain
    assert plain.total == plain.own[PLAIN] >= 2  # torch.ones and sum, at least
