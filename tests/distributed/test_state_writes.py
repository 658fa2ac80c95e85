"""Writes of torchrec's attributes take effect on ours as on torchrec's, on 2 gloo ranks.

The subclass is written as outside code writes it against torchrec: its
``_next_batch`` switches iterators through ``_dataloader_iter`` and, when any
rank's data is out (an all-reduce of "has a batch"), ends the epoch by
setting ``_dataloader_exhausted = True`` and returning None.  The same
subclass of torchrec's class and of ours trains the same uneven data over
two epochs (two iterators); outputs and final weights must be equal bit for
bit, and equal to the plain loop over the batches every rank has.  A write
from outside, between steps, ends the epoch too: the batches in flight still
train and nothing more is pulled.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from tests.hook_parity import ours, torchrec_class
from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import (
    DLRM,
    Run,
    assert_runs_equal,
    current_group,
    make_batches,
    make_sharded,
    plain_loop,
    weights,
)
from trec_pipelines.testing.references import plain_loop_of

DEVICE = devices.device()
SEED, DATA_SEED, SECOND_SEED = 1234, 5, 9
# Batches per rank in each epoch: rank 0's, then every other rank's (whose data ends first).
FIRST, SECOND = (7, 5), (4, 3)


def ending_on_any_rank(base: type) -> type:
    """``base`` with the outside-style ``_next_batch`` described in the module docstring.

    Against torchrec's Base, which has no ``_dataloader_iter``, it writes Base's
    own flag, ``_data_iter_stopped``, and the loop calls ``reset()`` between
    epochs, as torchrec's Base needs.
    """
    base_like = base.__name__ == "TrainPipelineBase"
    flag = "_data_iter_stopped" if base_like else "_dataloader_exhausted"

    class EndingOnAnyRank(base):  # type: ignore[misc, valid-type]
        def _next_batch(self, dataloader_iter: Iterator[Any]) -> Optional[Any]:
            if not base_like and dataloader_iter is not self._dataloader_iter:
                self._dataloader_iter = dataloader_iter
                self._dataloader_exhausted = False
            if getattr(self, flag):
                batch = None
            else:
                batch = next(dataloader_iter, None)
            has_batch = torch.tensor([int(batch is not None)], device=self._device)
            dist.all_reduce(has_batch, op=dist.ReduceOp.MIN, group=current_group())
            if not has_batch.item():
                setattr(self, flag, True)
                return None
            return batch

    return EndingOnAnyRank


def _mine(counts: tuple, seed: int) -> List[Any]:
    return make_batches(counts[min(dist.get_rank(), 1)], seed=seed)


def _two_epochs(cls: type) -> Run:
    """Train two epochs, each over its own iterator, until StopIteration."""
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = cls(dmp, optimizer, DEVICE)
    outputs: List[torch.Tensor] = []
    base_like = "TrainPipelineBase" in [k.__name__ for k in cls.__mro__]
    for counts, seed in ((FIRST, DATA_SEED), (SECOND, SECOND_SEED)):
        if base_like:
            pipeline.reset()
        it = iter(_mine(counts, seed))
        while True:
            try:
                outputs.append(pipeline.progress(it).detach().clone())
            except StopIteration:
                break
        assert base_like or pipeline._dataloader_iter is it
    return Run(outputs, weights(dmp))


def _plain() -> Run:
    """The plain loop over the batches every rank has, epoch after epoch."""
    kept = _mine(FIRST, DATA_SEED)[: min(FIRST)] + _mine(SECOND, SECOND_SEED)[: min(SECOND)]
    return plain_loop_of(DLRM, "table_wise", kept, seed=SEED)


@pytest.mark.parametrize("name", ["TrainPipelineSparseDist", "TrainPipelineBase"])
def test_a_next_batch_that_ends_the_epoch_on_any_rank_trains_as_on_torchrec(name: str) -> None:
    theirs = torchrec_class(name)
    assert theirs is not None
    reference = _two_epochs(ending_on_any_rank(theirs))
    assert len(reference) == min(FIRST) + min(SECOND)
    assert_runs_equal(_plain(), reference, ("plain loop over the common batches", name))
    got = _two_epochs(ending_on_any_rank(ours(name)))
    assert_runs_equal(reference, got, ("torchrec", name))


def _ended_from_outside(cls: type, flag: str, after: int) -> Tuple[Run, bool]:
    """Train, set ``flag`` (``_dataloader_exhausted``, Base: ``_data_iter_stopped``) to
    True after ``after`` steps, train on until StopIteration; the run, and what the
    flag reads at the end."""
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=SEED)
    pipeline = cls(dmp, optimizer, DEVICE)
    it = iter(make_batches(8, seed=DATA_SEED))
    outputs: List[torch.Tensor] = []
    while True:
        if len(outputs) == after:
            setattr(pipeline, flag, True)
        try:
            outputs.append(pipeline.progress(it).detach().clone())
        except StopIteration:
            break
    return Run(outputs, weights(dmp)), getattr(pipeline, flag)


# name -> (the flag, how many batches train when it is set after 3 steps: SparseDist's two
# in flight still train; Base's copied batch does not, its next progress() ends the epoch).
OUTSIDE = {
    "TrainPipelineSparseDist": ("_dataloader_exhausted", 5),
    "TrainPipelineBase": ("_data_iter_stopped", 3),
}


@pytest.mark.parametrize("name", sorted(OUTSIDE))
def test_setting_the_end_of_data_between_steps_ends_the_epoch_as_on_torchrec(name: str) -> None:
    flag, trained = OUTSIDE[name]
    theirs = torchrec_class(name)
    assert theirs is not None
    reference, theirs_flag = _ended_from_outside(theirs, flag, after=3)
    assert len(reference) == trained
    plain = plain_loop(
        *make_sharded(DLRM, "table_wise", seed=SEED), make_batches(trained, seed=DATA_SEED)
    )
    assert_runs_equal(plain, reference, (f"plain loop over the first {trained}", name))
    got, ours_flag = _ended_from_outside(ours(name), flag, after=3)
    assert_runs_equal(reference, got, ("torchrec", name))
    assert ours_flag is theirs_flag is True
