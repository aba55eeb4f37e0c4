"""Run a plan: this rank's stages, the pipeline executor, DP reduction, and the launcher."""

from autoplan.runtime.api import PartitionedModel, PartitionError, partition
from autoplan.runtime.executor import ActionRecord, PipelineExecutor, Stage
from autoplan.runtime.launch import run_plan

__all__ = ["ActionRecord", "PartitionError", "PartitionedModel", "PipelineExecutor", "Stage", "partition", "run_plan"]
