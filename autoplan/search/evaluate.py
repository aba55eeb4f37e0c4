"""Score one parallel configuration: cut the blocks into stages, simulate the schedule, count memory.

This is where the parts meet (docs/architecture.md, "The search"): block times and bytes from `cost/`, stage
cutting from `search/partition.py`, the schedule from `schedule/` walked by its simulator, and the
result written down as a `Plan`.

This module chooses the cutting (the DP's answer, the cutoffs, the runtime's refusals); the parts it
meets live apart: what a search knows once in context.py, micro-batches in flight in inflight.py,
the pruning bounds in bounds.py, and the plan of a given cutting in assemble.py (with FSDP's
exposed communication in fsdp_exposed.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoplan.cost.config import ParallelConfig
from autoplan.cost.memory import allowance_bytes
from autoplan.cost.time import BlockTimes, cpu_sharing
from autoplan.graph.blocks import ModelProfile
from autoplan.plan import Plan
from autoplan.schedule import schedule_spec
from autoplan.search.assemble import Unsimulated, make_plan
from autoplan.search.bounds import Dominated, bottleneck_bound, step_lower_bound
from autoplan.search.climb import climb_boundaries
from autoplan.search.context import CutCache, SearchContext, stage_gpus
from autoplan.search.inflight import interleaved_at_peak, schedule_inflight
from autoplan.search.partition import DPSolver
from autoplan.search.stage_model import CutProblem, make_cuts

__all__ = ["Evaluation", "evaluate", "evaluate_cuts", "min_memory_bytes"]


@dataclass(frozen=True)
class Evaluation:
    config: ParallelConfig
    plan: Plan

    @property
    def step_time_s(self) -> float:
        return self.plan.predicted.step_time_s


@dataclass(frozen=True)
class _Inputs:
    """What every cutting of one configuration is scored with: per-stage block times, bytes, links."""

    pp_gpus: list
    stage_times: list[BlockTimes]
    total: np.ndarray
    """(n,) block times when every stage's device is alike, else (S, n)."""
    static: np.ndarray
    acts: np.ndarray
    inflight: np.ndarray
    link_s: np.ndarray

    def problem(self, ctx: SearchContext, capacity: np.ndarray) -> CutProblem:
        return CutProblem(block_time_s=self.total, cut_time_s=self.link_s, block_static_bytes=self.static,
                          block_act_bytes=self.acts, inflight=self.inflight, capacity_bytes=capacity,
                          legal_cut=ctx.legal)


def _inputs(ctx: SearchContext, cfg: ParallelConfig) -> _Inputs:
    pp_gpus = stage_gpus(ctx.cluster, cfg)
    times_by_type = {gpu.name: ctx.block_times(gpu, cfg) for gpu in pp_gpus}
    stage_times = [times_by_type[pp_gpus[k % cfg.pp].name] for k in range(cfg.num_stages)]
    total = stage_times[0].total_s if len(times_by_type) == 1 else np.stack([t.total_s for t in stage_times])
    if schedule_spec(cfg.schedule).looped and cfg.virtual_stages > 1:
        inflight = np.array(interleaved_at_peak(cfg.pp, cfg.num_microbatches, cfg.virtual_stages), dtype=float)
    else:
        inflight = np.array(schedule_inflight(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.virtual_stages),
                            dtype=float)
    # A stage's boundary costs its P2P time once (the transfer itself overlaps compute in the
    # simulator; this steers cuts away from boundaries that carry large tensors).
    return _Inputs(pp_gpus, stage_times, total, ctx.static_bytes(cfg), ctx.act_bytes(cfg), inflight,
                   ctx.link_times(cfg))


def _stage_capacity(ctx: SearchContext, cfg: ParallelConfig, pp_gpus: list, static: np.ndarray, acts: np.ndarray,
                    inflight: np.ndarray) -> np.ndarray:
    """Bytes each stage may use in the cutting DP, which checks stages one by one.

    Without interleaving a stage has its GPU to itself. With v virtual stages per GPU the GPU's
    memory is shared among its stages in proportion to what each needs under a cutting that spreads
    static + activation bytes evenly: chunk 0 of the first GPU holds about p micro-batches in flight
    and its later chunks fewer (Narayanan et al. 2021, Sec. 2.2.2), and the first stage carries the
    embedding. An even split of the GPU refused cuttings whose GPU total fits (the interleaved 1T
    run of Korthikanti et al. 2022, Table 3, was declared out of memory that way). The plan's memory
    is then checked per GPU (`rank_memories`)."""
    # The same memory problem recurs (both rank orders, FSDP's HSDP twin): `static` and `acts` are
    # the search context's cached arrays, alive as long as it is, so their ids name them.
    key = ("capacity", tuple(g.name for g in pp_gpus), cfg.pp, cfg.virtual_stages, id(static), id(acts),
           inflight.tobytes(), ctx.reserve(cfg))
    return ctx.cached(key, lambda: _stage_capacity_uncached(ctx, cfg, pp_gpus, static, acts, inflight))


