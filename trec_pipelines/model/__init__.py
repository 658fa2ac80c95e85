"""The model rewrite: finding the sharded modules and their inputs (tracing, arguments), the
contexts the forwards read, postprocs, backward hooks.
"""
