"""Malformed KeyedJaggedTensors are refused before anything trains."""

from __future__ import annotations

from typing import Any, Callable, List

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import trec_pipelines as tp
from tests.unit.fakes import (
    Batch,
    TinyModel,
    assert_same_training,
    drain,
    make_batches,
    optimizer_for,
    plain_loop,
)
from trec_pipelines.data.validation import _looks_consistent, batch_problem, kjt_problem

CPU = torch.device("cpu")
KEYS = ["f0", "f1"]
LENGTHS = torch.tensor([1, 2, 0, 3, 1, 2])  # f0: 3 values, f1: 6


def _kjt(values: torch.Tensor, lengths: torch.Tensor = LENGTHS, **kwargs: Any) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, **kwargs)


GOOD = torch.arange(9)
MALFORMED = {
    "3 extra": (
        lambda: _kjt(torch.arange(12)),
        r"key 'f1' \(the last\).*add up to 9.*has 12 \(3 extra",
    ),
    "3 missing": (
        lambda: _kjt(torch.arange(6)),
        r"key 'f1'.*add up to 9 values but values has only 6 \(3 missing",
    ),
    "half missing": (lambda: _kjt(torch.arange(4)), r"key 'f1'.*only 4 \(5 missing"),
    "f0 short": (
        lambda: _kjt(torch.arange(2), lengths=torch.tensor([1, 2, 0, 0, 0, 0])),
        r"key 'f0'.*only 2",
    ),
    "negative": (
        lambda: _kjt(GOOD, lengths=torch.tensor([1, 2, 0, 4, -1, 3])),
        r"key 'f1' has a negative length",
    ),
    "float ids": (lambda: _kjt(GOOD.float()), r"values has dtype torch.float32"),
    "weights": (
        lambda: _kjt(GOOD, weights=torch.ones(8)),
        r"weights has 8 entries but values has 9",
    ),
    "offsets": (
        lambda: KeyedJaggedTensor(
            keys=KEYS, values=GOOD, lengths=LENGTHS, offsets=torch.tensor([0, 1, 3, 3, 5, 7, 9])
        ),
        r"offsets are not the running sum of lengths",
    ),
    "length_per_key": (
        lambda: KeyedJaggedTensor(keys=KEYS, values=GOOD, lengths=LENGTHS, length_per_key=[4, 5]),
        r"key 'f0': length_per_key says 4 values but its lengths add up to 3",
    ),
    "length_per_key count": (
        lambda: KeyedJaggedTensor(keys=KEYS, values=GOOD, lengths=LENGTHS, length_per_key=[9]),
        r"length_per_key has 1 entries for 2 keys",
    ),
    "stride": (
        lambda: _kjt(GOOD[:8], lengths=torch.tensor([1, 2, 0, 3, 2]), stride=3),
        r"5 lengths for 2 keys x stride 3",
    ),
}


def test_well_formed_kjts_pass() -> None:
    assert kjt_problem(_kjt(GOOD)) is None
    assert kjt_problem(_kjt(GOOD, weights=torch.ones(9))) is None
    assert (
        kjt_problem(
            KeyedJaggedTensor.from_offsets_sync(KEYS, GOOD, torch.tensor([0, 1, 3, 3, 6, 7, 9]))
        )
        is None
    )
    assert kjt_problem(KeyedJaggedTensor.from_lengths_sync(KEYS, GOOD, LENGTHS)) is None
    assert kjt_problem(_kjt(torch.arange(0), lengths=torch.zeros(6, dtype=torch.long))) is None
    for batch in make_batches(5):
        assert kjt_problem(batch.sparse) is None


@pytest.mark.parametrize("case", list(MALFORMED))
def test_each_mismatch_is_named(case: str) -> None:
    make, message = MALFORMED[case]
    problem = kjt_problem(make())
    assert problem is not None and __import__("re").search(message, problem), problem


def test_the_fast_check_passes_the_usual_host_batch() -> None:
    # The NumPy path must cover what loaders produce, or every batch pays for the torch path.
    assert _looks_consistent(_kjt(GOOD))
    assert _looks_consistent(KeyedJaggedTensor.from_lengths_sync(KEYS, GOOD, LENGTHS))
    assert _looks_consistent(_kjt(GOOD, offsets=torch.tensor([0, 1, 3, 3, 6, 7, 9])))
    for batch in make_batches(5):
        assert _looks_consistent(batch.sparse)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_the_fast_check_never_passes_a_malformed_kjt(case: str) -> None:
    make, message = MALFORMED[case]
    assert not _looks_consistent(make())
    problem = batch_problem(make())
    assert problem is not None and __import__("re").search(message, problem), problem


