"""Type aliases shared by the modules of the package."""

from __future__ import annotations

from typing import Any

from torchrec.distributed.types import ShardedModule

# A sharded module of any input, output and context types: the pipelines handle
# every kind (EBC, EC, FP-EBC, a user's own) the same way.
AnyShardedModule = ShardedModule[Any, Any, Any, Any]
