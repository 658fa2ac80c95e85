"""Pipelined postprocs: modules between the batch and a sharded module.

A *postproc* is a module the model calls on the batch before a sharded module
reads the result, e.g. a negative sampler that rewrites the
``KeyedJaggedTensor``.  A sharded module fed by one cannot start its
``input_dist`` from the batch alone; with ``pipeline_postproc=True`` the
rewrite checks each postproc on the way back from a sharded module's arguments
(see :class:`PostprocPlanner`) and, where it is safe, the pipeline runs it in
the batch's input_dist stage, on the data_dist stream, one batch ahead of the
forward.  Its output feeds the input_dist and is cached in the batch's context
(``postproc_fwd_results``): a postproc shared by several modules, or feeding
other postprocs, runs once per batch, and the model's own call to it in the
forward returns the cached output instead of running it again.

Safe means all of:

* no parameters: it runs a batch ahead, so a trained postproc would compute
  with weights one step old;
* no forward hooks: they would run in the forward around the cached output,
  not with the computation in the input_dist stage;
* every argument is a constant, a read from the batch, a list or dict of those,
  or the output of another safe postproc (nested postprocs);
* it is called once per forward (one result is cached per batch);
* it is not, and holds no, sharded module.

A module that fails a check stays as it is and so does every sharded module
it feeds; :meth:`~trec_pipelines.model.rewrite.RewriteResult.report` lists it with
the reason.

Like a sharded module, a pipelined postproc keeps its place in the model: only
its ``forward`` is swapped (for a :class:`PipelinedPostproc`) and
:func:`~trec_pipelines.model.rewrite.restore_model` swaps it back.  So
``state_dict``, ``named_modules`` and parameters never change, which upstream
(which swaps the module itself) needs extra code for.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, OrderedDict
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Generator,
    Iterator,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

import torch
import torch.fx
from torchrec.distributed.types import ShardedModule

from trec_pipelines.core.streams import (
    current_stream,
    on_stream,
    record_event,
    record_stream_tree,
    wait_event,
)
from trec_pipelines.model import tracing
from trec_pipelines.model.args import CallArgs
from trec_pipelines.model.context import TrainPipelineContext

logger: logging.Logger = logging.getLogger(__name__)


class PipelinedPostproc(torch.nn.Module):
    """Stands in for a postproc module's ``forward`` once the model is rewritten.

    Built with torchrec's arguments.  It holds the context of one batch
    (:meth:`set_context`): in the input_dist stage the pipeline points it at
    the batch being distributed (:func:`use_context_for_postprocs`) and the
    :class:`~trec_pipelines.model.args.Postproc` step of a recipe calls
    :meth:`output_for`, which runs the module's own forward on ``dist_stream``
    on arguments built from the batch (and other postprocs' outputs) and
    caches the result in ``context.postproc_fwd_results``.  In the forward the
    model's call lands in :meth:`forward`, which returns that cached result,
    handed to the stream the forward runs on.

    It is installed as the module's ``forward`` only (the module keeps its
    place in the model); ``named_modules``, ``named_parameters``,
    ``named_buffers``, ``state_dict`` and ``load_state_dict`` are the module's
    own, so code that does place it in the model, as torchrec does, sees the
    same names.
    """

    _forward: Callable[..., Any]  # the module's own forward

    def __init__(
        self,
        postproc_module: torch.nn.Module,
        fqn: str,
        args: CallArgs,
        context: TrainPipelineContext,
        default_stream: Optional[torch.Stream],
        dist_stream: Optional[torch.Stream],
    ) -> None:
        super().__init__()
        self._postproc_module = postproc_module
        self._fqn = fqn
        self._args = args
        self._context = context
        # Where the input_dist stage runs it (None: the current stream, or CPU).
        self._dist_stream = dist_stream
        # Where the forward reads it (None: the current stream at that time).
        self._default_stream = default_stream
        # The module's own forward, captured before the swap (under the
        # wrapper of a pipeline dropped without detach(), if one is left).
        forward: Callable[..., Any] = postproc_module.forward
        while isinstance(forward, PipelinedPostproc):
            forward = forward._forward
        self._forward = forward
        self._warned_untracked = False
        # Set by SparseDataDistUtil while the caller repeats a forward whose batch
        # the context has moved past: the module runs on the arguments given.
        self.direct = False

    @property
    def fqn(self) -> str:
        return self._fqn

    @property
    def postproc_module(self) -> torch.nn.Module:
        return self._postproc_module

    @property
    def args(self) -> CallArgs:
        return self._args

    def set_context(self, context: TrainPipelineContext) -> None:
        """The context of the batch whose postproc output is computed or read next."""
        self._context = context

    def get_context(self) -> TrainPipelineContext:
        return self._context

    def output_for(self, batch: Any) -> Any:
        """The module's output for ``batch``: computed on the first call for the
        current context (input_dist stage, ``dist_stream``), then read from
        ``context.postproc_fwd_results``."""
        context = self._context
        results = context.postproc_fwd_results
        if self._fqn in results:
            return results[self._fqn]
        args, kwargs = self._args.build_args_kwargs(batch)
        with _profiler_label(f"trec_pipelines::Postproc {self._fqn}"):
            with on_stream(self._dist_stream):
                output = self._forward(*args, **kwargs)
                ready = record_event(self._dist_stream)
        results[self._fqn] = output
        if ready is not None:
            context.postproc_events[self._fqn] = ready
        return output

    def forward(self, *input: Any, **kwargs: Any) -> Any:
        """The model's call in the forward: the output cached for this batch."""
        context = self._context
        if self.direct or self._fqn not in context.postproc_fwd_results:
            # Not run ahead for this batch (its input_dist stage predates the
            # rewrite): the module's own forward on the arguments given.
            return self._forward(*input, **kwargs)
        output = context.postproc_fwd_results[self._fqn]
        if self._dist_stream is not None:
            consumer = self._default_stream or current_stream(self._dist_stream.device)
            # The event, not a wait_stream: later input_dist work on data_dist
            # (the next batch's) must not hold the forward up.
            wait_event(consumer, context.postproc_events.get(self._fqn))
            if record_stream_tree(output, consumer) == 0 and not self._warned_untracked:
                self._warned_untracked = True
                logger.warning(
                    "postproc '%s' returned a %s holding no Tensor or Multistreamable that "
                    "record_stream can reach; if it holds device memory, the allocator may "
                    "reuse it while the forward reads it. Return tensors, Pipelineable "
                    "objects, or lists/tuples/dicts of them.",
                    self._fqn,
                    type(output).__name__,
                )
        return output

    # The module's own names, not the wrapper's (as if it were the module).

    def named_modules(
        self,
        memo: Optional[Set[torch.nn.Module]] = None,
        prefix: str = "",
        remove_duplicate: bool = True,
    ) -> Iterator[Tuple[str, torch.nn.Module]]:
        memo = set() if memo is None else memo
        if self not in memo:
            if remove_duplicate:
                memo.add(self)
            yield prefix, self
            yield from self._postproc_module.named_modules(memo, prefix, remove_duplicate)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, torch.nn.Parameter]]:
        yield from self._postproc_module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, torch.Tensor]]:
        yield from self._postproc_module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(  # type: ignore[override]
        self,
        destination: Optional[Dict[str, Any]] = None,
        prefix: str = "",
        keep_vars: bool = False,
    ) -> Dict[str, Any]:
        if destination is None:
            return self._postproc_module.state_dict(prefix=prefix, keep_vars=keep_vars)
        return self._postproc_module.state_dict(
            destination=destination, prefix=prefix, keep_vars=keep_vars
        )

    def load_state_dict(  # type: ignore[override]
        self, state_dict: "OrderedDict[str, torch.Tensor]", strict: bool = True
    ) -> Any:
        return self._postproc_module.load_state_dict(state_dict, strict=strict)

    @staticmethod
    def recursive_record_stream(res: Any, stream: torch.Stream) -> None:
        """``record_stream`` every tensor and Pipelineable inside ``res`` on ``stream``."""
        record_stream_tree(res, stream)

    def __repr__(self) -> str:
        return (
            f"PipelinedPostproc({self._fqn!r}, {type(self._postproc_module).__name__}, "
            f"args={self._args})"
        )


