"""The compiled variants and the plain loops that do their compiled work.

Shared by the contenders (which build those plain loops) and the tables
(which report recompilations and use those loops as a reference).
"""

from __future__ import annotations

# Variants that compile (their recompilations are reported); as benchmarks.contenders.variants.COMPILED.
COMPILED_VARIANTS = frozenset({"TrainPipelinePT2", "TrainPipelineSparseDistCompAutograd"})

# The plain loop doing a compiled variant's compiled work, by variant: the
# overhead phase's second reference for it (benchmarks.contenders.build.CompiledPlainLoop),
# raw key "plain:train+<name>".
COMPILED_PLAIN = {
    "TrainPipelinePT2": "compiled model",
    "TrainPipelineSparseDistCompAutograd": "compiled autograd",
}


__all__ = ["COMPILED_PLAIN", "COMPILED_VARIANTS"]
