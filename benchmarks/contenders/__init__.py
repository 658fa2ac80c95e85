"""What is raced: each pipeline of ours and of torchrec, and the plain training loops they are
compared with, built over the same sharded model and batches (:mod:`.build`).  Stands on
:mod:`benchmarks.settings` only.
"""
