"""The embedding kernels of a torchrec sharded embedding module, as far as they can be seen.

A sharded EBC/EC keeps one lookup per sharding (``_lookups``), a data-parallel
one wrapped in DDP; each lookup groups its tables into kernels
(``_emb_modules``), each with its grouped config (``_config``: the tables and
their compute kernel) and its fbgemm module (``_emb_module``: the weights).
These are torchrec's internals, read in one place: what may fill a cache
(:func:`trec_pipelines.sparse.cache_prefetch.reads_a_cache`) and what a stash moves
(:func:`trec_pipelines.sparse.stashing.embedding_weights_to_stash`).
"""

from __future__ import annotations

from typing import Any, List, Optional


def embedding_kernels(module: Any) -> Optional[List[Any]]:
    """``module``'s embedding kernels, every lookup's; None when it has no lookups or
    a lookup whose kernels can't be seen (not a torchrec sharded embedding module)."""
    lookups = getattr(module, "_lookups", None)
    if lookups is None:
        return None
    kernels: List[Any] = []
    for lookup in lookups:
        inner = getattr(lookup, "module", lookup)  # a data-parallel lookup is DDP-wrapped
        found = getattr(inner, "_emb_modules", None)
        if found is None:
            return None
        kernels.extend(found)
    return kernels
