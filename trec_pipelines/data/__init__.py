"""The data path: where the host batches come from (the batch source, validation, the ranks'
agreement, the loader thread, the in-place copy).
"""
