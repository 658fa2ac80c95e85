"""A user's subclass of TrainPipelineSparseDist, written as users write them.

Its annotations are postponed, and the names they use (``Unpack`` and the
options ``TypedDict``) are imported for type checkers only: at run time they do
not exist in this module.  Defining, building and training it must not need
them (tests/unit/test_options.py, tests/distributed/test_sparse_dist.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trec_pipelines import TrainPipelineSparseDist

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from trec_pipelines.assembly.options import SparseDistTrainOptions


class TaggedSparseDist(TrainPipelineSparseDist[Any, Any]):
    """SparseDist with a parameter of the user's own, forwarding every option."""

    def __init__(
        self, *args: Any, tag: str = "", **options: Unpack[SparseDistTrainOptions]
    ) -> None:
        super().__init__(*args, **options)
        self.tag = tag
