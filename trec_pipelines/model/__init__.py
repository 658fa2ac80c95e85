"""The model rewrite: finding the sharded modules and their inputs (tracing, arguments), the
forward wrappers, the contexts they read, postprocs, the take-over, backward hooks.
"""
