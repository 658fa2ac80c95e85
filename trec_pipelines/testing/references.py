"""The distributed tier's plain-loop references, each trained once per run.

[Note: one reference per input]
Most tests of the distributed tier compare a pipeline with the plain loop over
a freshly built model and the same batches, and a test parametrized over the
pipeline variants (a dozen of them, some over 16) trains the same reference
again in every parametrization.  :func:`plain_loop_of` is
``plain_loop(*make_sharded(model_factory, sharding_type, seed=seed, pg=pg, **build), batches)``
trained once per process for the same inputs: every later call gets a copy of
the first one's outputs and final weights.  The plain loop is deterministic for
the same model, seed, sharding and batches, so the copy is what a new run would
give, bit for bit; the tests that compare with it check the same thing.
:func:`kept` does the same for any other reference: its caller names the
computation and what it reads besides its inputs.

The key is everything the run depends on, on every rank (a rank's outputs
depend on the other ranks' batches too, through the all-to-alls and the
all-reduce): each rank hashes the model factory (a class or function defined
at a module's top level, named by module and name; one made inside a function,
a ``functools.partial`` or a lambda is never kept, since two of them of one
name may differ), the sharding type, the seed and the other build arguments
(numbers, strings and top-level classes only), the world size, the device type
and its batches' contents (their tensors' dtypes, shapes and bytes; KJTs' keys,
values, lengths and weights), and the key is every rank's hash in rank order
(one all-gather).  The process group is not in it: a model sharded over any
group of the same ranks trains alike.

Every rank must take the same path (a miss trains, with collectives): a rank
that failed in the middle of an earlier test's reference holds nothing where
the others hold it, so the ranks meet in one all-reduce and train it again
unless all of them hold it.  ``make_sharded`` seeds the global generator; the
generator's state after the first run is kept with it and put back on every
copy, so code after the call sees what it would have seen.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from trec_pipelines.testing import devices
from trec_pipelines.testing.dlrm import DLRM, Run, current_group, make_sharded, plain_loop

_DIGEST_BYTES = 32  # sha256
_runs: Dict[Tuple[bytes, ...], Tuple[Any, List[torch.Tensor]]] = {}
T = TypeVar("T")
_trained = 0


class _NotKept(Exception):
    """An input the key cannot name for sure: the reference is trained, not kept."""


def _top_level_name(value: Any) -> str:
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if not module or not qualname or "<" in qualname:  # <locals>, <lambda>
        raise _NotKept(repr(value))
    return f"{module}.{qualname}"


def _digest(value: Any, into: Any) -> None:
    """Feed ``value``'s contents (tensors' dtypes, shapes and bytes) to the hash ``into``."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        into.update(f"T{flat.dtype}{tuple(value.shape)}".encode())
        into.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, KeyedJaggedTensor):
        into.update(f"KJT{value.keys()}".encode())
        for part in (value.values(), value.lengths(), value.weights_or_none()):
            _digest(part, into)
    elif value is None or isinstance(value, (bool, int, float, str)):
        into.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, dict):
        into.update(b"{")
        for key in sorted(value, key=repr):
            into.update(repr(key).encode())
            _digest(value[key], into)
        into.update(b"}")
    elif isinstance(value, (list, tuple)):
        into.update(b"[")
        for item in value:
            _digest(item, into)
        into.update(b"]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        into.update(_top_level_name(type(value)).encode())
        for field in dataclasses.fields(value):
            _digest(getattr(value, field.name), into)
    else:
        raise _NotKept(type(value).__qualname__)


def _build_argument(value: Any) -> str:
    if isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, type):
        return _top_level_name(value)
    raise _NotKept(repr(value))


def _local_digest(what: str, inputs: Any, pg: dist.ProcessGroup) -> Optional[bytes]:
    """This rank's ``what`` and ``inputs`` hashed, with the world size and device type;
    None when an input cannot be named for sure."""
    contents = hashlib.sha256(f"{what};{dist.get_world_size(pg)};{devices.device().type}".encode())
    try:
        _digest(inputs, contents)
    except _NotKept:
        return None
    return contents.digest()


def _key(local: Optional[bytes], pg: dist.ProcessGroup) -> Optional[Tuple[bytes, ...]]:
    """Every rank's digest, in rank order (a rank's run depends on the others' batches
    too: the all-to-alls and the all-reduce), or None when any rank's is None."""
    mine = torch.zeros(_DIGEST_BYTES + 1, dtype=torch.uint8)
    if local is not None:
        mine[0] = 1
        mine[1:] = torch.frombuffer(bytearray(local), dtype=torch.uint8)
    device = devices.device()
    gathered = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(gathered, mine.to(device), group=pg)
    rows = [row.cpu() for row in gathered]
    if not all(int(row[0]) for row in rows):
        return None
    return tuple(bytes(row[1:].tolist()) for row in rows)


