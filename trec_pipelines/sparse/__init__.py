"""The sparse ops: input_dist and its process group, the embedding lookup, cache prefetch,
PEC's ops, the embedding kernels, stashing, gradient accumulation.
"""