def _stage_capacity_uncached(ctx: SearchContext, cfg: ParallelConfig, pp_gpus: list, static: np.ndarray,
                             acts: np.ndarray, inflight: np.ndarray) -> np.ndarray:
    per_gpu = np.array([g.mem_bytes - allowance_bytes(g) - ctx.reserve(cfg) for g in pp_gpus])
    num_stages = cfg.num_stages
    rank = np.arange(num_stages) % cfg.pp
    if cfg.virtual_stages == 1:
        return per_gpu[rank]
    n = len(static)
    cum = np.concatenate([[0.0], np.cumsum(static + acts * float(np.mean(inflight)))])
    bounds = [0]
    for k in range(1, num_stages):
        target = cum[-1] * k / num_stages
        i = int(np.searchsorted(cum, target))
        if i > 0 and target - cum[i - 1] < cum[min(i, n)] - target:
            i -= 1
        bounds.append(min(max(i, bounds[-1] + 1), n - (num_stages - k)))
    bounds.append(n)
    need = np.array([static[a:b].sum() + acts[a:b].sum() * inflight[k]
                     for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))])
    # Every stage's share at least the largest block's need: an even spread gives the last chunk
    # (norm and head) a share no layer fits in, and the DP then doubles a middle stage instead of
    # putting the last layer there (Megatron-LM's 530B and 1T rows, Narayanan et al. 2021: a 27-35%
    # bubble). The shares still sum to the GPU, so any cutting the DP accepts fits each GPU.
    need = np.maximum(need, float(static.max()) + float(acts.max()) * inflight)
    per_rank = np.bincount(rank, weights=need, minlength=cfg.pp)[rank]
    share = np.divide(need, per_rank, out=np.full(num_stages, 1.0 / cfg.virtual_stages), where=per_rank > 0)
    return per_gpu[rank] * share


def _simulated_plan(ctx: SearchContext, cfg: ParallelConfig, inputs: _Inputs, problem: CutProblem,
                    boundaries: Sequence[int]) -> Plan:
    """The plan for these boundaries, always simulated (no cutoff)."""
    plan = make_plan(ctx, cfg, make_cuts(problem, boundaries, optimal=False), inputs.stage_times, inputs.pp_gpus,
                      inputs.inflight, inputs.static, inputs.acts)
    assert isinstance(plan, Plan)
    return plan


def evaluate(ctx: SearchContext, cfg: ParallelConfig, *, require_fit: bool = True,
             cutoff_s: float = float("inf")) -> Evaluation | None:
    """The plan for `cfg`, or None when no cutting fits in memory (and `require_fit`).

    Raises `Dominated` when a lower bound on its step time reaches `cutoff_s` (the search has
    enough better plans): m times the bottleneck stage before the DP's tie-break, then the bounds
    of the cutting that would be simulated (space.py [Note: an exact top k]).
    """
    profile, cluster = ctx.profile, ctx.cluster
    n = profile.num_blocks
    num_stages = cfg.num_stages
    if num_stages > n:
        return None
    inputs = _inputs(ctx, cfg)
    pp_gpus, stage_times = inputs.pp_gpus, inputs.stage_times
    static, acts, inflight = inputs.static, inputs.acts, inputs.inflight
    sharing = cpu_sharing(profile, pp_gpus[0], cluster) is not None and num_stages > 1
    if sharing:
        # The bounds below assume the DP's cutting is the one simulated; under shared cores a local
        # search may find a faster one (climb.py [Note: cutting under shared cores]). Such clusters
        # are a machine's few ranks: simulate every configuration.
        cutoff_s = float("inf")
    capacity = _stage_capacity(ctx, cfg, pp_gpus, static, acts, inflight)
    # Configurations often pose the same cutting problem (both rank orders when the pipeline's
    # links are alike, e.g. tp = a whole node), or the same memory problem with other times; the
    # answers are reused by value (`CutCache`), which gives bit-identical cuts.
    mem_key = (static.tobytes(), acts.tobytes(), inflight.tobytes(), capacity.tobytes())
    if mem_key in ctx.infeasible and require_fit:
        return None  # no cutting fits this memory problem, whatever the times
    key = (inputs.total.tobytes(), inputs.link_s.tobytes(), *mem_key)
    cache = ctx.cut_cache.get(key)
    if cache is None:
        cache = ctx.cut_cache[key] = CutCache(inputs.problem(ctx, capacity))
    # The tie-break pass (partition.py [Note: DP tie-break]) only matters for plans that get
    # simulated; feasibility and the bound need just the bottleneck.
    cuts = cache.unrefined()
    if cuts is None:
        ctx.infeasible.add(mem_key)
        if require_fit:
            return None
        # Every dimension pinned: report the plan even though it does not fit, cut for time alone.
        problem = inputs.problem(ctx, np.full(num_stages, np.inf))
        solver = DPSolver(problem)
        cuts = solver.solve(refine=False)
        if cuts is None:
            return None
        cache = None
    low = bottleneck_bound(cfg, cuts, inputs.link_s) if cutoff_s < float("inf") else 0.0
    if low >= cutoff_s:
        if cache is not None:
            cache.release()
        raise Dominated(low)
    # Same bottleneck (first pass reused), ties broken as [Note: DP tie-break] says.
    cuts = cache.refined() if cache is not None else solver.solve()
    if _tie_within_rank(profile, cfg, cuts.boundaries):
        # FSDP cannot run it: the runtime refuses, so the ladder goes on.
        ctx.refusal = ("FSDP would shard a tied parameter in two virtual stages of one pipeline rank (the runtime "
                       "refuses it)")
        return None
    # The bound of the cutting that is simulated: the unrefined cutting's was not a bound for it
    # (interleaving sums each rank's stages, and the fill terms differ), and pruned plans a pinned
    # search then found (issue 29).
    low = step_lower_bound(ctx, cfg, cuts, stage_times) if cutoff_s < float("inf") else 0.0
    if low >= cutoff_s:
        raise Dominated(low)
    if sharing:
        cut_problem = cache.problem if cache is not None else problem
        boundaries, _ = climb_boundaries(
            cut_problem, cuts.boundaries,
            lambda b: _simulated_plan(ctx, cfg, inputs, cut_problem, b).predicted.step_time_s)
        cuts = make_cuts(cut_problem, boundaries, optimal=False)
    plan = make_plan(ctx, cfg, cuts, stage_times, pp_gpus, inflight, static, acts, cutoff_s=cutoff_s)
    if isinstance(plan, Unsimulated):
        # Its step time is at least the cutoff, so the search would not keep it; it goes on down
        # the ladder exactly when a simulated plan that does not fit would have.
        if plan.fits or not require_fit:
            raise Dominated(plan.bound_s)
        return None
    return Evaluation(cfg, plan)


