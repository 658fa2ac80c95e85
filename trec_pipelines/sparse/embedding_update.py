"""SemiSync's embedding backward in two halves: the gradients leave now, the tables update later.

[Note: the embedding update off the step's chain]
A semi-sync step sends the gradients its dense backward left on the detached
embeddings back through the output dist (the gradient all-to-all) and into the
tables, whose fused optimizer updates them.  Done in one
``torch.autograd.backward`` call, as torchrec's SemiSync does, the training
thread waits there for the gradient all-to-all and then runs the tables'
update, and only then steps the dense optimizer: both sit on every step's chain.

Neither needs to.  The next thing that reads batch ``i``'s update is the
lookup of batch ``i+2`` (semi-sync: batch ``i+1`` was looked up before ``i``'s
update), issued in the next step after its dense backward.  So the backward is
cut where torchrec's communication functions wait for their collective (the
backward of each ``*_Req`` function waits for the all-to-all or
reduce-scatter the backward of its ``*_Wait`` twin issued):

* the first half, run in the step, computes the gradient up to those cuts:
  it issues the gradient collectives and returns at once;
* the second half, run from the cuts down, waits for them and updates the
  tables.  On the CPU it runs on a worker thread while the training thread
  steps the dense optimizer and runs the next batch's forward and dense
  backward; on an accelerator it runs where the next step joins it (its
  kernels are asynchronous anyway).

The gradients are the ones one call would compute, and each table is updated
once per batch in the same order, so training is bit-identical to torchrec's
SemiSync.  The second half issues no collective, so the ranks' collectives keep
one order.  Between steps an update may still be running: everything of the
pipeline's that reads the tables (the next lookup, ``state_dict``, ``reset``,
``detach``, the end of the data) and the pipelined modules' own ``forward``
and ``state_dict`` calls from outside a step wait for it first.

A path from the outputs into the tables that passes no such function (a
sharding this module cannot cut) is sent back in one call, as before.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torchrec.distributed.comm_ops as comm_ops
from torch.autograd.graph import GradientEdge, Node
from torchrec.distributed import model_parallel


def _waiting_functions() -> Tuple[type, ...]:
    """torchrec's communication functions whose backward waits for a collective."""
    return tuple(
        value
        for name, value in vars(comm_ops).items()
        if name.endswith("_Req")
        and isinstance(value, type)
        and issubclass(value, torch.autograd.Function)
    )


_WAITING: Tuple[type, ...] = _waiting_functions()


def waiting_edges(outputs: Sequence[torch.Tensor]) -> Optional[List[GradientEdge]]:
    """Where the backward from ``outputs`` first waits for a collective on every path.

    ``None`` when some path reaches the end of the graph without such a wait
    (the backward cannot be cut there) or when no path has one.
    """
    edges: List[GradientEdge] = []
    seen: set[Node] = set()
    stack: List[Optional[Node]] = [output.grad_fn for output in outputs]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "_forward_cls", None) in _WAITING:
            edges.append(GradientEdge(node, 0))
            continue
        following = [fn for fn, _ in node.next_functions if fn is not None]
        if not following:
            return None
        stack.extend(following)
    return edges or None


class EmbeddingUpdate:
    """The tables' updates of the last batch, sent and maybe still running.

    :meth:`send` runs the first half of a module's embedding backward (or the
    whole of it), :meth:`start` starts the second half of everything sent, and
    :meth:`join` waits for it, raising what it raised.
    """

    def __init__(self, device: torch.device) -> None:
        # A worker thread pays only where kernels run on the calling thread.
        self._threaded = device.type == "cpu"
        self._sent: List[Tuple[List[GradientEdge], Tuple[Optional[torch.Tensor], ...]]] = []
        self._running: List[Tuple[List[GradientEdge], Tuple[Optional[torch.Tensor], ...]]] = []
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.batch: Optional[int] = None

    @property
    def in_flight(self) -> bool:
        """An update was started and not joined yet."""
        return bool(self._running) or self._thread is not None

    def send(self, outputs: List[torch.Tensor], grads: List[torch.Tensor], *, defer: bool) -> None:
        """Send ``grads`` back into ``outputs``: only up to the collectives' waits when
        ``defer`` and the graph can be cut there, else the whole way now."""
        edges = waiting_edges(outputs) if defer else None
        if edges is None:
            torch.autograd.backward(outputs, grads)
            return
        at_edges = torch.autograd.grad(outputs, edges, grads, allow_unused=True)
        self._sent.append((edges, at_edges))

    def start(self, batch: Optional[int]) -> None:
        """Start the second half of what :meth:`send` left, for ``batch``."""
        self.join()
        if not self._sent:
            return
        self._running, self._sent = self._sent, []
        self.batch = batch
        if self._threaded:
            self._thread = threading.Thread(
                target=self._run, name="trec_pipelines-embedding-update", daemon=True
            )
            self._thread.start()

    def join(self) -> None:
        """Wait for the started update (run it here when there is no worker)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        elif self._running:
            self._run()
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(
                f"the embedding update of batch {self.batch} failed: "
                f"{type(error).__name__}: {error}"
            ) from error

    def drop(self) -> None:
        """Forget what was sent and not started (a failed step's)."""
        self._sent.clear()

    def _run(self) -> None:
        running, self._running = self._running, []
        try:
            for edges, grads in running:
                torch.autograd.backward(edges, grads)  # type: ignore[arg-type]
        except BaseException as error:  # re-raised by join(), on the training thread
            self._error = error


def is_dmp_collection(model: torch.nn.Module) -> bool:
    # torchrec's 2D parallel wrapper (absent from older torchrec): its weight sync reads the tables.
    collection = getattr(model_parallel, "DMPCollection", None)
    return collection is not None and isinstance(model, collection)


def join_before_state_dict(
    modules: Sequence[Tuple[str, torch.nn.Module]], update: EmbeddingUpdate
) -> None:
    """Make each module's ``state_dict`` wait for ``update`` (a checkpoint between steps)."""
    ref = weakref.ref(update)

    def join(*_: Any, **__: Any) -> None:
        held = ref()
        if held is not None:
            held.join()

    for _, module in modules:
        module.register_state_dict_pre_hook(join)