def _held_by_every_rank(key: Tuple[bytes, ...], pg: dist.ProcessGroup) -> bool:
    held = torch.tensor([int(key in _runs)], dtype=torch.int32, device=devices.device())
    dist.all_reduce(held, op=dist.ReduceOp.MIN, group=pg)
    return bool(held.item())


def _copy(value: T) -> T:
    """A copy of a reference: its tensors cloned, in the same runs, lists, tuples and dicts."""
    copied: Any
    if isinstance(value, torch.Tensor):
        copied = value.clone()
    elif isinstance(value, Run):
        copied = Run([_copy(out) for out in value], _copy(value.weights))
    elif isinstance(value, dict):
        copied = {k: _copy(v) for k, v in value.items()}
    elif isinstance(value, (list, tuple)):
        copied = type(value)(_copy(item) for item in value)
    else:
        copied = value
    return cast(T, copied)


def _generator_states() -> List[torch.Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available():
        states += torch.cuda.get_rng_state_all()
    return states


def _put_back(states: List[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state_all(states[1:])


def kept(
    what: Optional[str],
    inputs: Any,
    compute: Callable[[], T],
    pg: Optional[dist.ProcessGroup] = None,
) -> T:
    """``compute()``, once per process for the same ``what`` and ``inputs`` on every rank
    (see [Note: one reference per input]); later calls get a copy of its result.

    ``what`` names the computation and whatever it reads besides ``inputs`` (a
    test's model, seed, options), so that two computations of one name and the
    same inputs are the same (None: computed every time, never kept); ``inputs`` are tensors, KJTs, numbers, strings,
    dataclass batches and lists, tuples and dicts of them.  The result is a
    :class:`~trec_pipelines.testing.dlrm.Run`, a tensor, or lists, tuples and
    dicts of them.  Call it on every rank alike: it meets the other ranks over
    ``pg`` (default :func:`~trec_pipelines.testing.dlrm.current_group`).
    """
    global _trained
    group = pg if pg is not None else current_group()
    key = _key(_local_digest(what, inputs, group) if what is not None else None, group)
    if key is not None and _held_by_every_rank(key, group):
        value, generators = _runs[key]
        _put_back(generators)
        return cast(T, _copy(value))
    result = compute()
    _trained += 1
    if key is not None:
        _runs[key] = (_copy(result), _generator_states())
    return result


def plain_loop_of(
    model_factory: Callable[..., nn.Module],
    sharding_type: str,
    batches: Sequence[Any],
    seed: int = 0,
    pg: Optional[dist.ProcessGroup] = None,
    **build: Any,
) -> Run:
    """``plain_loop(*make_sharded(model_factory, sharding_type, seed=seed, pg=pg, **build), batches)``,
    trained once per process for the same inputs (see [Note: one reference per input]).

    Call it on every rank alike (it may train, and it meets the other ranks once
    over ``pg``, default :func:`~trec_pipelines.testing.dlrm.current_group`).
    Returns a copy of the run: a caller may change it freely.
    """
    batches = list(batches)
    group = pg if pg is not None else current_group()

    def train() -> Run:
        model, optimizer = make_sharded(model_factory, sharding_type, seed=seed, pg=group, **build)
        return plain_loop(model, optimizer, batches)

    what: Optional[str]
    try:
        what = (
            f"plain_loop:{_top_level_name(model_factory)};{sharding_type};{seed};"
            f"{sorted((name, _build_argument(v)) for name, v in build.items())}"
        )
    except _NotKept:
        what = None  # trained, never kept
    return kept(what, batches, train, group)


def plain_loop_restarted(batches: Sequence[Any], k: int, seed: int, restart_seed: int) -> Run:
    """The plain loop over ``batches`` on a DLRM built with ``seed``, the reference of
    a run resumed after ``k`` batches.  On more than 2 ranks it too restarts there, in
    a model built with ``restart_seed`` and loaded from the first one's state: DDP
    rebuilds its gradient buckets after a model's first backward, and an all-reduce
    over more than two ranks sums in an order that depends on them, so any resumed
    run (the plain loop's as well) differs from an uninterrupted one in the last
    bits.  Two ranks sum two values, in either order the same."""
    if dist.get_world_size() <= 2 or k == 0:
        return plain_loop_of(DLRM, "table_wise", batches, seed=seed)
    dmp, optimizer = make_sharded(DLRM, "table_wise", seed=seed)
    first = plain_loop(dmp, optimizer, batches[:k])
    dmp2, optimizer2 = make_sharded(DLRM, "table_wise", seed=restart_seed)
    dmp2.load_state_dict(dmp.state_dict())
    optimizer2.load_state_dict(optimizer.state_dict())
    rest = plain_loop(dmp2, optimizer2, batches[k:])
    return Run(list(first) + list(rest), rest.weights)


def references_trained() -> int:
    """How many references this process has trained (the rest were copies)."""
    return _trained


__all__ = ["kept", "plain_loop_of", "plain_loop_restarted", "references_trained"]
