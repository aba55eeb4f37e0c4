"""The dimensions the runtime runs, in the order of `partition`'s steps (api.py [Note: the order of
partition's steps]; [Note: a dimension's hooks] in base.py says how each hook walks it). A new
dimension is one module of this package and one line here, at the place its step takes."""

from __future__ import annotations

from collections.abc import Sequence

from autoplan.runtime.execution.dimensions.base import Dimension
from autoplan.runtime.execution.dimensions.cp import ContextParallel
from autoplan.runtime.execution.dimensions.dp import DataParallel
from autoplan.runtime.execution.dimensions.ep import ExpertParallel
from autoplan.runtime.execution.dimensions.pp import PipelineParallel
from autoplan.runtime.execution.dimensions.precision import Precision
from autoplan.runtime.execution.dimensions.recompute import Recompute
from autoplan.runtime.execution.dimensions.tp import TensorParallel

__all__ = ["DIMENSIONS", "dimension_of_field"]

DIMENSIONS: tuple[Dimension, ...] = (
    PipelineParallel(),  # the stages are split first; tied copies' gradients summed before dp averages them
    TensorParallel(),    # before materialization on meta: only the shards are allocated
    ContextParallel(),
    ExpertParallel(),    # on initialized weights: the experts are found before they are sliced
    Precision(),         # after every step that replaces parameters: the fp32 masters are the final ones
    Recompute(),         # after precision: the recompute pieces refer to the final stage modules
    DataParallel(),      # FSDP wraps the finished runners, last
)
"""Every dimension, in the order of its steps."""


def dimension_of_field(field: str, dimensions: Sequence[Dimension] | None = None) -> Dimension | None:
    """The dimension (of `dimensions`, else `DIMENSIONS`) that runs a `Layout` field's degree, or None."""
    return next((d for d in (DIMENSIONS if dimensions is None else dimensions) if field in d.fields), None)
