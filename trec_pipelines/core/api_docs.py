"""What every pipeline shares, described once: torchrec's parameters and ``progress()``.

[Note: documented once]
Every pipeline class takes some of torchrec's constructor parameters, with torchrec's names,
most take some of our keyword-only options, and most share ``progress()``'s contract.  Each is
described once: a torchrec parameter that more than one class takes in
:data:`TORCHREC_PARAMETERS`, our options in their ``TypedDict``'s docstrings
(:mod:`trec_pipelines.assembly.options`), the shared ``progress()`` in :data:`PROGRESS`
(:data:`EVAL_PROGRESS`: what the eval pipelines add).  :func:`shared_doc` puts them in one
docstring, ``trec_pipelines.PipelineOptions``'s, which ``help()`` and the API reference show;
each class's docstring links to it and keeps what is its own: what its schedule does, the
parameters no other class takes (its ``Args:``), and what differs from torchrec's class.
``tests/unit/test_api_docs.py`` checks that every parameter is described in exactly one of
those places and every class links to the shared one.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import List, Mapping

TORCHREC_PARAMETERS: Mapping[str, str] = {
    # -- every pipeline
    "model": (
        "The model: its forward takes a batch on ``device`` and, in a training "
        "pipeline, returns ``(losses, output)`` (the eval pipelines also take a model "
        "that returns predictions alone). Usually a ``DistributedModelParallel``, whose "
        "sharded modules' input_dist the pipeline runs ahead; a model without sharded "
        "modules trains unpipelined (logged)."
    ),
    "optimizer": (
        "The optimizer over the parameters the backward does not update itself (not "
        "the fused, in-backward embedding optimizer), stepped once per trained batch. "
        "The eval pipelines take ``None``."
    ),
    "device": (
        "The device batches are copied to and the model runs on: a ``torch.device`` or "
        'a string naming one (``"cuda:0"``, ``"cpu"``).'
    ),
    "custom_model_fwd": (
        "A function of the device batch called instead of ``model(batch)``, returning "
        "``(losses, output)`` as the forward would; ``None``: the model's forward."
    ),
    "enable_inplace_copy_batch": (
        "Copy each batch into device memory allocated on the default stream, the copy "
        "itself on the memcpy stream (no ``record_stream`` needed); ``False``: "
        "``batch.to(device)`` on the memcpy stream."
    ),
    # -- the SparseDist family
    "execute_all_batches": (
        "``True``: when the iterator ends, train the batches still in flight; "
        "``False``: drop them (logged), so N-2 of N batches are trained."
    ),
    "apply_jit": (
        "torchrec's switch to TorchScript the model's unsharded modules. ``True`` raises "
        "``ValueError`` here: TorchScript is deprecated in PyTorch; compile the dense "
        "part instead."
    ),
    "context_type": (
        "The class of the context made for each batch (``TrainPipelineContext`` or a "
        "subclass of it, for fields of your own)."
    ),
    "pipeline_postproc": (
        "Run the parameter-free modules between the batch and a sharded module "
        "(postprocs) ahead, in the input_dist stage, once per batch; ``False``: they run "
        "in the forward, and a sharded module that reads their output is not pipelined."
    ),
    "dmp_collection_sync_interval_batches": (
        "With a ``DMPCollection`` (2D sharding): sync the replicas' embedding weights "
        "and optimizer states every this many batches (``None``: never). No effect on "
        "other models."
    ),
    "enqueue_batch_after_forward": (
        "Issue the host-to-device copy of the newest batch after the forward instead of before it."
    ),
    "free_features_storage_early": (
        "Free the device copy of a batch's sparse features once its input_dist has "
        "read them (only storage the pipeline's own copy made)."
    ),
    "clear_data_dist_inputs": (
        "Free the inputs of the tensors all-to-all in flight once it has them, to "
        "lower peak memory."
    ),
    "async_inplace_copy": (
        "Issue the in-place host-to-device copy from a background thread (torchrec "
        "1.9.2); implies ``enable_inplace_copy_batch``. On a device without streams "
        "(CPU) the copy stays on the training thread (logged)."
    ),
    # -- a few classes
    "strict": (
        "TrainPipelineSemiSync: raise ``ValueError``, instead of warning, when the "
        "optimizer holds a pipelined module's parameters. The fused pipelines accept "
        "it and do not use it, as torchrec's."
    ),
    "emb_lookup_stream": (
        'The stream the embedding lookup runs on: ``"data_dist"`` (input_dist\'s), '
        '``"new"`` (one of its own) or ``"current"``.'
    ),
    "embedding_lookup_after_data_dist": (
        "``False``: start the trained batch's embedding lookup first in its step; "
        "``True``: after the next batch's input_dist is started and the newest batch's "
        "copy issued."
    ),
    "site_fqn": (
        "Where in the backward the class's work runs (the optimizer step, or the "
        "restore of what was stashed): a module's name or an ``InjectionSite``."
    ),
    "sharding_type": (
        "The sharding type whose output dist marks the site in the backward "
        "(``OutputDistTensorFinder``)."
    ),
}

PROGRESS = """Run one step on the next batch of ``dataloader_iter``; return its output.

