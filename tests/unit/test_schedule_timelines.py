"""Every SparseDist-derived timeline, as SparseDist's plus its declared edits.

Each variant's ``progress()`` is a literal timeline of its own, most of them
written from :class:`TrainPipelineSparseDist`'s.  Here each variant's
recorded steady-state step must equal SparseDist's recorded steady-state step
(in the same model mode) with the variant's edits applied: what it inserts,
removes, moves or runs on another batch or stream.  The edits are the table
``VARIANTS`` below.  When SparseDist's order changes, the variants whose
copies did not follow fail here, each with the edits it declared next to what
it recorded; a variant that changes its own order must say so in its row.

A step is read from the recorder as a list of :class:`Verb`: the task, its
batch relative to the one in ``Forward`` (``cur``), its stream, and the verb
it ran inside, if any (a backward hook's work runs inside ``Backward``).  Two
verbs that record nothing are spied on, so that their place is checked too:
``sync_embeddings`` (``SyncEmbeddings``) and ``clear_sparse_data_dist_inputs``
(``ClearDistInputs``, with ``clear_data_dist_inputs=True`` wherever the
constructor takes it).

What this tier cannot record, and where it is covered instead: the loader
thread of ``EvalPipelineSparseDist(loader_thread=True)`` and the host-stage
thread of ``EvalPipelineCPUSparse(multi_thread=True)`` (their timing is the
threads'; the inline forms are recorded here); SparseDistT's copy thread (on
CPU the copies stay on the training thread); BwdOpt's and OptStash's hook at
an output-dist all-to-all, which the fake module has not (hooked at its
weight's gradient here; the real site in tests/distributed/test_experimental.py).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import pytest
import torch

import trec_pipelines as tp
from tests.unit.fakes import TinyModel, drain, make_batches, optimizer_for
from trec_pipelines.model.backward_hooks import (
    FirstGradTensorFinder,
    InjectionSite,
    InjectionTargetType,
)

CPU = torch.device("cpu")

# Batches, relative to cur (the batch in Forward).
PRV, CUR, NXT = -1, 0, 1

# The verbs no pipeline records, spied on by this test.
SYNC = "SyncEmbeddings"
CLEAR = "ClearDistInputs"


@dataclass(frozen=True)
class Verb:
    """One recorded verb of a step: ``task[batch - cur]@stream``, inside another verb or not."""

    task: str
    slot: Optional[int]
    stream: str = "default"
    inside: Optional[str] = None

    def __str__(self) -> str:
        where = f" inside {self.inside}" if self.inside else ""
        return f"{self.task}[{_slot(self.slot)}]@{self.stream}{where}"


def _slot(slot: Optional[int]) -> str:
    if slot is None:
        return "--"
    return "cur" if slot == 0 else f"cur{slot:+d}"


def _where(before: Optional[str], after: Optional[str]) -> str:
    return f"before {before}" if before is not None else f"after {after}"


def _to(slot: Optional[int], stream: Optional[str], inside: Optional[str] = None) -> str:
    parts = [f"[{_slot(slot)}]" if slot is not None else "", f"@{stream}" if stream else ""]
    parts.append(f" inside {inside}" if inside else "")
    return f" -> {''.join(parts)}" if any(parts) else ""


# ------------------------------------------------------------------ edits
#
# Each names a verb of the step by its task; the name must match exactly one
# verb at that point of the list (edits apply in order).


@dataclass(frozen=True)
class Insert:
    """A verb the variant adds, placed before or after another."""

    verb: Verb
    before: Optional[str] = None
    after: Optional[str] = None

    def __str__(self) -> str:
        return f"insert {self.verb} {_where(self.before, self.after)}"


@dataclass(frozen=True)
class Remove:
    """A verb of SparseDist's step the variant does not run."""

    task: str

    def __str__(self) -> str:
        return f"remove {self.task}"


@dataclass(frozen=True)
class Move:
    """A verb the variant runs elsewhere in the step (and on another batch or stream, if given)."""

    task: str
    before: Optional[str] = None
    after: Optional[str] = None
    slot: Optional[int] = None
    stream: Optional[str] = None

    def __str__(self) -> str:
        return f"move {self.task} {_where(self.before, self.after)}{_to(self.slot, self.stream)}"


