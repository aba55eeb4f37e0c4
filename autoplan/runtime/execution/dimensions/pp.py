"""Pipeline parallelism's hooks: the copies of a tied weight on different stages.

`partition` splits the stages (split.py) and builds the executor (executor.py) for every plan, pp 1
included, so those two steps frame the registry's instead of being hooks of this one."""

from __future__ import annotations

import time
from typing import Any, ClassVar

from autoplan.runtime.execution.dimensions.base import Dimension
from autoplan.runtime.parallel.data_parallel import all_reduce_grads

__all__ = ["PipelineParallel"]


class PipelineParallel(Dimension):
    name: ClassVar[str] = "pp"
    fields: ClassVar[tuple[str, ...]] = ("pp", "virtual_stages", "rank_order")

    def reduce_grads(self, pm: Any) -> None:
        """A weight tied over stages (an embedding and its head) has one gradient per stage holding
        it: their sum, before dp averages it as any other (mesh.py `tie_groups`)."""
        start = time.perf_counter()
        for name, group in pm.layout.tie_groups.items():
            local = [p for n, p in pm.named_masters() if pm.aliases.get(n) == name]
            all_reduce_grads(local, group, average=False)
        if pm.layout.tie_groups:
            pm.last_reductions.append(("TIED_GRAD_SYNC", start, time.perf_counter()))