@pytest.mark.parametrize("large", [False, True], ids=["list path", "numpy path"])
def test_the_fast_check_agrees_with_the_full_one_on_random_corruptions(large: bool) -> None:
    # A corruption the fast check lets through would train silently: every
    # KJT it passes, the torch path must pass too.  Small KJTs take the fast
    # check's list path, large ones (more than _SMALL lengths) its NumPy path.
    from trec_pipelines.data.validation import _SMALL

    g = torch.Generator().manual_seed(3)
    disagreements = []
    passed = 0
    for trial in range(60 if large else 400):
        keys = ["a", "b", "c"][: 1 + trial % 3]
        stride = _SMALL + 1 + trial % 5 if large else 1 + trial % 5
        lengths = torch.randint(0, 4, (len(keys) * stride,), generator=g)
        values = torch.arange(int(lengths.sum()))
        kwargs: dict = {}
        corruption = trial % 6
        if corruption == 1 and lengths.numel():
            lengths[int(torch.randint(0, lengths.numel(), (1,), generator=g))] -= 5
        elif corruption == 2:
            values = torch.arange(
                max(0, values.numel() + int(torch.randint(-3, 4, (1,), generator=g)))
            )
        elif corruption == 3:
            kwargs["offsets"] = torch.cat(
                [torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)]
            )
            if trial % 12 == 3 and lengths.numel():
                kwargs["offsets"][-1] += 1
        elif corruption == 4:
            per_key = lengths.view(len(keys), stride).sum(1).tolist()
            per_key[0] += trial % 2
            kwargs["length_per_key"] = per_key
        elif corruption == 5:
            kwargs["weights"] = torch.ones(values.numel() + trial % 2)
        kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, stride=stride, **kwargs)
        if _looks_consistent(kjt):
            passed += 1
            if kjt_problem(kjt) is not None:
                disagreements.append((trial, kjt_problem(kjt)))
        if (batch_problem(kjt) is None) != (kjt_problem(kjt) is None):
            disagreements.append((trial, "batch_problem"))
    assert not disagreements, disagreements[:5]
    assert passed > 10  # the fast path did take the well-formed ones


def _with_bad_batch(at: int, make: Callable[[], KeyedJaggedTensor]) -> List[Any]:
    batches = make_batches(6)
    good = batches[at]
    batches[at] = Batch(good.dense, make(), good.labels)
    return batches


TRAINING = [
    "TrainPipelineBase",
    "TrainPipelineSparseDist",
    "TrainPipelineSparseDistLite",
    "TrainPipelineFusedSparseDist",
    "PrefetchTrainPipelineSparseDist",
    "TrainPipelineSemiSync",
    "TrainPipelinePT2",
    "TrainPipelinePEC",
]


def _make(name: str, model: torch.nn.Module, **kwargs: Any) -> Any:
    extra: dict = {"start_batch": 100} if name == "TrainPipelineSemiSync" else {}
    if name == "TrainPipelinePT2":
        extra = {"compile_configs": tp.TorchCompileConfig(compile_on_iter=10**6)}
    return getattr(tp, name)(model, optimizer_for(model), CPU, **extra, **kwargs)


@pytest.mark.parametrize("name", TRAINING)
@pytest.mark.parametrize("at", [0, 2, 5])
@pytest.mark.parametrize("case", ["3 extra", "3 missing", "half missing"])
def test_bad_batch_raises_before_training_and_the_next_call_goes_on(
    name: str, at: int, case: str
) -> None:
    make, _ = MALFORMED[case]
    batches = _with_bad_batch(at, make)
    model, ref = TinyModel(), TinyModel()
    pipeline = _make(name, model)
    outputs = _raise_then_drain(
        pipeline, batches, rf"batch {at}: KeyedJaggedTensor batch.sparse: key 'f1'"
    )
    assert_same_training(outputs, plain_loop(ref, batches[:at] + batches[at + 1 :]), model, ref)
    assert pipeline._source.rejected == 1


def _raise_then_drain(pipeline: Any, batches: List[Any], where: str) -> List[torch.Tensor]:
    """Outputs until the bad batch's MalformedBatchError (matching ``where``), then the rest."""
    it = iter(batches)
    outputs: List[torch.Tensor] = []
    with pytest.raises(tp.MalformedBatchError, match=rf"{where}.*next progress\(\) goes on"):
        while True:
            outputs.append(pipeline.progress(it))
    return outputs + drain(pipeline, it)


@pytest.mark.parametrize("name", TRAINING)
def test_validate_batches_false_turns_the_checks_off(name: str) -> None:
    batches = _with_bad_batch(2, MALFORMED["3 extra"][0])  # extra values: trains without an error
    model = TinyModel()
    assert len(drain(_make(name, model, validate_batches=False), iter(batches))) == 6


@pytest.mark.parametrize("loader_thread", [None, True], ids=["inline", "thread"])
@pytest.mark.parametrize("at", [0, 2, 5])
def test_eval_drops_a_bad_batch_and_goes_on_with_the_next(loader_thread: Any, at: int) -> None:
    # Eval's loader (inline or on its thread) raises the malformed batch's
    # error once and keeps loading: nothing after it is dropped.
    from tests.unit.test_schedule_lite_eval import eval_pipeline, plain_eval

    batches = _with_bad_batch(at, MALFORMED["3 missing"][0])
    model, ref = TinyModel(), TinyModel()
    pipeline = eval_pipeline(model, loader_thread=loader_thread)
    outputs = _raise_then_drain(pipeline, batches, rf"batch {at}: ")
    assert_same_training(outputs, plain_eval(ref, batches[:at] + batches[at + 1 :]), model, ref)
    assert pipeline._source.rejected == 1


def test_the_fast_walk_finds_the_kjts_the_rewrite_finds() -> None:
    # batch_problem's walk (no paths) must see every KJT kjt_fields sees, nested or not.
    from types import SimpleNamespace

    from trec_pipelines.data.validation import kjts_in
    from trec_pipelines.model.rewrite import kjt_fields

    k = lambda: _kjt(GOOD)  # noqa: E731
    nested = [
        k(),
        {"a": k(), "b": [k(), (k(), torch.zeros(1))], 3: {"c": k()}, ("t",): k()},
        SimpleNamespace(x=SimpleNamespace(y=[{"z": k()}]), w=torch.ones(2)),
        [[[[k()]]]],
        [[[[[k()]]]]],  # deeper than the rewrite looks
        make_batches(1)[0],
    ]
    for batch in nested:
        assert [id(t) for t in kjts_in(batch)] == [id(t) for _, t in kjt_fields(batch)], batch
