"""The plan's parallelism applied to this rank's model: each module is one step `partition`
(runtime/api.py) calls, in the order that file gives.
"""
