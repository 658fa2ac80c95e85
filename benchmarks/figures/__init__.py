"""Every picture a run or a sweep writes, and ``python -m benchmarks replot``, which draws them
again from a results folder: the QPS figure (:mod:`.qps_chart`), the timelines
(:mod:`.timelines`), the memory figures (:mod:`.memory_chart`) and the sweep's map
(:mod:`.sweep_chart`).  Drawn from stored JSON only, so they may use the tables, the measuring
probes and the settings, never the contenders or the runner.
"""
