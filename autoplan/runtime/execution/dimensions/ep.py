"""Expert parallelism and expert tensor parallelism's steps (experts.py, expert_tp.py): each rank
keeps its slice of the experts. Their gradients are reduced with dp's (dp.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from autoplan.runtime.execution.dimensions.base import Checked, Dimension
from autoplan.runtime.parallel.experts import apply_expert_parallel, refuse_expert_parallel

if TYPE_CHECKING:
    from autoplan.plan import Plan
    from autoplan.runtime.parallel.mesh import ParallelLayout
    from autoplan.runtime.parallel.split import StageBuild

__all__ = ["ExpertParallel"]


class ExpertParallel(Dimension):
    name: ClassVar[str] = "ep"
    fields: ClassVar[tuple[str, ...]] = ("ep", "expert_tp")

    def refuse(self, checked: Checked) -> None:
        refuse_expert_parallel(checked.model, checked.traced, checked.plan)

    def apply(self, build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
        # On initialized weights: the experts are found before they are sliced (experts.py).
        apply_expert_parallel(build, plan, layout)
