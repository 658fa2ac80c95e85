"""What ``help()`` and the API page say about torchrec's parameters and the shared ``progress()``.

[Note: documented once]
Every pipeline class takes some of torchrec's constructor parameters, with torchrec's names, and
most share ``progress()``'s contract.  Each parameter is described once, in
:data:`TORCHREC_PARAMETERS` (one entry per name), and the shared ``progress()`` contract once, in
:data:`PROGRESS` (:data:`EVAL_PROGRESS`: what the eval pipelines add).  The class docstrings carry
them in the source, where a reader and ``help()`` find the same text: each ends with an ``Args:``
section for the torchrec parameters its constructor takes and the list of our keyword-only
options (see [Note: one declaration per option]), and each ``progress()`` has the shared
contract as its docstring.  ``python -m tests.docstrings`` writes those parts from these tables,
and ``tests/unit/test_api_docs.py`` checks that the source says what they say.
"""

from __future__ import annotations

import inspect
from typing import Dict, List, Mapping

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
    # -- one class or a few
    "compile_configs": (
        "A ``TorchCompileConfig``: when (``compile_on_iter``) and how to "
        "``torch.compile`` the model; ``None``: its defaults."
    ),
    "pre_compile_fn": "Called with the model right before it is compiled; ``None``: nothing.",
    "post_compile_fn": "Called with the model right after it is compiled; ``None``: nothing.",
    "input_transformer": (
        "Applied to each device batch right before the model; ``None``: torchrec's "
        "``default_pipeline_input_transformer``."
    ),
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
    "start_batch": (
        "How many batches train synchronously, counted from construction or "
        "``reset()``, before the semi-synchronous schedule starts (0: from the first)."
    ),
    "stash_gradients": (
        "Once semi-synchronous, each step applies the previous batch's dense "
        "gradients instead of its own."
    ),
    "pipeline_stages": (
        "The ``PipelineStage`` list, in order: each batch goes through every stage "
        "before ``progress()`` returns it."
    ),
    "debug_mode": "Log each stage's work on each batch (at INFO).",
    "compute_stream": (
        "The stream the caller trains the returned batch on; ``None``: the current stream."
    ),
    "on_flush_end": (
        "Called once a flush (``set_flush(True)``) has drained the pipeline, before it "
        "fills again; ``None``: nothing."
    ),
    "data_dist_stream": "The stream input_dist runs on; ``None``: the current stream.",
    "prefetch_stream": (
        "Adds the cache prefetch after input_dist, on this stream; ``None``: no prefetch."
    ),
    "embedding_lookup_stream": (
        "Runs the embedding lookup as a stage of its own, on this stream; ``None``: "
        "the lookup stays in the forward."
    ),
    "site_fqn": (
        "Where in the backward the class's work runs (the optimizer step, or the "
        "restore of what was stashed): a module's name or an ``InjectionSite``."
    ),
    "sharding_type": (
        "The sharding type whose output dist marks the site in the backward "
        "(``OutputDistTensorFinder``)."
    ),
    "delay_stash": (
        "Stash the embeddings only when the forward reaches ``stash_site_fqn`` (or, "
        "without one, when the backward reaches ``site_fqn``) instead of right after "
        "their lookup."
    ),
    "stash_site_fqn": (
        "With ``delay_stash``: the module whose forward pre-hook stashes; ``None``: "
        "stash when the backward reaches ``site_fqn``."
    ),
    "multi_thread": (
        "Run the host stage (input dist, lookup, output dist) on a thread of its own, "
        "overlapping the device's work."
    ),
    "pipeline_depth": "Batches in flight, 1 or 2 (2: the copy overlaps the next host stage).",
}

PROGRESS = """Run one step on the next batch of ``dataloader_iter``; return its output.

``dataloader_iter`` is an iterator (``iter(dataloader)``, not the data loader
itself), the same one for every call of an epoch.  A training step runs the
forward, the backward of ``torch.sum(losses, dim=0)`` and the optimizer step
(the forward alone when the model is in eval mode) and returns the second
element of the forward's ``(losses, output)``; the class docstring shows what
else the step overlaps.  At the end of the data it raises ``StopIteration``;
calling it again then starts a new epoch, with a new iterator or the same one
refilled (a spent iterator ends again at once).  A step that raises is rolled
back: the next call retries the same batch, and :meth:`skip_failed_batch`
drops it instead.  With several ranks, call it on every rank alike."""


def parameters_of(cls: type) -> List[str]:
    """The constructor parameters of ``cls`` that are torchrec's (not our options)."""
    names = []
    for param in inspect.signature(cls).parameters.values():
        if param.name == "self" or param.kind in (param.VAR_KEYWORD, param.KEYWORD_ONLY):
            continue
        names.append(param.name)
    return names


def undocumented_parameters(cls: type) -> Dict[str, str]:
    """Constructor parameters of ``cls`` with no description in its docstring (for tests)."""
    doc = inspect.getdoc(cls) or ""
    return {
        name: "missing"
        for name in parameters_of(cls)
        if f"    {name}: " not in doc and f"``{name}``:" not in doc
    }


# What the eval pipelines' progress() adds to PROGRESS.
EVAL_PROGRESS = """An eval pipeline runs the forward alone, under ``no_grad`` (no backward, no
optimizer step), and returns the predictions: ``pred`` of a ``(loss, pred)``
pair, or the forward's output as it is.  With ranks holding different numbers
of batches, it returns one output per batch of this rank's own: once this
rank's data has ended, the call runs padding steps (their outputs thrown away)
until every rank's has, then raises ``StopIteration`` (``uneven_data="pad"``,
the default; see the what-happens-when guide)."""
