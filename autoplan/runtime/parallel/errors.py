"""The runtime's refusal: a plan that cannot run on this model or in this process group.

Apart so that every step of `partition` (split.py, tensor_parallel.py, fsdp.py, ...) can raise it
without importing api.py, which imports them all.
"""

from __future__ import annotations

__all__ = ["PartitionError"]


class PartitionError(ValueError):
    """The plan cannot run on this model or in this process group (one-line message)."""
