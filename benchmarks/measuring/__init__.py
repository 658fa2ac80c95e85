"""Probes that measure something besides the wall time: the memory a contender holds and where
(:mod:`.memory`, :mod:`.memory_places`), the bytes the link carries (:mod:`.link_bytes`), the
hidden input-dist fraction and the link-order bound (:mod:`.schedule_bound`), the dependency
bound per semantics (:mod:`.dependency_bound`) and what the ranks' agreement costs
(:mod:`.agreement_cost`, run on its own by ``make bench-agreement``).  May use the settings and
the contenders; never the tables, figures or the runner.
"""
