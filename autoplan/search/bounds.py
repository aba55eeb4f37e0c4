"""Lower bounds the search prunes with: on a configuration's step time before and after cutting,
before simulating, and on the GPUs a model needs.

Apart from the scoring because each is a proof obligation of its own (space.py [Note: an exact top
k]): a bound that exceeds what the simulator returns drops a plan the search should have kept, so
each is stated beside the argument that makes it a bound.
"""

from __future__ import annotations

import math

import numpy as np

from autoplan.cost.config import ParallelConfig
from autoplan.cost.memory import MIN_BYTES_PER_PARAM
from autoplan.cost.time import BlockTimes
from autoplan.graph.blocks import ModelProfile
from autoplan.schedule import ActionKind, schedule_spec
from autoplan.search.context import SearchContext
from autoplan.search.stage_model import Cuts

__all__ = ["Dominated", "bottleneck_bound", "min_gpus_needed", "simulated_step_lower_bound", "step_lower_bound"]


class Dominated(Exception):
    """The configuration provably cannot beat `cutoff_s` (raised before simulating it); `args[0]`
    is the lower bound on its step time that showed it."""


def bottleneck_bound(cfg: ParallelConfig, cuts: Cuts, link_s: np.ndarray) -> float:
    """A lower bound on the step time of every cutting with this bottleneck, the refined one
    included ([Note: DP tie-break]: it keeps the bottleneck, not the other stages).

    Some stage of any such cutting takes the bottleneck B in the DP's model, its blocks plus its two
    boundaries' P2P time (stage_model.py `stage_stats`), so its compute is at least B - 2 max(P2P),
    and its rank runs that compute for each of the m micro-batches one after another. The margin
    covers the prefix sums' rounding."""
    link = float(np.max(link_s)) if len(link_s) else 0.0
    return cfg.num_microbatches * (cuts.bottleneck_s - 2.0 * link) * (1 - 1e-9)


def step_lower_bound(ctx: SearchContext, cfg: ParallelConfig, cuts: Cuts, stage_times: list[BlockTimes]) -> float:
    """A lower bound on the step time of a cut configuration, without simulating it.

    Pipeline rank r cannot start before micro-batch 0 has passed the forwards of the stages before
    it, is then busy for all its own work, and (when its last action is a full backward: GPipe,
    1F1B, interleaved) the earlier stages' backwards of the last micro-batch follow it. Communication
    and the tail only add. For equal stages under 1F1B this is exactly (m + p - 1)(F + B).
    """
    ranges = cuts.stage_ranges()
    fwd, bwd = ctx.pass_times(stage_times, ranges)
    m = cfg.num_microbatches
    trailing = not schedule_spec(cfg.schedule).split_backward
    bound = 0.0
    for r in range(cfg.pp):
        busy = m * sum(fwd[k] + bwd[k] for k in range(r, cfg.num_stages, cfg.pp))
        before = sum(fwd[:r])
        after = sum(bwd[:r]) if trailing else 0.0
        bound = max(bound, before + busy + after)
    return bound


def simulated_step_lower_bound(cfg: ParallelConfig, durations: dict, delays_f: list[float], delays_b: list[float],
                               tails: list[float]) -> float:
    """A lower bound on what `simulate` returns for this configuration's schedule, from two kinds of
    dependency paths of its event model (schedule/simulate.py) instead of the whole event walk.

    `durations[kind][k]`: seconds of an action of that kind on stage k; `delays_f[s - 1]`: the P2P
    time into stage s's forward, `delays_b[s]`: into stage s's backward; `tails[r]`: rank r's tail.
    Stage k lives on rank k % pp. Every schedule starts rank r with F(r, 0) (chunk 0), which waits
    for F(0, 0) -> F(1, 0) -> ... -> F(r - 1, 0) and the transfers between them; the rank then runs
    all its actions one after another: end_r >= A_r + busy_r. Under GPipe, 1F1B and interleaved
    1F1B rank r ends with B(r, m - 1) (the last micro-batch's chunk-0 backward), and the backwards
    B(r - 1, m - 1) ... B(q, m - 1) of ranks r - 1 ... q follow it through their transfers, so
    end_q >= A_r + busy_r + (those backwards and transfers) for q < r. (Zero-bubble H1 ends with
    W passes, so only the first kind of path is used there.) The step is at least max_q end_q +
    tail_q. With equal stages and free communication this is (m + p - 1)(F + B) for 1F1B, the
    exact 1F1B step (Narayanan et al. 2021, Sec. 2.2.1).
    """
    p, m, num_stages = cfg.pp, cfg.num_microbatches, cfg.num_stages
    fwd, bwd = durations[ActionKind.F], durations[ActionKind.B]
    w = durations.get(ActionKind.W)
    per_stage = [fwd[k] + bwd[k] + (w[k] if w is not None else 0.0) for k in range(num_stages)]
    ends = [0.0] * p
    start = 0.0  # A_r: earliest start of rank r's first action
    for r in range(p):
        if r > 0:
            start += fwd[r - 1] + delays_f[r - 1]
        ends[r] = start + m * sum(per_stage[r::p])
    lower = list(ends)
    if not schedule_spec(cfg.schedule).split_backward:
        for r in range(1, p):
            t = ends[r]
            for q in range(r - 1, -1, -1):
                t += delays_b[q] + bwd[q]
                if t > lower[q]:
                    lower[q] = t
    return max(e + tail for e, tail in zip(lower, tails, strict=True))


def min_gpus_needed(profile: ModelProfile, dtype: str, gpu_mem_bytes: float, allowance: float) -> int:
    """A lower bound on GPUs: weights, gradients and optimizer states fully sharded (16 bytes per
    parameter, ZeRO-3 / FSDP; cost/memory.py [Note: bytes per parameter]) spread over every GPU,
    each tied parameter once, activations ignored."""
    per_param = MIN_BYTES_PER_PARAM(dtype)
    return max(1, math.ceil(profile.num_params * per_param / max(gpu_mem_bytes - allowance, 1.0)))
