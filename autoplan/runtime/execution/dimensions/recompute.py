"""Activation recomputation's step (recompute.py): not a degree, but a step of `partition` in the
registry's order, after precision (the recompute pieces refer to the final stage modules)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from autoplan.runtime.execution.dimensions.base import Dimension
from autoplan.runtime.execution.recompute import apply_recompute

if TYPE_CHECKING:
    from autoplan.plan import Plan
    from autoplan.runtime.parallel.mesh import ParallelLayout
    from autoplan.runtime.parallel.split import StageBuild

__all__ = ["Recompute"]


class Recompute(Dimension):
    name: ClassVar[str] = "recompute"

    def apply(self, build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
        apply_recompute(build, plan, layout)
