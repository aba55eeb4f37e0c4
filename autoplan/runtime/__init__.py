"""Run a plan: this rank's stages, the pipeline executor, DP reduction, and the launcher.

One package per concern, each importing only those below it (pyproject.toml's contract):
launcher/ (`autoplan run`: checks, ranks, the training loop) > api.py (`partition`) > execution/
(the executor, `PartitionedModel`) > checkpoint/ (state and weights in and out) > parallel/ (the
plan's parallelism applied to this rank's model, one step per module).

The public names load on first use (PEP 562 module `__getattr__`, as in autoplan/__init__.py):
`autoplan run` imports `autoplan.runtime.launcher.machine` to refuse a plan this machine cannot hold before
torch loads (machine.py [Note: the refusal before torch]); importing the package must not load it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY: dict[str, str] = {
    "ActionRecord": "autoplan.runtime.execution.executor",
    "PipelineExecutor": "autoplan.runtime.execution.executor",
    "Stage": "autoplan.runtime.execution.executor",
    "PartitionError": "autoplan.runtime.api",
    "PartitionedModel": "autoplan.runtime.api",
    "partition": "autoplan.runtime.api",
    "run_plan": "autoplan.runtime.launcher.launch",
}

if TYPE_CHECKING:  # type checkers and IDEs see the eager imports
    from autoplan.runtime.api import PartitionedModel, PartitionError, partition
    from autoplan.runtime.execution.executor import ActionRecord, PipelineExecutor, Stage
    from autoplan.runtime.launcher.launch import run_plan

__all__ = ["ActionRecord", "PartitionError", "PartitionedModel", "PipelineExecutor", "Stage", "partition", "run_plan"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cached: the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
