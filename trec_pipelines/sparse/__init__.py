"""The pipelined forwards and the sparse ops they run: the take-over of the sharded modules,
input_dist, the embedding lookup, cache prefetch, PEC's ops, the embedding kernels, stashing,
gradient accumulation.
"""
