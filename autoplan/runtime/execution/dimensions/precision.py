"""Mixed precision's step and hooks (precision.py): not a degree, but a step of `partition` in the
registry's order (after every step that replaces parameters: the fp32 masters are the final ones)
with hooks around every step: working copies refreshed, gradients flushed to the masters, fp16's
loss scale applied and removed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from autoplan.runtime.execution.dimensions.base import Dimension
from autoplan.runtime.parallel.errors import PartitionError
from autoplan.runtime.parallel.precision import apply_precision

if TYPE_CHECKING:
    from autoplan.plan import Plan
    from autoplan.runtime.parallel.mesh import ParallelLayout
    from autoplan.runtime.parallel.split import StageBuild

__all__ = ["Precision"]


class Precision(Dimension):
    name: ClassVar[str] = "precision"

    def apply(self, build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
        apply_precision(build, plan, layout)

    def before_step(self, pm: Any) -> None:
        """Before a forward: bf16 / fp16 working copies <- the fp32 masters the optimizer stepped,
        refusing a write under ZeRO-1 that reached one rank only."""
        if pm.precision is None:
            return
        changed = pm.precision.changed_master()
        if changed is not None:  # precision.py [Note: writes under ZeRO-1]
            name = next(n for n, p in pm.named_masters() if p is changed)
            raise PartitionError(
                f"parameter {name!r} was written outside the ZeRO-1 optimizer's step (an in-place write or another "
                f"optimizer over pm.parameters()); under ZeRO-1 each dp rank holds the fp32 values of 1/dp of the "
                f"parameters, so such a write reaches one rank only: step with the optimizer pm.make_optimizer() "
                f"returned, and set weights with pm.load_state_dict(state_dict) on every rank (or before "
                f"make_optimizer)")
        pm.precision.refresh()  # the optimizer stepped the fp32 masters since the last step

    def before_run(self, pm: Any) -> None:
        pm.executor.grad_scale = 1.0 if pm.loss_scaler is None else pm.loss_scaler.scale

    def after_backward(self, pm: Any) -> None:
        if pm.precision is not None:
            pm.precision.flush_grads()

    def after_reduce(self, pm: Any) -> None:
        if pm.loss_scaler is not None:  # the fp32 gradients, accumulated and reduced, at their true size
            pm.loss_scaler.unscale_([p.grad for _, p in pm.named_masters() if p.grad is not None])
