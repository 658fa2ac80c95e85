"""The memory ledger against each variant's documented schedule and depth.

Reference, written down independently of the walker:

* the documented depth of every variant (docs/guides/variants.md, "batches in flight");
* which batches a variant holds at each recorded action, from its recorded
  schedule: a batch is held from the top of the ``progress()`` call that
  copies it (each call pulls the host batches it will copy before any work)
  until the end of the call that trains it; SemiSync lets go of ``cur``
  right after its forward (only the autograd graph needs it from there),
  and so does Base; PT2 lets go of it at the top of the next call, before
  that call's copy;
* the bytes of a batch: numel x element size of its five tensors, each of
  which owns its storage.
"""

from __future__ import annotations

from typing import Any, Dict, List, Set, Tuple

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import trec_pipelines as tp
from tests.unit.fakes import FEATURES, ROWS, Batch, TinyModel, drain, optimizer_for
from trec_pipelines.observe.memory import BATCH, storage_of
from trec_pipelines.pipelines.pt2 import TorchCompileConfig

CPU = torch.device("cpu")

DOCUMENTED_DEPTH: Dict[str, int] = {
    "TrainPipelineBase": 2,
    "TrainPipelinePT2": 1,
    "TrainPipelineSparseDist": 3,
    "TrainPipelineSparseDistLite": 2,
    "TrainPipelineFusedSparseDist": 3,
    "TrainPipelineSemiSync": 4,
    "PrefetchTrainPipelineSparseDist": 3,
    "EvalPipelineFusedSparseDist": 3,
}
RELEASES_AFTER_FORWARD = {"TrainPipelineSemiSync", "TrainPipelineBase"}
# torchrec's PT2 keeps the batch it trained until the next call's copy is done
# (two batches alive during that copy); ours drops it first.
HELD_THROUGH_NEXT_COPY: Set[str] = set()
PEAK = dict(DOCUMENTED_DEPTH)


def _make(name: str, model: torch.nn.Module) -> Any:
    cls = getattr(tp, name)
    if name == "TrainPipelinePT2":
        return cls(
            model,
            optimizer_for(model),
            CPU,
            compile_configs=TorchCompileConfig(compile_on_iter=10**6),
        )
    if name.startswith("Eval"):
        model.eval()
    return cls(model, optimizer_for(model), CPU)


def ledger_batches(n: int, seed: int = 5) -> List[Batch]:
    """Batches whose KJT carries its offsets, so no verb caches a new tensor in it."""
    g = torch.Generator().manual_seed(seed)
    out: List[Batch] = []
    for k in range(n):
        size = 2 + k % 3  # batches of different sizes: bytes tell them apart
        lengths = torch.randint(1, 3, (len(FEATURES) * size,), generator=g)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        kjt = KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths, offsets=offsets)
        dense = torch.rand(size, 3, generator=g)
        labels = torch.randint(0, 2, (size,), generator=g).float()
        out.append(Batch(dense, kjt, labels))
    return out


def _tensors(batch: Batch) -> List[torch.Tensor]:
    kjt = batch.sparse
    return [batch.dense, batch.labels, kjt.values(), kjt.lengths(), kjt.offsets()]


def expected_in_flight(name: str, actions: List[Any]) -> List[Set[int]]:
    """Per action, the batches the variant should hold right after it (see the module docstring)."""
    copied_in = {a.batch: a.call for a in actions if a.task == "H2D"}
    copy_pos = {a.call: pos for pos, a in enumerate(actions) if a.task == "H2D"}
    forward_at = {a.batch: (a.call, pos) for pos, a in enumerate(actions) if a.task == "Forward"}
    out: List[Set[int]] = []
    for pos, action in enumerate(actions):
        held = set()
        for batch, call in copied_in.items():
            if call > action.call:
                continue
            trained = forward_at.get(batch)
            if trained is not None:
                if name in RELEASES_AFTER_FORWARD and trained[1] < pos:
                    continue
                kept = (
                    name in HELD_THROUGH_NEXT_COPY
                    and trained[0] == action.call - 1
                    and pos <= copy_pos.get(action.call, -1)
                )
                if trained[0] < action.call and not kept:
                    continue
            held.add(batch)
        out.append(held)
    return out


def recorded(name: str, n: int) -> Tuple[Any, List[Batch]]:
    batches = ledger_batches(n)
    pipeline = _make(name, TinyModel())
    pipeline.enable_schedule_recording(memory=True)
    outputs = drain(pipeline, iter(batches))
    assert len(outputs) == n
    return pipeline, batches


@pytest.mark.parametrize("name", sorted(DOCUMENTED_DEPTH))
def test_ledger_holds_the_documented_batches_at_every_action(name: str) -> None:
    pipeline, batches = recorded(name, 8)
    owner: Dict[Any, int] = {}
    size: Dict[int, int] = {}
    for index, batch in enumerate(batches):
        tensors = _tensors(batch)
        size[index] = sum(t.numel() * t.element_size() for t in tensors)
        for t in tensors:
            found = storage_of(t)
            assert found is not None
            owner[found[0]] = index
    actions = pipeline.schedule_actions
    samples = pipeline.memory_samples
    assert [str(s) for s in samples] == [str(a) for a in actions]
    expected = expected_in_flight(name, actions)
    for sample, want in zip(samples, expected, strict=True):
        held = sample.held
        got = []
        for group in held.batch_storages:
            indices = {owner[key] for key in group if key in owner}
            assert len(indices) == 1, f"{sample}: a batch group spans batches {indices}"
            got.append(indices.pop())
        assert sorted(got) == sorted(want), (
            f"{sample}: holds {sorted(got)}, expected {sorted(want)}"
        )
        assert held.batches == len(want)
        assert held.bytes_by_kind[BATCH] == sum(size[b] for b in want), str(sample)
    steady = [s.held.batches for s in samples if 1 <= s.call <= 4]
    assert max(steady) == PEAK[name]
    assert max(s.held.batches for s in samples) == PEAK[name]
    # The class's own statement of its depth, where it keeps one, agrees.
    depth = type(pipeline)._traits.depth
    if depth and not name.startswith(("TrainPipelineBase", "TrainPipelinePT2")):
        assert depth == DOCUMENTED_DEPTH[name]