@dataclass(frozen=True)
class Change:
    """A verb the variant runs in the same place on another batch or stream, or inside another verb."""

    task: str
    slot: Optional[int] = None
    stream: Optional[str] = None
    inside: Optional[str] = None

    def __str__(self) -> str:
        return f"change {self.task}{_to(self.slot, self.stream, self.inside)}"


Edit = Union[Insert, Remove, Move, Change]


def _find(step: Sequence[Verb], task: str, edit: Edit) -> int:
    at = [k for k, verb in enumerate(step) if verb.task == task]
    assert len(at) == 1, (
        f"{edit} names {task!r}, which the step has {len(at)} of "
        f"(the step so far: {[str(v) for v in step]}); fix the declaration"
    )
    return at[0]


def _place(
    step: List[Verb], verb: Verb, before: Optional[str], after: Optional[str], edit: Edit
) -> None:
    assert (before is None) != (after is None), f"{edit}: give exactly one of before/after"
    if before is not None:
        step.insert(_find(step, before, edit), verb)
    else:
        assert after is not None
        step.insert(_find(step, after, edit) + 1, verb)


def apply(step: Sequence[Verb], edits: Sequence[Edit]) -> List[Verb]:
    """``step`` with ``edits`` applied in order."""
    out = list(step)
    for edit in edits:
        if isinstance(edit, Insert):
            _place(out, edit.verb, edit.before, edit.after, edit)
        elif isinstance(edit, Remove):
            del out[_find(out, edit.task, edit)]
        elif isinstance(edit, Move):
            verb = out.pop(_find(out, edit.task, edit))
            verb = replace(
                verb,
                slot=verb.slot if edit.slot is None else edit.slot,
                stream=edit.stream or verb.stream,
            )
            _place(out, verb, edit.before, edit.after, edit)
        else:
            k = _find(out, edit.task, edit)
            verb = out[k]
            out[k] = replace(
                verb,
                slot=verb.slot if edit.slot is None else edit.slot,
                stream=edit.stream or verb.stream,
                inside=edit.inside or verb.inside,
            )
    return out


# --------------------------------------------------------------- variants

# BwdOpt and OptStash hook the output dist of a sharded module; the fake
# module's output dist has no all-to-all to hook (OutputDistTensorFinder
# refuses it), so here their hook goes on the same module's weight gradient,
# which fires in the same backward.  Where in the backward is tested on two
# ranks (tests/distributed/test_experimental.py); here, that it is inside.
WEIGHT_GRAD_SITE = InjectionSite("sparse", FirstGradTensorFinder(), InjectionTargetType.PARAM_GRAD)


@dataclass(frozen=True)
class Variant:
    """A pipeline class built on the fake model, and its edits of SparseDist's step."""

    cls: type
    edits: Tuple[Edit, ...]
    mode: str = "train"  # "eval": model.eval(), compared with SparseDist's eval step
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    hook_site: Optional[str] = None  # the attribute holding the backward-hook site, if any


