"""Tensor parallelism's steps and hooks (tensor_parallel.py): the linears sharded, an inlined
graph's stages run in DTensor, and gradients laid out as their parameters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from autoplan.runtime.execution.dimensions.base import Dimension
from autoplan.runtime.parallel.tensor_parallel import apply_tensor_parallel, grad_like_param, run_in_dtensor

if TYPE_CHECKING:
    from autoplan.plan import Plan
    from autoplan.runtime.parallel.mesh import ParallelLayout
    from autoplan.runtime.parallel.split import StageBuild

__all__ = ["TensorParallel"]


class TensorParallel(Dimension):
    name: ClassVar[str] = "tp"
    fields: ClassVar[tuple[str, ...]] = ("tp",)
    on_meta_first: ClassVar[bool] = True  # on meta, only the shards are allocated (api.py's note)

    def apply(self, build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
        apply_tensor_parallel(build, plan, layout)

    def wrap(self, build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
        # Around the recompute runner, so recomputation runs in DTensor too; inside FSDP's.
        run_in_dtensor(build, plan, layout)

    def after_backward(self, pm: Any) -> None:
        if pm.plan.tp > 1:  # DTensor gradients laid out as their parameters (see grad_like_param)
            for _, p in pm.named_masters():
                if p.grad is not None:
                    p.grad = grad_like_param(p, p.grad)
