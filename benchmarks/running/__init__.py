"""A run from end to end: the launched ranks' phases (:mod:`.runner`), each variant's recorded
epoch (:mod:`.recording`), the run header (:mod:`.run_header`) and the regime sweep that launches
many runs (:mod:`.sweep`).  The top of the benchmark: it may use every other part, and no other
part uses it (only ``python -m benchmarks``).
"""
