"""Benchmarks of trec_pipelines against torchrec and a plain loop (``make bench``)."""
