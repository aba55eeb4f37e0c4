"""`Dimension`: one parallel dimension's runtime, its steps in `partition` and its hooks in a step.

[Note: a dimension's hooks]
A dimension (tensor, pipeline, data, context, expert parallelism, and the two steps of `partition`
that are not degrees: precision and recompute) is one subclass of `Dimension` in a module of this
package, listed once in registry.py's `DIMENSIONS`. That order is the order of `partition`'s steps
(api.py [Note: the order of partition's steps]); every hook runs over the dimensions in it, except
`after_backward`, which runs in the reverse order, as wrappers unwind: the outermost step (data
parallel: FSDP wraps the finished runner) is the first to finish its backward, the innermost
(tensor parallel: DTensor gradients) the last.

- `refuse(checked)`: before the process group is made, so a plan that cannot run on this model
  fails in one line without communicating.
- `apply(build, plan, layout)`: its step on this rank's stage modules (split.py `StageBuild`).
  `on_meta_first` dimensions apply before the stages are materialized when the model was built on
  meta (only their shards are allocated), after it otherwise.
- `wrap(build, plan, layout)`: after every `apply`, in order: what wraps the stages' finished
  runners (tensor parallel's DTensor runner, then FSDP around it).
- In `PartitionedModel.step` (partitioned.py), in this order: `before_step(pm)` (before the inputs
  are split: precision refreshes its working copies; `evaluate` calls it too), `split_input(pm,
  value)` on each batched input tensor (this replica's rows; cp keeps its chunks of the sequence),
  `before_run(pm)`,
  `run_context(pm)` (a context manager entered around the pipeline's run, or None; `evaluate`'s
  forward-only run too), `after_backward(pm)` (reverse order), `reduce_grads(pm)`,
  `after_reduce(pm)`; and `after_evaluate(pm)` after an evaluation.

Every hook does nothing by default: a dimension overrides the ones it needs, and reads what it needs
from the plan, the layout (mesh.py) and the `PartitionedModel` it is given.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from autoplan.plan import Plan
    from autoplan.runtime.parallel.mesh import ParallelLayout
    from autoplan.runtime.parallel.split import StageBuild

__all__ = ["Checked", "Dimension"]


@dataclass(frozen=True)
class Checked:
    """What `partition` knows of a model before the process group is made (`Dimension.refuse`)."""

    plan: Plan
    source: Any
    """The model source (sources/base.py `ModelSource`)."""
    model: Any
    """The whole model, on meta for a spec (nn.Module)."""
    traced: Any
    """The traced model (graph/trace.py `TracedModel`) at the micro-batch size."""
    tp_plan: Any
    """The tensor-parallel layout as the traced graph runs it (module path -> style)."""


class Dimension:
    """One dimension's runtime; see [Note: a dimension's hooks]. Subclasses set `name` and `fields`."""

    name: ClassVar[str]
    """How the registry and messages name it."""
    fields: ClassVar[tuple[str, ...]] = ()
    """The `Layout` fields (layout.py) whose degrees it runs; every field is one dimension's
    (tests/test_dimensions.py)."""
    on_meta_first: ClassVar[bool] = False
    """Whether `apply` runs before materialization on a model built on meta (see the note)."""

    def refuse(self, checked: Checked) -> None:
        """Raise a one-line PartitionError for a plan this dimension cannot run on this model."""

    def apply(self, build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
        """Its step on this rank's stages."""

    def wrap(self, build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
        """What it wraps around the stages' finished runners."""

    def before_step(self, pm: Any) -> None:
        """Before a step's (or an evaluation's) inputs are split into micro-batches."""

    def split_input(self, pm: Any, value: torch.Tensor) -> torch.Tensor:
        """This rank's part of one batched input (this replica's rows, before micro-batches)."""
        return value

    def before_run(self, pm: Any) -> None:
        """Before a training step's pipeline runs."""

    def run_context(self, pm: Any) -> AbstractContextManager | None:
        """A context entered around the pipeline's run (a step's and an evaluation's), or None."""
        return None

    def after_backward(self, pm: Any) -> None:
        """After the pipeline's last backward (reverse registry order)."""

    def reduce_grads(self, pm: Any) -> None:
        """Its gradient reduction after the pipeline (registry order)."""

    def after_reduce(self, pm: Any) -> None:
        """After every reduction: the gradients are final here."""

    def after_evaluate(self, pm: Any) -> None:
        """After an evaluation's forward-only run."""

    def __repr__(self) -> str:
        return f"<dimension {self.name}>"