``dataloader_iter`` is an iterator (``iter(dataloader)``, not the data loader
itself), the same one for every call of an epoch.  A training step runs the
forward, the backward of ``torch.sum(losses, dim=0)`` and the optimizer step
(the forward alone when the model is in eval mode) and returns the second
element of the forward's ``(losses, output)``; each class's docstring shows
what else its step overlaps.  At the end of the data it raises ``StopIteration``;
calling it again then starts a new epoch, with a new iterator or the same one
refilled (a spent iterator ends again at once).  A step that raises is rolled
back: the next call retries the same batch, and ``skip_failed_batch()``
drops it instead.  With several ranks, call it on every rank alike.  An epoch::

    it = iter(dataloader)
    while True:
        try:
            output = pipeline.progress(it)
        except StopIteration:
            break"""


def parameters_of(cls: type) -> List[str]:
    """The constructor parameters of ``cls`` that are torchrec's (not our options)."""
    names = []
    for param in inspect.signature(cls).parameters.values():
        if param.name == "self" or param.kind in (param.VAR_KEYWORD, param.KEYWORD_ONLY):
            continue
        names.append(param.name)
    return names


def own_parameters(cls: type) -> List[str]:
    """The torchrec parameters of ``cls`` that no other class takes: its docstring's ``Args:``."""
    return [name for name in parameters_of(cls) if name not in TORCHREC_PARAMETERS]


# What the eval pipelines' progress() adds to PROGRESS.
EVAL_PROGRESS = """An eval pipeline runs the forward alone, under ``no_grad`` (no backward, no
optimizer step), and returns the predictions: ``pred`` of a ``(loss, pred)``
pair, or the forward's output as it is.  With ranks holding different numbers
of batches, it returns one output per batch of this rank's own: once this
rank's data has ended, the call runs padding steps (their outputs thrown away)
until every rank's has, then raises ``StopIteration`` (``uneven_data="pad"``,
the default; see the what-happens-when guide)."""


# The link every pipeline class's docstring ends with (its target: shared_doc()).
SHARED_LINK = (
    "torchrec's parameters the classes share, our keyword-only options and what every "
    "``progress()`` does: :class:`~trec_pipelines.PipelineOptions`."
)
# The first line of every pipeline's own progress() docstring, then this link.
PROGRESS_LINK = "What every ``progress()`` does: :class:`~trec_pipelines.PipelineOptions`."


def _entries(terms: Mapping[str, str]) -> List[str]:
    """``terms`` as a definition list (term on its line, its text indented below)."""
    lines: List[str] = []
    for term, text in terms.items():
        lines += [term, *textwrap.wrap(text, 88, initial_indent="    ", subsequent_indent="    ")]
        lines.append("")
    return lines


def shared_doc(options: Mapping[str, str], defaults: Mapping[str, object]) -> str:
    """The one description of what the pipeline classes share: torchrec's parameters
    (:data:`TORCHREC_PARAMETERS`), our ``options`` (name -> text, with their
    ``defaults``) and the ``progress()`` contract (:data:`PROGRESS`, :data:`EVAL_PROGRESS`)."""
    lines = [
        "What the pipeline classes share: torchrec's parameters, our options, ``progress()``.",
        "",
        "Each pipeline class's docstring says what its schedule does, the parameters no",
        "other class takes and what differs from torchrec's class; what they share is",
        "described here, once.  A class's signature (``help()``, ``inspect.signature``)",
        "lists every parameter and option it takes.  As a type, this ``TypedDict`` holds",
        "every option, as a pipeline resolves its keywords.",
        "",
        "**torchrec's parameters** that several classes take, with torchrec's names,",
        "positions and defaults:",
        "",
        *_entries({f"``{name}``": text for name, text in TORCHREC_PARAMETERS.items()}),
        "**Our keyword-only options**, after torchrec's parameters; with every default the",
        "results are torchrec's, bit for bit (the :doc:`options guide </guides/options>`",
        "says more of each):",
        "",
        *_entries({f"``{name}={defaults[name]!r}``": options[name] for name in defaults}),
        "**What every** ``progress()`` **does**:",
        "",
        *PROGRESS.splitlines(),
        "",
        *EVAL_PROGRESS.splitlines(),
    ]
    return "\n".join(lines)
