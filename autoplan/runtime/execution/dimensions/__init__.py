"""The runtime's dimensions: each one's steps in `partition` and hooks in `PartitionedModel.step`
(base.py [Note: a dimension's hooks]), listed in order in registry.py."""

from __future__ import annotations

from autoplan.runtime.execution.dimensions.base import Checked, Dimension

__all__ = ["Checked", "Dimension"]
