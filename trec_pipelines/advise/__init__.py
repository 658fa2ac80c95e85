"""Which pipeline for my model: :func:`advise` times a user's own model under every variant.

``python -m trec_pipelines.advise --help`` is the same from the command line
(it launches the ranks under torchrun).  Modules: ``variants`` (which apply,
how each is built), ``measure`` (one contender for one round), ``run`` (the
rounds and the ranks' agreement), ``advice`` (the result and the rule),
``plot`` (the PNG), ``cli`` (the command line).
"""

from trec_pipelines.advise.advice import Advice, VariantReport, parse_bytes
from trec_pipelines.advise.run import advise

__all__ = ["Advice", "VariantReport", "advise", "parse_bytes"]