@contextlib.contextmanager
def use_context_for_postprocs(
    pipelined_postprocs: Sequence[PipelinedPostproc],
    next_batch_context: TrainPipelineContext,
) -> Generator[None, None, None]:
    """Point ``pipelined_postprocs`` at ``next_batch_context`` (the batch whose
    input_dist stage runs), then back at the contexts they held (the forward's)."""
    held = [postproc.get_context() for postproc in pipelined_postprocs]
    for postproc in pipelined_postprocs:
        postproc.set_context(next_batch_context)
    try:
        yield
    finally:
        for postproc, context in zip(pipelined_postprocs, held, strict=True):
            postproc.set_context(context)


def _profiler_label(name: str) -> ContextManager[Any]:
    """A profiler label while a PyTorch profiler runs (as the recorder's spans); free otherwise."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


# Builds the wrapper for one postproc: (fqn, module, call args) -> wrapper.
PostprocFactory = Callable[[str, torch.nn.Module, CallArgs], PipelinedPostproc]


class PostprocPlanner:
    """Decides, during an FX rewrite, which postproc modules can be pipelined.

    :meth:`resolve` is handed to :func:`trec_pipelines.model.tracing.call_args_of` and
    called for every ``call_module`` node met on the way back from a sharded
    module's arguments.  It answers with the node's :class:`PipelinedPostproc`
    (made once per module, so a shared postproc has one wrapper) or with the
    reason it can't be one.  Nothing is installed here: the rewrite installs
    the postprocs that pipelined sharded modules actually read.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        graph: torch.fx.Graph,
        batch_node: Optional[torch.fx.Node],
        make: PostprocFactory,
    ) -> None:
        self._modules: Dict[str, torch.nn.Module] = dict(model.named_modules())
        self._calls = Counter(str(n.target) for n in graph.nodes if n.op == "call_module")
        self._batch_node = batch_node
        self._make = make
        self._planned: Dict[str, PipelinedPostproc] = {}
        self._refused: Dict[str, str] = {}
        # The module whose refusal ended the last failed walk, if one did.
        self._blocked_by: Optional[str] = None

    @property
    def refused(self) -> List[Tuple[str, str]]:
        """(fqn, reason) of every module met that can't be pipelined."""
        return list(self._refused.items())

    def resolve(self, node: torch.fx.Node) -> Union[PipelinedPostproc, str]:
        fqn = str(node.target)
        if fqn in self._planned:
            return self._planned[fqn]
        if fqn not in self._refused:
            module = self._modules.get(fqn)
            reason = self._unsafe(fqn, module)
            if reason is None:
                assert module is not None
                self._blocked_by = None
                args = tracing.call_args_of(node, self._batch_node, self.resolve)
                if isinstance(args, CallArgs):
                    self._planned[fqn] = self._make(fqn, module, args)
                    return self._planned[fqn]
                if self._blocked_by is not None:
                    # Its own reason is listed with it; don't repeat it here.
                    reason = (
                        f"it reads the output of module '{self._blocked_by}', which can't run ahead"
                    )
                else:
                    reason = f"its input can't be read from the batch: {args}"
            self._refused[fqn] = reason
        self._blocked_by = fqn
        return f"its input is the output of module '{fqn}', which can't run ahead: {self._refused[fqn]}"

    def _unsafe(self, fqn: str, module: Optional[torch.nn.Module]) -> Optional[str]:
        """Why ``module`` can't be pipelined, or None when it can."""
        if module is None:
            return "not found among the model's modules"
        if any(isinstance(m, ShardedModule) for m in module.modules()):
            return "it is or holds a sharded module"
        params = [name for name, _ in module.named_parameters()]
        if params:
            shown = ", ".join(params[:3]) + (", ..." if len(params) > 3 else "")
            return (
                f"it has parameters ({shown}); a postproc runs one batch ahead of "
                "the forward, so it must not be trained"
            )
        if module._forward_hooks or module._forward_pre_hooks:
            return (
                "it has forward hooks, which would run on the cached output in the "
                "forward rather than with the module in the input_dist stage"
            )
        if self._calls[fqn] > 1:
            return (
                f"it is called {self._calls[fqn]} times in the forward; one output is "
                "cached per batch"
            )
        return None


def postprocs_read_by(call_args: CallArgs) -> List[PipelinedPostproc]:
    """Every postproc ``call_args`` reads, directly or through others;
    each after the postprocs it reads (the order they first run in)."""
    ordered: List[PipelinedPostproc] = []
    seen: Set[int] = set()

    def visit(args: CallArgs) -> None:
        for source in args.postprocs():
            assert isinstance(source, PipelinedPostproc)
            if id(source) in seen:
                continue
            seen.add(id(source))
            visit(source.args)
            ordered.append(source)

    visit(call_args)
    return ordered
