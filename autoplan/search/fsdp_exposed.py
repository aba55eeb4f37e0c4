"""FSDP communication a plan leaves exposed: per pass, per micro-batch, and per rank once a step.

Apart from the plan's assembly (search/assemble.py) because it is the one part of a rank's
timing that depends on how FSDP (zero >= 2) overlaps its all-gathers and reduce-scatters with the
passes ([Note: FSDP communication] in cost/comm.py); DDP-style reduction is timed where the tails are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoplan.cost.comm import prefetch_exposed_s
from autoplan.cost.config import ParallelConfig
from autoplan.cost.time import BlockTimes
from autoplan.search.context import SearchContext, stage_gpus

__all__ = ["FsdpExposed", "fsdp_exposed"]


@dataclass(frozen=True)
class FsdpExposed:
    """FSDP communication left exposed ([Note: FSDP communication] in cost/comm.py)."""

    fwd_s: list[float]
    """Per stage, per micro-batch: added to its forward."""
    bwd_s: list[float]
    """Per stage, per micro-batch: added to its backward."""
    tail_s: list[float]
    """Per pipeline rank, once per step: zero 2's all-gather, and with pp > 1 the gradient
    reduce-scatters after the last backward."""


def fsdp_exposed(ctx: SearchContext, cfg: ParallelConfig, ranges: list[tuple[int, int]],
                  stage_times: list[BlockTimes]) -> FsdpExposed | None:
    """What FSDP (zero >= 2) adds to each pass and to each rank's tail; None for zero 0 / 1."""
    if cfg.zero < 2:
        return None
    fwd = [0.0] * cfg.num_stages
    bwd = [0.0] * cfg.num_stages
    tail = [0.0] * cfg.pp
    if cfg.dp <= 1:
        return FsdpExposed(fwd, bwd, tail)
    per_microbatch_reduce = cfg.pp == 1
    pp_gpus = stage_gpus(ctx.cluster, cfg)
    for k, (a, b) in enumerate(ranges):
        p = k % cfg.pp
        cal = ctx.calibration(pp_gpus[p])
        slowdown = cal.overlap_slowdown
        gather, reduce = ctx.fsdp_unit_times(cfg, p)
        f, g = ctx.block_passes(stage_times[k])
        gather, reduce, f, g = gather[a:b], reduce[a:b], f[a:b], g[a:b]
        forward_gather = prefetch_exposed_s(f, gather, slowdown=slowdown)
        if cfg.zero == 3:
            fwd[k] = forward_gather
        else:
            tail[p] += forward_gather  # gathered once, in the step's first forward
        if cfg.zero == 3 or per_microbatch_reduce:
            # Backward runs the units in reverse: gathers ahead, reductions behind.
            bwd[k] = prefetch_exposed_s(g[::-1], gather[::-1] if cfg.zero == 3 else None,
                                        reduce[::-1] if per_microbatch_reduce else None, slowdown=slowdown)
        if not per_microbatch_reduce:
            tail[p] += float(reduce.sum())
        # Host time per unit the step waits for, once per step (calibration `fsdp_unit_overhead_s`,
        # fitted: the published runs with one micro-batch need it, the one with 21 is over-predicted
        # when it is charged per micro-batch), for a forward and a backward over every unit.
        tail[p] += 2.0 * float(np.count_nonzero(gather)) * cal.fsdp_unit_overhead_s
    return FsdpExposed(fwd, bwd, tail)