def test_summary_peak_and_steady_state() -> None:
    pipeline, batches = recorded("TrainPipelineSparseDist", 8)
    samples = pipeline.memory_samples
    summary = pipeline.memory_ledger()
    assert summary.samples == len(samples)
    assert summary.peak_bytes == max(s.held.total for s in samples)
    assert summary.peak_bytes == sum(summary.peak_by_kind.values())
    assert summary.steady_bytes == sum(summary.steady_by_kind.values())
    assert summary.max_batches == 3
    # Steady state: calls 1..6 (not the fill, not the drain) each hold 3 batches.
    sizes = [sum(t.numel() * t.element_size() for t in _tensors(b)) for b in batches]
    per_call = [sum(sizes[k : k + 3]) for k in range(1, 7)]
    assert summary.steady_by_kind[BATCH] in per_call
    text = pipeline.print_memory()
    assert "batch" in text and "steady" in text and "3 batch(es)" in text
    assert summary.device_max_allocated is None  # CPU


def test_no_ledger_unless_asked() -> None:
    pipeline = _make("TrainPipelineSparseDist", TinyModel())
    drain(pipeline, iter(ledger_batches(4)))
    assert pipeline.memory_samples == []
    pipeline.enable_schedule_recording()
    drain(pipeline, iter(ledger_batches(4)))
    assert pipeline.schedule_actions and pipeline.memory_samples == []
    with pytest.raises(ValueError, match="memory=True"):
        pipeline.memory_ledger()


def test_timeline_gains_a_memory_track(tmp_path: Any) -> None:
    pipeline, _ = recorded("TrainPipelineSparseDist", 6)
    with_memory = tmp_path / "with.png"
    pipeline.save_timeline(str(with_memory), calls=(1, 3))
    plain = tmp_path / "plain.png"
    from trec_pipelines.observe.schedule_view import draw_timeline

    draw_timeline(pipeline.schedule_actions, str(plain), calls=(1, 3))
    assert with_memory.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image  # matplotlib depends on it

    assert Image.open(with_memory).size[1] > Image.open(plain).size[1]


def test_trace_gains_a_held_memory_counter(tmp_path: Any) -> None:
    import json

    pipeline, _ = recorded("TrainPipelineSparseDist", 5)
    path = tmp_path / "trace.json"
    pipeline.export_trace(str(path))
    counters = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "C"]
    samples = pipeline.memory_samples
    assert len(counters) == len(samples)
    assert [c["args"]["host batch"] + c["args"]["device batch"] for c in counters] == [
        pytest.approx(s.held.bytes_by_kind[BATCH] / 2**20) for s in samples
    ]
    assert [c["args"]["host batch"] for c in counters] == [
        s.held.host_batch_bytes / 2**20 for s in samples
    ]


class _Stepper:
    """A pipeline-shaped object whose method holds model state in its locals."""

    def __init__(self) -> None:
        self._model = torch.nn.Linear(4, 4)
        self._optimizer = torch.optim.Adam(self._model.parameters())  # state made at the first step

    def step(self, ledger: Any, call: int) -> None:
        batch = torch.ones(2, 4)
        self._model(batch).sum().backward()
        self._optimizer.step()
        weight = self._model.weight  # noqa: F841  (locals the ledger sees)
        moment = self._optimizer.state[weight]["exp_avg"]  # noqa: F841
        ledger.sample(call, "OptimizerStep", call, "default")


def test_model_state_in_a_running_method_s_locals_is_not_counted() -> None:
    from trec_pipelines.observe.ledger import MemoryLedger

    stepper = _Stepper()
    ledger = MemoryLedger(stepper)  # before the optimizer has any state
    stepper.step(ledger, 0)
    stepper.step(ledger, 1)
    for sample in ledger.samples:
        assert sample.held.total == 2 * 4 * 4 and sample.held.bytes_by_kind[BATCH] == 32


def test_semi_sync_lets_go_of_cur_lookup_outputs_before_the_dense_step() -> None:
    """Once ``embedding_backward`` has sent ``cur``'s gradients back, its lookup
    outputs are garbage: the dense step runs without them (torchrec's keeps them
    until the end of the call).  In synchronous steps no other lookup is in
    flight at the optimizer step, so the ledger must show no embeddings there."""
    pipeline, _ = recorded("TrainPipelineSemiSync", 8)
    checked = 0
    for pos, sample in enumerate(pipeline.memory_samples):
        if sample.task != "OptimizerStep":
            continue
        same_call = [s for s in pipeline.memory_samples[:pos] if s.call == sample.call]
        assert any(s.task == "EmbBackward" for s in same_call)
        if any(s.task == "EmbLookup" for s in same_call):
            continue  # a semi-sync step: nxt's lookup is legitimately held
        before = [s for s in same_call if s.task == "EmbBackward"][-1]
        assert before.held.bytes_by_kind["embeddings"] > 0, str(before)
        assert sample.held.bytes_by_kind["embeddings"] == 0, str(sample)
        checked += 1
    assert checked >= 4