VARIANTS: Dict[str, Variant] = {
    "SparseDistLite": Variant(
        tp.TrainPipelineSparseDistLite,
        (
            Remove(CLEAR),  # accepted; cur's input_dist is waited at once, nothing to release
            # Two batches in flight: cur's input_dist runs on the critical path ...
            Change("InputDistStart", slot=CUR, stream="default"),
            Move("InputDistWait", before="Forward", slot=CUR, stream="default"),
            # ... and the copy of the next batch overlaps the optimizer step.
            Move("H2D", after="Backward", slot=NXT),
            Remove(SYNC),  # no DMPCollection sync, as upstream
        ),
    ),
    "FusedSparseDist": Variant(
        tp.TrainPipelineFusedSparseDist,
        (Insert(Verb("EmbLookup", CUR, "data_dist"), before="ZeroGrad"),),
    ),
    "EvalFusedSparseDist": Variant(
        tp.EvalPipelineFusedSparseDist,
        (Insert(Verb("EmbLookup", CUR, "data_dist"), before="WaitBatch"),),
        mode="eval",
    ),
    "EvalFusedSparseDist(prefetch)": Variant(
        tp.EvalPipelineFusedSparseDist,
        # nxt's lookup starts once its input_dist is done; cur's was started a call earlier.
        (Insert(Verb("EmbLookup", NXT, "data_dist"), after="InputDistWait"),),
        mode="eval",
        kwargs={"enable_embedding_lookup_prefetch": True},
    ),
    "SemiSync(synchronous phase)": Variant(
        tp.TrainPipelineSemiSync,
        (
            # Four batches in flight: the copy and the input_dist run one batch further ahead.
            Move("InputDistStart", before="ZeroGrad", slot=NXT + 1),
            Move(CLEAR, before="InputDistStart", slot=NXT),  # nxt's, whose input_dist is in flight
            Move("H2D", after="Forward", slot=NXT + 2),
            Change("InputDistWait", slot=NXT + 1),
            Insert(Verb("EmbBackward", CUR), after="Backward"),
            # nxt's lookup after cur's update, which it must see.
            Insert(Verb("EmbLookup", NXT), after="OptimizerStep"),
        ),
    ),
    "SemiSync(semi-synchronous)": Variant(
        tp.TrainPipelineSemiSync,
        (
            Move("InputDistStart", before="ZeroGrad", slot=NXT + 1),
            Move(CLEAR, before="InputDistStart", slot=NXT),
            Move("H2D", after="Forward", slot=NXT + 2),
            Change("InputDistWait", slot=NXT + 1),
            Insert(Verb("EmbBackward", CUR), after="Backward"),
            # nxt's lookup before cur's update: it overlaps the backward, one update stale.
            Insert(Verb("EmbLookup", NXT), after="H2D"),
        ),
        kwargs={"start_batch": 0},
    ),
    "PrefetchSparseDist": Variant(
        tp.PrefetchTrainPipelineSparseDist,
        (
            Remove(CLEAR),  # accepted with no effect, as upstream
            # nxt's input_dist is waited before cur's forward, so that its
            # prefetch can follow the forward; the next one starts at the end.
            Move("InputDistWait", before="Forward"),
            Insert(Verb("EmbPrefetch", NXT, "prefetch"), after="Forward"),
            Move("InputDistStart", after="OptimizerStep", slot=NXT + 1),
            Remove(SYNC),  # no DMPCollection sync, as upstream
        ),
    ),
    "EvalSparseDist": Variant(
        tp.EvalPipelineSparseDist,
        # Two batches in flight: the loader copies nxt before cur is waited for.
        (Move("H2D", before="WaitBatch", slot=NXT),),
        mode="eval",
    ),
    "SparseDistCompAutograd": Variant(tp.TrainPipelineSparseDistCompAutograd, ()),
    "PEC": Variant(
        tp.TrainPipelinePEC,
        (
            # cur's lookups run before its forward, with the copy issued first.
            Move("H2D", after="WaitBatch"),
            Insert(Verb("OLLookup", CUR), after="H2D"),
            Insert(Verb("EmbLookup", CUR), after="OLLookup"),
            Insert(Verb("OverlapDist", NXT, "data_dist"), after="EmbLookup"),
            # Three batches in flight, input_dist two ahead.
            Move("InputDistStart", after="OverlapDist", slot=NXT + 1),
            Insert(Verb("NOLGradStart", PRV), after="InputDistStart"),
            Move("ZeroGrad", before="Forward"),
            Change("InputDistWait", slot=NXT + 1),
            Insert(Verb("NOLGradApply", PRV), after="InputDistWait"),
            Insert(Verb("NOLLookup", NXT), after="NOLGradApply"),
            Insert(Verb("OLGradStart", CUR), after="Backward"),
            Insert(Verb("OLGradApply", CUR), after="OptimizerStep"),
            Remove(CLEAR),  # not a constructor argument
            Remove(SYNC),  # no DMPCollection sync, as upstream
        ),
    ),
    # SparseDist's own progress(): their overrides (T's copy thread, Hybrid's
    # no_grad eval forward) must add no verb.
    "SparseDistT": Variant(tp.TrainPipelineSparseDistT, ()),
    "SparseDistBwdOpt": Variant(
        tp.TrainPipelineSparseDistBwdOpt,
        (
            # The step runs in the backward's hook; the sync follows the backward.
            Move("OptimizerStep", after="Backward"),
            Change("OptimizerStep", inside="Backward"),
        ),
        kwargs={"site_fqn": "sparse"},
        hook_site="_step_site",
    ),
    "TrainEvalHybrid(train)": Variant(tp.TrainEvalHybridPipelineBase, ()),
    "TrainEvalHybrid(eval)": Variant(tp.TrainEvalHybridPipelineBase, (), mode="eval"),
    "SparseDistOptStash": Variant(
        tp.TrainPipelineSparseDistOptStash,
        (
            Insert(Verb("StashWait", CUR), before="Backward"),  # the previous stash issued
            Insert(Verb("StashRestore", CUR, inside="Backward"), after="Backward"),
            Insert(Verb("StashWait", CUR), before="OptimizerStep"),  # the restore done
            Insert(Verb("OptStash", CUR), after="OptimizerStep"),
        ),
        kwargs={"site_fqn": "sparse"},
        hook_site="_restore_site",
    ),
    "SparseDistEmbStash": Variant(
        tp.TrainPipelineSparseDistEmbStash,
        (Insert(Verb("StashRestore", CUR, inside="Backward"), after="Backward"),),
        kwargs={"site_fqn": "over"},
    ),
    "PrefetchEMS": Variant(
        tp.TrainPipelinePrefetchEMS,
        (
            Remove(CLEAR),  # not a constructor argument
            Insert(Verb("StashRestore", CUR), after="InputDistWait"),  # cur's weights and caches
            Insert(Verb("EmbPrefetch", NXT), before="Backward"),  # nxt's rows, on default
            Insert(Verb("StashRestore", CUR, inside="Backward"), after="Backward"),  # EmbStash's
        ),
        kwargs={"site_fqn": "over"},
    ),
    "EvalCPUSparse": Variant(
        tp.EvalPipelineCPUSparse,
        (
            # No input_dist stage: the host stage (lookup included) of the
            # batch after nxt runs last, after nxt's copy.
            Remove(CLEAR),  # accepted; no all-to-all in flight to release
            Remove("InputDistStart"),
            Remove("InputDistWait"),
            Move("H2D", after="Forward", slot=NXT),
            Insert(Verb("EmbLookup", NXT + 1), after="H2D"),
        ),
        mode="eval",
    ),
}


