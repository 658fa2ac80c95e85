"""The text reports of a run: the throughput and overhead tables and the summary
(:mod:`.report`), the schedule bound's table (:mod:`.bound_report`), the dependency bound's
(:mod:`.dependency_report`) and the memory tables (:mod:`.memory_report`).  Pure functions of
the raw measurements: they may use the settings and the measuring probes' data shapes, never
the contenders, the figures or the runner.
"""
