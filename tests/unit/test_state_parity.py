"""Every attribute torchrec's pipelines set in ``__init__`` is honoured or not applicable.

For each class torchrec has (on this stack), the attributes its ``__init__``
and its bases' assign are read from their source; each must exist on our
instance of the same class (that it then reads as torchrec's, through an
epoch, is checked on 2 ranks in tests/distributed/test_state.py), or be
listed in :data:`tests.state_parity.NOT_APPLICABLE` with the reason.  A new
torchrec attribute fails here until it is decided.
"""

from __future__ import annotations

import pathlib
from typing import Any, Dict, List, Tuple

import pytest
import torch

from tests.hook_parity import CLASSES, ours, torchrec_class
from tests.state_parity import (
    NOT_APPLICABLE,
    NOT_APPLICABLE_IN,
    UNTIL_THE_END,
    init_attributes,
    not_applicable,
)
from trec_pipelines import PipelineStage

GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "migrating.md"

CPU = torch.device("cpu")

# Constructor arguments beyond (model, optimizer, device), per class.
_KWARGS: Dict[str, Dict[str, Any]] = {
    name: {"site_fqn": "linear"}
    for name in (
        "TrainPipelineSparseDistBwdOpt",
        "TrainPipelineSparseDistOptStash",
        "TrainPipelineSparseDistEmbStash",
        "TrainPipelinePrefetchEMS",
    )
}


def _construct(name: str) -> Any:
    """Our ``name`` over a small dense model on CPU (construction needs no process group)."""
    model = torch.nn.Linear(2, 2)
    if name == "StagedTrainPipeline":
        return ours(name)([PipelineStage("copy", lambda batch: batch, None)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return ours(name)(model, optimizer, CPU, **_KWARGS.get(name, {}))


def _pairs() -> List[Tuple[str, str]]:
    out = []
    for name in CLASSES:
        theirs = torchrec_class(name)
        if theirs is not None:
            out.extend((name, attribute) for attribute in init_attributes(theirs))
    return out


PAIRS = _pairs()


def test_the_pairs_cover_every_class_this_torchrec_has() -> None:
    assert len({name for name, _ in PAIRS}) >= 18
    assert len(PAIRS) > 500


@pytest.mark.parametrize(("name", "attribute"), PAIRS, ids=[f"{n}.{a}" for n, a in PAIRS])
def test_attribute_is_honoured_or_not_applicable(name: str, attribute: str) -> None:
    reason = not_applicable(name).get(attribute)
    if reason is not None:
        assert len(reason) > 20, (name, attribute, reason)
        return
    pipeline = _construct(name)
    assert hasattr(pipeline, attribute), (
        f"ours {name} has no {attribute!r}, which torchrec's __init__ sets: honour it "
        "(a property onto the part of ours that owns it) or list it in "
        "tests/state_parity.py with the reason"
    )


def test_every_listed_attribute_is_one_torchrec_sets() -> None:
    """No stale entries: each attribute listed is set by some torchrec class here, or
    by the other stack's torchrec (those are named)."""
    everywhere = {attribute for _, attribute in PAIRS}
    # torchrec 1.9.2 only (TrainPipelinePEC is new in 1.9.2).
    other_stack = {"_inplace_copy_executor", "_input_dist_event", "_overlap_dist_event"}
    listed = set(NOT_APPLICABLE) | set(UNTIL_THE_END)
    listed |= {a for per_class in NOT_APPLICABLE_IN.values() for a in per_class}
    assert listed - everywhere <= other_stack, listed - everywhere
    assert set(NOT_APPLICABLE_IN) <= set(CLASSES)
    for name, per_class in NOT_APPLICABLE_IN.items():
        theirs = torchrec_class(name)
        if theirs is not None:
            assert set(per_class) <= set(init_attributes(theirs)) | other_stack, name


def guide_rows() -> List[str]:
    """The migration guide's not-applicable table, one row per (attribute, class)."""
    rows = [f"| `{a}` | every class that has it | {why} |" for a, why in NOT_APPLICABLE.items()]
    for name, per_class in NOT_APPLICABLE_IN.items():
        rows += [f"| `{a}` | {name} | {why} |" for a, why in per_class.items()]
    return rows


def test_the_migration_guide_lists_every_attribute_not_applicable_with_its_reason() -> None:
    text = GUIDE.read_text()
    missing = [row for row in guide_rows() if row not in text]
    assert not missing, "the guide's 'Subclassing' table lacks (or words otherwise):\n" + (
        "\n".join(missing)
    )
    for attribute in UNTIL_THE_END:
        assert f"`{attribute}` after the end of the data" in text
