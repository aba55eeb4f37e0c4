"""Context parallelism's steps and hooks (context.py): the stages' attention routed to the cp
attention, which is entered, with this rank's positions, around every run of the pipeline."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

from autoplan.graph.positions import holding_positions
from autoplan.runtime.execution.dimensions.base import Checked, Dimension
from autoplan.runtime.parallel.context import apply_context_parallel, refuse_context_parallel, shard_sequence

if TYPE_CHECKING:
    import torch

    from autoplan.plan import Plan
    from autoplan.runtime.parallel.context import ContextParallelAttention
    from autoplan.runtime.parallel.mesh import ParallelLayout
    from autoplan.runtime.parallel.split import StageBuild

__all__ = ["ContextParallel"]


class ContextParallel(Dimension):
    name: ClassVar[str] = "cp"
    fields: ClassVar[tuple[str, ...]] = ("cp",)

    def refuse(self, checked: Checked) -> None:
        refuse_context_parallel(checked.source, checked.model, checked.traced, checked.plan)

    def apply(self, build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
        apply_context_parallel(build, plan, layout)

    def split_input(self, pm: Any, value: torch.Tensor) -> torch.Tensor:
        if pm.context is None:
            return value
        return shard_sequence(value, pm.context.positions, pm.plan.job.seq_len)

    def run_context(self, pm: Any) -> AbstractContextManager | None:
        return None if pm.context is None else _sharded(pm.context)


@contextmanager
def _sharded(context: ContextParallelAttention) -> Iterator[None]:
    """This rank's chunks of every sequence: the models' positions and the cp attention."""
    with holding_positions(context.positions, context.group), context:
        yield