# -------------------------------------------------------------- recording


def _spy(pipeline: Any) -> None:
    """Record the two verbs that record nothing themselves, on their batch."""
    sync, clear = pipeline.sync_embeddings, pipeline.clear_sparse_data_dist_inputs

    def sync_embeddings(model: Any, interval: Any, context: Any = None) -> None:
        with pipeline._recording.span(SYNC, None if context is None else context.index):
            sync(model, interval, context)

    def clear_sparse_data_dist_inputs(context: Any) -> None:
        with pipeline._recording.span(CLEAR, context.index, "data_dist"):
            clear(context)

    pipeline.sync_embeddings = sync_embeddings
    pipeline.clear_sparse_data_dist_inputs = clear_sparse_data_dist_inputs


def _build(cls: type, mode: str, **kwargs: Any) -> Any:
    model = TinyModel()
    if mode == "eval":
        model.eval()
    # CompAutograd captures the backward as usual; the "eager" backend runs the captured
    # graph op by op instead of compiling it (the schedule is the same, in a second, not 25).
    model._compiled_autograd_options = {"backend": "eager", "dynamic": True, "fullgraph": False}
    if "clear_data_dist_inputs" in inspect.signature(cls).parameters:
        kwargs["clear_data_dist_inputs"] = True
    pipeline = cls(model, optimizer_for(model), CPU, **kwargs)
    _spy(pipeline)
    pipeline.enable_schedule_recording()
    return pipeline


def _step(pipeline: Any, call: int) -> List[Verb]:
    """Call ``call``'s verbs, batches relative to cur's."""
    actions = [a for a in pipeline.schedule_actions if a.call == call]
    (forward,) = [a for a in actions if a.task == "Forward"]
    steps: List[Verb] = []
    for k, action in enumerate(actions):
        # Spans on one thread nest: an earlier one still open when this one ended encloses it.
        enclosing = [
            a for a in actions[:k] if a.thread == action.thread and action.cpu_end <= a.cpu_end
        ]
        slot = None if action.batch is None else action.batch - forward.batch
        inside = enclosing[-1].task if enclosing else None
        steps.append(Verb(action.task, slot, action.stream, inside))
    return steps


STEADY = 3  # the call recorded: each variant's fill is over, its drain not begun
N_BATCHES = 8


def steady_step(
    cls: type, mode: str = "train", hook_site: Optional[str] = None, **kwargs: Any
) -> List[str]:
    pipeline = _build(cls, mode, **kwargs)
    if hook_site is not None:
        setattr(pipeline, hook_site, WEIGHT_GRAD_SITE)
    assert len(drain(pipeline, iter(make_batches(N_BATCHES)))) == N_BATCHES
    step = _step(pipeline, STEADY)
    # A steady state: the next call does the same on the next batches.
    assert _step(pipeline, STEADY + 1) == step, f"{cls.__name__}: call {STEADY} is not steady"
    return [str(verb) for verb in step]