def _tie_within_rank(profile: ModelProfile, cfg: ParallelConfig, boundaries: Sequence[int]) -> bool:
    """Whether FSDP (zero >= 2) would have to shard one parameter in two virtual stages of a
    pipeline rank: a tied block and its owner in two stages that one rank runs (T5's decoder
    embedding and head under interleaving). FSDP manages a parameter in one unit, so the runtime
    refuses such a plan (runtime/parallel/fsdp.py `_check_unshared`)."""
    if cfg.zero < 2 or cfg.virtual_stages == 1:
        return False
    groups: dict[int, set[int]] = {}  # owner block -> stages of it and of every block tied to it
    for i, block in enumerate(profile.blocks):
        if block.tied_to_block is not None and block.tied_params:
            for b in (i, block.tied_to_block):
                groups.setdefault(block.tied_to_block, set()).add(bisect.bisect_right(boundaries, b) - 1)
    for stages in groups.values():
        ranks = [s % cfg.pp for s in stages]
        if len(set(ranks)) < len(ranks):
            return True
    return False


def evaluate_cuts(ctx: SearchContext, cfg: ParallelConfig, boundaries: Sequence[int]) -> Plan:
    """The plan for `cfg` with the stage boundaries given (not searched), scored by the same simulation:
    how baselines such as parameter-balanced or equal-layer cuts would do. Memory is reported, not enforced."""
    inputs = _inputs(ctx, cfg)
    return _simulated_plan(ctx, cfg, inputs, inputs.problem(ctx, np.full(cfg.num_stages, np.inf)), boundaries)


def min_memory_bytes(ctx: SearchContext, cfg: ParallelConfig, *, iterations: int = 24) -> float | None:
    """About the least memory per GPU any cutting of `cfg` needs, under the cutting DP's model: the
    smallest GPU memory for which the DP finds a cutting that fits (bisection on the stage
    capacities, which scale with the GPU's memory less the allowance and the reserve; `explain`
    only, never in the search). None when no cutting into `cfg.num_stages` stages exists."""
    if cfg.num_stages > ctx.profile.num_blocks:
        return None
    inputs = _inputs(ctx, cfg)
    capacity = _stage_capacity(ctx, cfg, inputs.pp_gpus, inputs.static, inputs.acts, inputs.inflight)
    gpu = min(inputs.pp_gpus, key=lambda g: g.mem_bytes)
    usable = gpu.mem_bytes - allowance_bytes(gpu) - ctx.reserve(cfg)
    # Each stage's share of its GPU (1 without interleaving, `_stage_capacity`).
    shares = capacity / usable if usable > 0 else np.full(len(capacity), 1.0 / cfg.virtual_stages)
    usable = max(usable, 2.0**30)  # the bisection's unit where the reserve alone overflows the GPU

    def fits(scale: float) -> bool:
        problem = inputs.problem(ctx, shares * usable * scale)
        return DPSolver(problem).solve(refine=False) is not None

    low, high = 0.0, 1.0
    while not fits(high):
        low, high = high, high * 2
        if high > 2**20:
            return None
    for _ in range(iterations):
        middle = (low + high) / 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return float(gpu.mem_bytes + usable * (high - 1.0))
