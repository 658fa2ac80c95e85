"""Which pipeline for my model: :func:`advise` times a user's own model under every variant.

``python -m trec_pipelines.advise --help`` is the same from the command line
(it launches the ranks under torchrun).  Modules: ``variants`` (which apply,
how each is built), ``measure`` (one contender for one round), ``budget``
(how long to measure, within the time budget), ``run`` (the rounds and the
ranks' agreement), ``verdict`` (recommend, keep the plain
loop, or cannot tell: the rule), ``advice`` (the result, its table and
JSON), ``plot`` (the PNG), ``cli`` (the command line).
"""

from trec_pipelines.advise.advice import Advice, VariantReport, parse_bytes
from trec_pipelines.advise.run import advise
from trec_pipelines.advise.verdict import Answer, Verdict

__all__ = ["Advice", "Answer", "VariantReport", "Verdict", "advise", "parse_bytes"]