@functools.lru_cache(maxsize=None)
def sparse_dist_step(mode: str) -> Tuple[Verb, ...]:
    """The reference: SparseDist's steady-state step in ``mode``, recorded once."""
    pipeline = _build(tp.TrainPipelineSparseDist, mode)
    drain(pipeline, iter(make_batches(N_BATCHES)))
    return tuple(_step(pipeline, STEADY))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_step_is_sparse_dist_step_with_its_declared_edits(name: str) -> None:
    variant = VARIANTS[name]
    expected = [str(verb) for verb in apply(sparse_dist_step(variant.mode), variant.edits)]
    recorded = steady_step(variant.cls, variant.mode, variant.hook_site, **variant.kwargs)
    assert recorded == expected, _explain(name, variant, recorded, expected)


def _explain(name: str, variant: Variant, recorded: List[str], expected: List[str]) -> str:
    reference = [str(verb) for verb in sparse_dist_step(variant.mode)]
    width = max(len(line) for line in reference + expected + recorded + ["SparseDist"])
    rows = [f"{'SparseDist':{width}}  {'+ edits':{width}}  {name}"]
    for k in range(max(len(reference), len(expected), len(recorded))):
        cells = [column[k] if k < len(column) else "" for column in (reference, expected, recorded)]
        mark = "" if cells[1] == cells[2] else "   <-"
        rows.append(f"{cells[0]:{width}}  {cells[1]:{width}}  {cells[2]}{mark}")
    edits = "\n".join(f"  {edit}" for edit in variant.edits) or "  (none)"
    return (
        f"{name}'s steady-state step is not SparseDist's with its declared edits:\n{edits}\n"
        + "\n".join(rows)
        + "\nEither its progress() must follow SparseDist's change, or its row in VARIANTS "
        "must declare the difference."
    )


def test_the_reference_step_has_every_verb_the_edits_name() -> None:
    """SparseDist's step as the edits read it (the test's fixed point)."""
    assert [str(v) for v in sparse_dist_step("train")] == [
        "ZeroGrad[cur]@default",
        "WaitBatch[cur]@default",
        "ClearDistInputs[cur]@data_dist",
        "InputDistStart[cur+1]@data_dist",
        "H2D[cur+2]@memcpy",
        "Forward[cur]@default",
        "InputDistWait[cur+1]@data_dist",
        "Backward[cur]@default",
        "SyncEmbeddings[cur]@default",
        "OptimizerStep[cur]@default",
    ]
    assert [str(v) for v in sparse_dist_step("eval")] == [
        "WaitBatch[cur]@default",
        "ClearDistInputs[cur]@data_dist",
        "InputDistStart[cur+1]@data_dist",
        "H2D[cur+2]@memcpy",
        "Forward[cur]@default",
        "InputDistWait[cur+1]@data_dist",
    ]


def test_every_sparse_dist_variant_has_a_row() -> None:
    derived = {
        getattr(tp, name)
        for name in tp.__all__
        if isinstance(getattr(tp, name), type)
        and issubclass(getattr(tp, name), tp.TrainPipelineSparseDist)
        and getattr(tp, name) is not tp.TrainPipelineSparseDist
    }
    declared = {variant.cls for variant in VARIANTS.values()}
    assert sorted(c.__name__ for c in derived - declared) == []


def test_edits_apply_in_order_and_name_one_verb() -> None:
    step = [Verb("A", CUR), Verb("B", NXT, "data_dist"), Verb("C", CUR)]
    edits: Tuple[Edit, ...] = (
        Move("B", after="C", slot=NXT + 1),
        Insert(Verb("D", PRV), before="A"),
        Change("C", inside="A"),
        Remove("A"),
    )
    assert [str(v) for v in apply(step, edits)] == [
        "D[cur-1]@default",
        "C[cur]@default inside A",
        "B[cur+2]@data_dist",
    ]
    with pytest.raises(AssertionError, match="which the step has 0 of"):
        apply(step, (Remove("E"),))
    with pytest.raises(AssertionError, match="which the step has 2 of"):
        apply(step + [Verb("A", NXT)], (Remove("A"),))
