"""Launching and supervising a job: the checks before any process starts, the local ranks, their
process group and the training loop each runs (docs/architecture.md, "Launch").

Nothing is imported here: `autoplan run` imports machine.py before torch loads.
"""
