"""Score one parallel configuration: cut the blocks into stages, simulate the schedule, count memory.

This is where the parts meet (DESIGN.md, "The search"): block times and bytes from `cost/`, stage
cutting from `search/partition.py`, the schedule from `schedule/` walked by its simulator, and the
result written down as a `Plan`.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoplan.cluster import Cluster, group_layout
from autoplan.cost.calibration import Calibrations
from autoplan.cost.comm import dp_reduction_exposed_s, fsdp_groups, fsdp_unit_times_s, prefetch_exposed_s
from autoplan.cost.config import ParallelConfig
from autoplan.cost.memory import (
    BYTES_PER_PARAM,
    MIN_BYTES_PER_PARAM,
    allowance_bytes,
    block_act_bytes,
    block_static_bytes,
    expert_params,
    expert_shard_surplus,
    fsdp_transient_bytes,
    gathered_bytes_per_param,
    head_backward_bytes,
    held_params,
    param_counts,
    rank_memory,
    stage_is_one_unit,
)
from autoplan.cost.sharing import simulate_shared_cores
from autoplan.cost.time import (
    BlockTimes,
    block_times,
    cpu_sharing,
    cut_transfer_time_s,
    cut_transfer_times_s,
    expert_exchange_times_s,
    kv_exchange_times_s,
    optimizer_time_s,
    tied_sync_times_s,
)
from autoplan.graph.blocks import ModelProfile
from autoplan.plan import Job, MemoryBreakdown, Plan, Predicted, StagePlan
from autoplan.schedule import ActionKind, SimResult, make_schedule, simulate
from autoplan.search.partition import CutProblem, Cuts, DPSolver, climb_boundaries, make_cuts

__all__ = ["Dominated", "Evaluation", "SearchContext", "evaluate", "evaluate_cuts", "interleaved_held", "min_gpus_needed",
           "min_memory_bytes", "schedule_inflight"]


@functools.lru_cache(maxsize=4096)
def schedule_inflight(name: str, pp: int, num_microbatches: int, virtual_stages: int) -> tuple[int, ...]:
    """Peak micro-batches in flight per virtual stage, from the schedule's structure (unit times).

    GPipe holds all m (Huang et al. 2019); 1F1B holds p - s on stage s (Narayanan et al. 2021, Sec.
    2.2.1); ZB-H1 holds p on every stage until its W (Qi et al. 2024, Sec. 3.1); all capped at m.
    tests/test_search.py checks these closed forms against the simulator. Interleaving is simulated.
    """
    m = num_microbatches
    if name == "gpipe":
        return (m,) * pp
    if name == "1f1b":
        return tuple(min(pp - s, m) for s in range(pp))
    if name == "zb-h1":
        return (min(pp, m),) * pp
    if name == "interleaved-1f1b":
        return _interleaved_inflight(pp, m, virtual_stages)
    schedule = make_schedule(name, pp, num_microbatches, virtual_stages)
    return simulate(schedule, lambda a: 1.0).peak_inflight


@functools.lru_cache(maxsize=64)
def interleaved_held(pp: int, m: int, v: int) -> tuple[np.ndarray, ...]:
    """Per pipeline rank of interleaved 1F1B: the micro-batches each of its v chunks holds right
    after each of its forwards (the moments its activations grow), one row per distinct moment,
    columns chunk 0 .. v - 1; from the rank's action order as `_interleaved_inflight` scans it.
    A rank's activations peak at the largest weighted row sum, which is less than the sum of its
    chunks' own peaks: they do not peak together (chunk 0 peaks at the end of the warm-up, the last
    chunk later). At the end of rank r's warm-up it holds (p - r - 1) * 2 + (v - 1) * p + 1
    chunk-micro-batches, Megatron-LM's count (Narayanan et al. 2021, Sec. 2.2.2: the first stage
    holds p (1 + (p - 1) / (p v)) micro-batches' worth of its layers)."""
    total = m * v
    k = np.arange(total)
    fwd_chunk = (k % (pp * v)) // pp
    fwd_count = np.zeros((v, total + 1), dtype=np.int64)
    bwd_count = np.zeros((v, total + 1), dtype=np.int64)
    np.cumsum(fwd_chunk[None, :] == np.arange(v)[:, None], axis=1, out=fwd_count[:, 1:])
    np.cumsum((v - 1 - fwd_chunk)[None, :] == np.arange(v)[:, None], axis=1, out=bwd_count[:, 1:])
    out = []
    for r in range(pp):
        warmup = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        held = fwd_count[:, k + 1] - bwd_count[:, np.maximum(k - warmup, 0)]  # (v, moments)
        out.append(np.unique(held.T, axis=0))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _interleaved_at_peak(pp: int, m: int, v: int) -> tuple[int, ...]:
    """Per virtual stage of interleaved 1F1B: what it holds at the moment its rank holds the most
    chunk-micro-batches (`interleaved_held`; ties: the most on the earliest chunk, which carries the
    embedding). The cutting DP checks stages one at a time with these; the plan's memory is then
    the exact peak over the moments (`_memories`)."""
    out = [0] * (pp * v)
    for r, rows in enumerate(interleaved_held(pp, m, v)):
        row = max(rows.tolist(), key=lambda h: (sum(h), h))
        for c in range(v):
            out[c * pp + r] = int(row[c])
    return tuple(out)


def _interleaved_inflight(pp: int, m: int, v: int) -> tuple[int, ...]:
    """Peak in flight per virtual stage of interleaved 1F1B, by a prefix scan of each rank's action
    order (a rank's own order fixes when its forwards and backwards happen relative to each other,
    so no timing is needed). The order is Megatron-LM's, as schedule/actions.py generates it:
    (p - r - 1) * 2 + (v - 1) * p warm-up forwards, then one forward and one backward at a time,
    micro-batches in groups of p through the chunks (backwards through them in reverse)."""
    total = m * v
    k = np.arange(total)
    fwd_chunk = (k % (pp * v)) // pp  # the k-th forward's chunk; the k-th backward's is v - 1 - it
    fwd_count = np.zeros((v, total + 1), dtype=np.int64)  # [c, i]: forwards of chunk c among the first i
    bwd_count = np.zeros((v, total + 1), dtype=np.int64)
    np.cumsum(fwd_chunk[None, :] == np.arange(v)[:, None], axis=1, out=fwd_count[:, 1:])
    np.cumsum((v - 1 - fwd_chunk)[None, :] == np.arange(v)[:, None], axis=1, out=bwd_count[:, 1:])
    peaks = [0] * (pp * v)
    for r in range(pp):
        warmup = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        # Right after forward i (the only moments a chunk's count grows), the backwards done are
        # the first max(i - warmup, 0): in the steady phase forward warmup + j precedes backward j.
        held = fwd_count[fwd_chunk, k + 1] - bwd_count[fwd_chunk, np.maximum(k - warmup, 0)]
        peak = np.zeros(v, dtype=np.int64)
        np.maximum.at(peak, fwd_chunk, held)
        for c in range(v):
            peaks[c * pp + r] = int(peak[c])
    return tuple(peaks)


@dataclass(frozen=True)
class Evaluation:
    config: ParallelConfig
    plan: Plan

    @property
    def step_time_s(self) -> float:
        return self.plan.predicted.step_time_s


class SearchContext:
    """What evaluate() needs of one (profile, cluster, job), computed once per search."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, job: Job, model_spec: str,
                 calibrations: Calibrations | None = None):
        self.profile = profile
        self.calibrations = calibrations or Calibrations()
        # Collectives run at the bandwidth the network achieves (calibration `network_efficiency`);
        # the plan records the cluster as given.
        self.cluster = self.calibrations.effective_cluster(cluster)
        self.job = job
        self.model_spec = model_spec
        self.gpu_types = cluster.gpu_types
        self.cluster_dict = cluster.to_dict()
        self.legal = np.array([c.legal for c in profile.cuts], dtype=bool)
        # [Note: final norm with the head] A final norm stays on the head's stage: Megatron-LM builds
        # it there (TransformerBlock's final layernorm on the post-process stage) and torchtitan's
        # pipeline splits keep `norm` with `output`; a cut between them saves no time worth having
        # (a norm is a few microseconds) and makes the plan inexpressible in both (report/export).
        kinds = [b.kind for b in profile.blocks]
        if len(kinds) >= 3 and kinds[-1] == "head" and kinds[-2] == "norm" and len(self.legal):
            self.legal[-1] = False
        # Model FLOPs per sequence (forward + backward, no recompute), for MFU.
        self.model_flops_per_seq = profile.flops / profile.batch_size
        self._cache: dict[tuple, object] = {}
        # Per boundary bytes (the cuts' `num_bytes` sums tensors on every access) and largest output.
        self.cut_num_bytes = [c.num_bytes for c in profile.cuts]
        self.largest_output_bytes = max(b.output_bytes for b in profile.blocks)
        self.cut_cache: dict[tuple, _CutCache] = {}
        self.infeasible: set[tuple] = set()
        self.simulations: dict[tuple, SimResult] = {}
        # (tp, micro-batch size, boundary, src rank, dst rank) -> P2P seconds (`cut_transfer_time_s`
        # depends on the configuration through tp and the micro-batch size only).
        self.transfers: dict[tuple, float] = {}
        self._pass_arrays: dict[int, tuple] = {}  # id(BlockTimes) -> sums (the object kept alive)
        self.refusal: str | None = None
        """Why the last evaluate() that returned None did so when the runtime refuses the plan (not
        memory): the search reports it (search/rejections.py)."""

    def calibration(self, gpu):
        return self.cached(("calibration", gpu.name), lambda: self.calibrations.for_gpu(gpu))

    def cached(self, key: tuple, make):
        """Per-search memo: ladder rungs and base configurations share most inputs."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def block_times(self, gpu, cfg: ParallelConfig) -> BlockTimes:
        spread = cfg.ep > 1 or cfg.cp > 1  # their groups' links depend on the rank layout
        key = ("times", gpu.name, cfg.tp, cfg.micro_batch_size, cfg.recompute, cfg.sequence_parallel, cfg.ep, cfg.cp,
               cfg.rank_order if spread else None, cfg.pp if spread else None)
        return self.cached(key, lambda: block_times(self.profile, gpu, self.cluster, cfg, self.job.dtype,
                                                    self.calibration(gpu)))

    def static_bytes(self, cfg: ParallelConfig) -> np.ndarray:
        key = ("static", cfg.tp, cfg.dp, cfg.zero, cfg.dp_replicate, cfg.pp == 1, cfg.num_stages == 1, cfg.ep)
        return self.cached(key, lambda: block_static_bytes(self.profile, cfg, self.job.dtype))

    def act_bytes(self, cfg: ParallelConfig) -> np.ndarray:
        key = ("acts", cfg.tp, cfg.micro_batch_size, cfg.recompute, cfg.sequence_parallel, cfg.cp)
        # A CPU rank runs F.rms_norm's composite form, which saves more (cost/memory.py [Note: fused
        # RMSNorm]); a cluster with any CPU rank is counted as one, the larger of the two.
        cpu = any(g.name == "cpu" for g in self.gpu_types)
        return self.cached(key, lambda: block_act_bytes(self.profile, cfg, cpu))

    def block_passes(self, t: BlockTimes) -> tuple[np.ndarray, np.ndarray]:
        """Per block: forward and backward seconds, TP communication included (fwd_s + tp_fwd_s,
        bwd_s + tp_bwd_s; made once per `BlockTimes`)."""
        sums = self._pass_arrays.get(id(t))
        if sums is None:
            sums = self._pass_arrays[id(t)] = (t.fwd_s + t.tp_fwd_s, t.bwd_s + t.tp_bwd_s, t)
        return sums[0], sums[1]

    def pass_times(self, stage_times: list[BlockTimes], ranges: list[tuple[int, int]]) -> tuple[list[float], list[float]]:
        """Per stage: forward and backward seconds, TP communication included (the sums of
        `block_passes` over its blocks)."""
        fwd, bwd = [], []
        for t, (a, b) in zip(stage_times, ranges, strict=True):
            f, g = self.block_passes(t)
            fwd.append(float(f[a:b].sum()))
            bwd.append(float(g[a:b].sum()))
        return fwd, bwd

    def fsdp_unit_times(self, cfg: ParallelConfig, pp_index: int) -> tuple[np.ndarray, np.ndarray]:
        """Per block (one FSDP unit each): all-gather and gradient-reduction seconds over the FSDP
        groups of pipeline rank `pp_index` (cost/comm.py [Note: FSDP communication])."""
        groups_key = ("fsdp-groups", cfg.tp, cfg.pp, cfg.dp, cfg.dp_replicate, cfg.rank_order, pp_index)

        def groups():
            first = cfg.rank(pp_index, 0, 0)
            shard, replicate = fsdp_groups(first, cfg.rank(pp_index, 1, 0) - first if cfg.dp > 1 else 1, cfg.dp,
                                           cfg.dp_replicate)
            # A collective's time depends on its ranks only through their layout over the nodes.
            return shard, replicate, (group_layout(self.cluster, shard), group_layout(self.cluster, replicate))

        shard, replicate, layouts = self.cached(groups_key, groups)
        gather_bytes = gathered_bytes_per_param(self.job.dtype)
        if cfg.ep == 1:
            return self.cached(("fsdp", cfg.tp, layouts), lambda: fsdp_unit_times_s(
                self.cluster, shard, replicate, self.params(cfg), gather_bytes))

        def with_experts() -> tuple[np.ndarray, np.ndarray]:
            # A block's experts are a unit of their own, sharded over the dp / ep replicas holding
            # the same experts (runtime/fsdp.py): every ep-th rank of the shard group.
            local_experts = np.asarray(expert_params(self.profile), dtype=float) / cfg.ep
            gather, reduce = fsdp_unit_times_s(self.cluster, shard, replicate, self.params(cfg) - local_experts,
                                               gather_bytes)
            expert_gather, expert_reduce = fsdp_unit_times_s(self.cluster, shard[::cfg.ep], range(0), local_experts,
                                                             gather_bytes)
            return gather + expert_gather, reduce + expert_reduce

        return self.cached(("fsdp", cfg.tp, cfg.ep, layouts), with_experts)

    def params(self, cfg: ParallelConfig) -> np.ndarray:
        return self.cached(("params", cfg.tp, cfg.ep), lambda: param_counts(self.profile, cfg))

    def reserve(self, cfg: ParallelConfig) -> float:
        """Bytes reserved per GPU for buffers (receive buffers, backward transients) before cutting:
        two receive buffers of the largest boundary per virtual stage and two of the largest block
        output (`rank_memory` counts the same at the actual cuts), so the reserve never under-counts
        the GPU it lands on; then the larger of the largest block's full activations (full
        recompute) and the head's backward transients (`head_backward_bytes`); then FSDP's units in
        flight (`fsdp_transient_bytes`)."""
        key = ("reserve", cfg.tp, cfg.micro_batch_size, cfg.recompute, cfg.sequence_parallel, cfg.virtual_stages,
               cfg.zero, cfg.pp == 1, cfg.cp, cfg.ep)

        def make() -> float:
            f = cfg.batch_share(self.profile.batch_size)
            cut_bytes = np.array([0.0] + [nb * f for nb in self.cut_num_bytes] + [0.0])
            reserve = 2 * cfg.virtual_stages * cut_bytes.max() + 2 * (self.largest_output_bytes * f)
            recompute = float(np.max(self.act_bytes(_no_recompute(cfg)))) if cfg.recompute == "full" else 0.0
            head = head_backward_bytes(self.profile, self.act_bytes(cfg), range(self.profile.num_blocks))
            # FSDP's few-units terms, for the largest units anywhere ([Note: FSDP gathered bytes]).
            fsdp = fsdp_transient_bytes(self.job.dtype, cfg.zero, cfg.pp, self.params(cfg),
                                        stage_is_one_unit(self.profile))
            return reserve + max(recompute, head) + fsdp

        return self.cached(key, make)

    def link_times(self, cfg: ParallelConfig) -> np.ndarray:
        src, dst = cfg.rank(0, 0), cfg.rank(1 % cfg.pp, 0)
        key = ("link", cfg.tp, cfg.micro_batch_size, cfg.cp, src, dst)

        def make() -> np.ndarray:
            out = np.zeros(self.profile.num_blocks + 1)
            if cfg.pp > 1:
                out[1:-1] = cut_transfer_times_s(self.profile, self.cluster, cfg, src, dst)
            return out

        return self.cached(key, make)


def _stage_gpus(cluster: Cluster, cfg: ParallelConfig) -> list:
    """GPU type of each pipeline rank (the slowest type among its tp x dp ranks)."""
    if cluster.is_homogeneous:
        return [cluster.gpu] * cfg.pp
    gpus = []
    for p in range(cfg.pp):
        types = {cluster.gpu_of_rank(cfg.rank(p, d, t)).name: cluster.gpu_of_rank(cfg.rank(p, d, t))
                 for d in range(cfg.dp) for t in range(cfg.tp)}
        gpus.append(min(types.values(), key=lambda g: (g.peak_flops.get("bf16", 0.0), g.mem_bytes)))
    return gpus


class _CutCache:
    """The unrefined and refined cuttings of one problem, each solved at most once. The solver (and
    its masked tables, up to tens of MB) is dropped once the refined cutting is known; a later
    refined request without it (rare: another configuration with the same problem) solves anew."""

    def __init__(self, problem: CutProblem) -> None:
        self.problem = problem
        self._solver: DPSolver | None = DPSolver(problem)
        self._unrefined: Cuts | None = None
        self._refined: Cuts | None = None
        self._solved = False

    def unrefined(self) -> Cuts | None:
        if not self._solved:
            assert self._solver is not None
            self._unrefined = self._solver.solve(refine=False)
            self._solved = True
            if self._unrefined is None:
                self._solver = None
        return self._unrefined

    def refined(self) -> Cuts | None:
        if self._refined is None:
            solver = self._solver if self._solver is not None else DPSolver(self.problem)
            self._refined = solver.solve()
            self._solver = None
        return self._refined

    def release(self) -> None:
        """Drop the solver's tables (kept only while a refined request may follow soon)."""
        self._solver = None


class Dominated(Exception):
    """The configuration provably cannot beat `cutoff_s` (raised before simulating it); `args[0]`
    is the lower bound on its step time that showed it."""


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
    pp_gpus = _stage_gpus(ctx.cluster, cfg)
    times_by_type = {gpu.name: ctx.block_times(gpu, cfg) for gpu in pp_gpus}
    stage_times = [times_by_type[pp_gpus[k % cfg.pp].name] for k in range(cfg.num_stages)]
    total = stage_times[0].total_s if len(times_by_type) == 1 else np.stack([t.total_s for t in stage_times])
    if cfg.schedule == "interleaved-1f1b" and cfg.virtual_stages > 1:
        inflight = np.array(_interleaved_at_peak(cfg.pp, cfg.num_microbatches, cfg.virtual_stages), dtype=float)
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
    is then checked per GPU (`_memories`)."""
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
    plan = _make_plan(ctx, cfg, make_cuts(problem, boundaries, optimal=False), inputs.stage_times, inputs.pp_gpus,
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
        # search may find a faster one ([Note: cutting under shared cores]). Such clusters are a
        # machine's few ranks: simulate every configuration.
        cutoff_s = float("inf")
    capacity = _stage_capacity(ctx, cfg, pp_gpus, static, acts, inflight)
    # Configurations often pose the same cutting problem (both rank orders when the pipeline's
    # links are alike, e.g. tp = a whole node), or the same memory problem with other times; the
    # answers are reused by value (`_CutCache`), which gives bit-identical cuts.
    mem_key = (static.tobytes(), acts.tobytes(), inflight.tobytes(), capacity.tobytes())
    if mem_key in ctx.infeasible and require_fit:
        return None  # no cutting fits this memory problem, whatever the times
    key = (inputs.total.tobytes(), inputs.link_s.tobytes(), *mem_key)
    cache = ctx.cut_cache.get(key)
    if cache is None:
        cache = ctx.cut_cache[key] = _CutCache(inputs.problem(ctx, capacity))
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
    low = _bottleneck_bound(cfg, cuts, inputs.link_s) if cutoff_s < float("inf") else 0.0
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
    low = _step_lower_bound(ctx, cfg, cuts, stage_times) if cutoff_s < float("inf") else 0.0
    if low >= cutoff_s:
        raise Dominated(low)
    if sharing:
        cut_problem = cache.problem if cache is not None else problem
        boundaries, _ = climb_boundaries(
            cut_problem, cuts.boundaries,
            lambda b: _simulated_plan(ctx, cfg, inputs, cut_problem, b).predicted.step_time_s)
        cuts = make_cuts(cut_problem, boundaries, optimal=False)
    plan = _make_plan(ctx, cfg, cuts, stage_times, pp_gpus, inflight, static, acts, cutoff_s=cutoff_s)
    if isinstance(plan, _Unsimulated):
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
    refuses such a plan (runtime/fsdp.py `_check_unshared`)."""
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


@dataclass(frozen=True)
class _Unsimulated:
    """`_make_plan` stopped before simulating: the step time provably reaches the cutoff."""

    fits: bool
    bound_s: float
    """The lower bound on the step time that reached it."""


def _bottleneck_bound(cfg: ParallelConfig, cuts: Cuts, link_s: np.ndarray) -> float:
    """A lower bound on the step time of every cutting with this bottleneck, the refined one
    included ([Note: DP tie-break]: it keeps the bottleneck, not the other stages).

    Some stage of any such cutting takes the bottleneck B in the DP's model, its blocks plus its two
    boundaries' P2P time (partition.py `stage_stats`), so its compute is at least B - 2 max(P2P),
    and its rank runs that compute for each of the m micro-batches one after another. The margin
    covers the prefix sums' rounding."""
    link = float(np.max(link_s)) if len(link_s) else 0.0
    return cfg.num_microbatches * (cuts.bottleneck_s - 2.0 * link) * (1 - 1e-9)


def _step_lower_bound(ctx: SearchContext, cfg: ParallelConfig, cuts: Cuts, stage_times: list[BlockTimes]) -> float:
    """A lower bound on the step time of a cut configuration, without simulating it.

    Pipeline rank r cannot start before micro-batch 0 has passed the forwards of the stages before
    it, is then busy for all its own work, and (when its last action is a full backward: GPipe,
    1F1B, interleaved) the earlier stages' backwards of the last micro-batch follow it. Communication
    and the tail only add. For equal stages under 1F1B this is exactly (m + p - 1)(F + B).
    """
    ranges = cuts.stage_ranges()
    fwd, bwd = ctx.pass_times(stage_times, ranges)
    m = cfg.num_microbatches
    trailing = cfg.schedule != "zb-h1"
    bound = 0.0
    for r in range(cfg.pp):
        busy = m * sum(fwd[k] + bwd[k] for k in range(r, cfg.num_stages, cfg.pp))
        before = sum(fwd[:r])
        after = sum(bwd[:r]) if trailing else 0.0
        bound = max(bound, before + busy + after)
    return bound


def _no_recompute(cfg: ParallelConfig) -> ParallelConfig:
    return dataclasses.replace(cfg, recompute="none")


def _make_plan(ctx: SearchContext, cfg: ParallelConfig, cuts: Cuts, stage_times: list[BlockTimes], pp_gpus: list,
               inflight: np.ndarray, static: np.ndarray, acts: np.ndarray,
               cutoff_s: float = float("inf")) -> Plan | _Unsimulated:
    profile, cluster, job = ctx.profile, ctx.cluster, ctx.job
    ranges = cuts.stage_ranges()
    num_stages = cfg.num_stages
    fwd_s, bwd_s = ctx.pass_times(stage_times, ranges)
    split = cfg.schedule == "zb-h1"
    fsdp = _fsdp_exposed(ctx, cfg, ranges, stage_times)

    durations = {ActionKind.F: fwd_s, ActionKind.B: bwd_s}
    if fsdp is not None:
        # All-gathers (and with pp = 1 the reduce-scatters) that FSDP overlaps with each pass:
        # what they leave exposed lengthens the action ([Note: FSDP communication] in cost/comm.py).
        durations = {ActionKind.F: [f + e for f, e in zip(fwd_s, fsdp.fwd_s, strict=True)],
                     ActionKind.B: [b + e for b, e in zip(bwd_s, fsdp.bwd_s, strict=True)]}
    if split:
        # Zero-bubble splits backward into input-gradient (B) and weight-gradient (W) halves of
        # about equal cost (Qi et al. 2024, Sec. 2: T_B ~ T_W); TP communication stays with B.
        compute = [float(t.bwd_s[a:b].sum()) for t, (a, b) in zip(stage_times, ranges, strict=True)]
        comm = [float(t.tp_bwd_s[a:b].sum()) for t, (a, b) in zip(stage_times, ranges, strict=True)]
        durations[ActionKind.B] = [c / 2 + t for c, t in zip(compute, comm, strict=True)]
        durations[ActionKind.W] = [c / 2 for c in compute]

    def compute_time(action) -> float:
        return durations[action.kind][action.stage]

    comm_cache = ctx.transfers  # shared by configurations: the same cuts and ranks recur
    pp_ranks = [cfg.rank(p, 0) for p in range(cfg.pp)]

    def comm_time(src_stage: int, dst_stage: int, kind) -> float:
        boundary = ranges[max(src_stage, dst_stage)][0]  # first block of the later stage
        src, dst = pp_ranks[src_stage % cfg.pp], pp_ranks[dst_stage % cfg.pp]
        key = (cfg.tp, cfg.micro_batch_size, cfg.cp, boundary, src, dst)
        if key not in comm_cache:
            comm_cache[key] = cut_transfer_time_s(profile, cluster, cfg, boundary - 1, src, dst)
        return comm_cache[key]

    params = ctx.params(cfg)
    _, grad_b, _ = BYTES_PER_PARAM(job.dtype)
    tails = []
    dp_exposed = []
    optim_s = []
    tied_s = tied_sync_times_s(profile, cluster, cfg, ranges, grad_b)
    for p in range(cfg.pp):
        mine = [k for k in range(num_stages) if k % cfg.pp == p]
        # A tied table whose owner sits on the same GPU is one parameter (cost/memory.py, held_params).
        rank_params = held_params(profile, cfg, [ranges[k] for k in mine], params)
        if fsdp is not None:
            exposed = fsdp.tail_s[p]
        else:
            # Bucketed reduction behind the last backward pass on this rank ([Note: DP buckets] in
            # cost/comm.py; PyTorch DDP, Li et al. 2020, Sec. 3.2.3): only what runs past it is exposed.
            dp_ranks = [cfg.rank(p, d, 0) for d in range(cfg.dp)]
            cal = ctx.calibration(pp_gpus[p])
            exposed = dp_reduction_exposed_s(cluster, dp_ranks, rank_params * grad_b, bwd_s[mine[0]],
                                             slowdown=cal.overlap_slowdown, overlap=cal.overlap_grad_reduce)
        shards = cfg.dp_shard if cfg.zero >= 2 else cfg.dp if cfg.zero == 1 else 1
        opt = optimizer_time_s(pp_gpus[p], (rank_params + expert_shard_surplus(profile, cfg, [ranges[k] for k in mine]))
                               / shards)
        dp_exposed.append(exposed)
        optim_s.append(opt)
        tails.append(tied_s[p] + exposed + opt)  # the order the runtime does them in (runtime/partitioned.py, step)

    delays_f = [comm_time(s - 1, s, ActionKind.F) if cfg.pp > 1 else 0.0 for s in range(1, num_stages)]
    delays_b = [comm_time(s + 1, s, ActionKind.B) if cfg.pp > 1 else 0.0 for s in range(num_stages - 1)]
    sim_comm = comm_time if cfg.pp > 1 else None
    if cfg.pp > 1 and ctx.calibration(pp_gpus[0]).p2p_blocking:
        # [Note: blocking P2P] A stack whose transfers block both ends (calibration `p2p_blocking`):
        # each action also spends its receive and its send, and nothing travels while it computes.
        blocked = dict(durations)
        blocked[ActionKind.F] = [t + (delays_f[k - 1] if k > 0 else 0.0) + (delays_f[k] if k < num_stages - 1 else 0.0)
                                 for k, t in enumerate(durations[ActionKind.F])]
        blocked[ActionKind.B] = [t + (delays_b[k] if k < num_stages - 1 else 0.0) + (delays_b[k - 1] if k > 0 else 0.0)
                                 for k, t in enumerate(durations[ActionKind.B])]
        durations = blocked
        delays_f, delays_b = [0.0] * len(delays_f), [0.0] * len(delays_b)
        sim_comm = None
    if cutoff_s < float("inf"):
        bound = simulated_step_lower_bound(cfg, durations, delays_f, delays_b, tails)
        # The margin covers rounding: the bound adds the same terms as the simulator in another order.
        if bound > cutoff_s * (1 + 1e-9):
            memories = _memories(ctx, cfg, ranges, pp_gpus,
                                 schedule_inflight(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.virtual_stages),
                                 static, acts)
            return _Unsimulated(all(m.total_bytes <= pp_gpus[p].mem_bytes for p, m in enumerate(memories)), bound)

    sharing = cpu_sharing(profile, pp_gpus[0], cluster)
    # The simulation is a function of the schedule, the stage durations, the transfer delays and
    # the tails alone, which configurations often share (both rank orders when their links are
    # alike): reuse it by value.
    sim_key = (cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.virtual_stages,
               *(tuple(v) for v in durations.values()), tuple(delays_f), tuple(delays_b), tuple(tails), sharing)
    sim = ctx.simulations.get(sim_key)
    if sim is None:
        schedule = make_schedule(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.virtual_stages)
        if sharing is None:
            sim = simulate(schedule, durations, sim_comm, tails)
        else:
            # Each simulated rank stands for its dp x tp peers, which compute the same actions at the
            # same moments: they share the cores too.
            threads, cores = sharing
            sim = simulate_shared_cores(schedule, lambda a: durations[a.kind][a.stage], sim_comm, tails,
                                        threads * cfg.dp * cfg.tp, cores)
        ctx.simulations[sim_key] = sim
    step = sim.makespan_s

    memories = _memories(ctx, cfg, ranges, pp_gpus, sim.peak_inflight, static, acts)
    fits = all(m.total_bytes <= pp_gpus[p].mem_bytes for p, m in enumerate(memories))

    num_gpus = cfg.num_gpus
    tokens = job.global_batch * job.seq_len
    model_flops = ctx.model_flops_per_seq * job.global_batch
    hw_flops_per_gpu = sum(float(stage_times[k].hw_flops[ranges[k][0]:ranges[k][1]].sum())
                           for k in range(num_stages)) * cfg.num_microbatches / cfg.pp
    peak = float(np.mean([g.peak(job.dtype) for g in pp_gpus]))
    model_tflops = model_flops / num_gpus / step / 1e12
    hw_tflops = hw_flops_per_gpu / step / 1e12
    busy = float(np.mean(sim.busy_s))
    compute_total = float(np.mean([sum(fwd_s[k] + bwd_s[k] for k in range(num_stages) if k % cfg.pp == p)
                                   for p in range(cfg.pp)])) * cfg.num_microbatches
    tp_total = sum(float((stage_times[k].tp_fwd_s + stage_times[k].tp_bwd_s)[ranges[k][0]:ranges[k][1]].sum())
                   for k in range(num_stages)) * cfg.num_microbatches / cfg.pp
    ep_total = 0.0
    if cfg.ep > 1:  # the experts' all-to-alls, folded into the tp arrays by `block_times`
        exchange = expert_exchange_times_s(profile, ctx.cluster, cfg)
        passes = [1.0 + (2.0 if cfg.recompute == "full" else 1.0)] * num_stages
        ep_total = sum(float(exchange[a:b].sum()) * passes[k] for k, (a, b) in enumerate(ranges)) \
            * cfg.num_microbatches / cfg.pp
    cp_total = 0.0
    if cfg.cp > 1:  # the key/value all-gathers, folded into the tp arrays by `block_times`
        gather = kv_exchange_times_s(profile, ctx.cluster, cfg)
        passes = 1.0 + (2.0 if cfg.recompute == "full" else 1.0)
        cp_total = sum(float(gather[a:b].sum()) * passes for a, b in ranges) * cfg.num_microbatches / cfg.pp
    breakdown = {
        "compute_s": compute_total - tp_total,
        "tp_comm_s": tp_total - ep_total - cp_total,
        **({"ep_comm_s": ep_total} if cfg.ep > 1 else {}),
        **({"cp_comm_s": cp_total} if cfg.cp > 1 else {}),
        "bubble_s": max(0.0, step - busy - max(tails)),
        "tied_grad_sync_s": max(tied_s),
        "dp_comm_exposed_s": max(dp_exposed),
        "optimizer_s": max(optim_s),
    }
    if fsdp is not None:
        breakdown["fsdp_comm_exposed_s"] = max(
            cfg.num_microbatches * sum(fsdp.fwd_s[k] + fsdp.bwd_s[k] for k in range(num_stages) if k % cfg.pp == p)
            for p in range(cfg.pp))
    peak_mem = max(m.total_bytes for m in memories)
    capacity = min(g.mem_bytes for g in pp_gpus)
    bound = _bound(sim.bubble_fraction, fwd_s, bwd_s, breakdown, step, peak_mem / capacity, fits, cfg)
    predicted = Predicted(
        step_time_s=step,
        tokens_per_s=tokens / step,
        model_tflops_per_gpu=model_tflops,
        hardware_tflops_per_gpu=hw_tflops,
        mfu=model_tflops * 1e12 / peak,
        hfu=hw_tflops * 1e12 / peak,
        peak_memory_bytes=peak_mem,
        bubble_fraction=sim.bubble_fraction,
        bound=bound,
        breakdown=breakdown,
    )
    stages = tuple(
        StagePlan(
            index=k, pp_rank=k % cfg.pp, first_block=a, end_block=b,
            first_block_name=profile.blocks[a].name, last_block_name=profile.blocks[b - 1].name,
            fwd_time_s=fwd_s[k] + (fsdp.fwd_s[k] if fsdp else 0.0), bwd_time_s=bwd_s[k] + (fsdp.bwd_s[k] if fsdp else 0.0),
            num_params=int(round(held_params(profile, cfg, [(a, b)], params))),
            memory=memories[k % cfg.pp],
        )
        for k, (a, b) in enumerate(ranges)
    )
    return Plan(
        model=ctx.model_spec, model_fingerprint=profile.fingerprint, cluster=ctx.cluster_dict, job=job,
        tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, virtual_stages=cfg.virtual_stages, micro_batch_size=cfg.micro_batch_size,
        num_microbatches=cfg.num_microbatches, schedule=cfg.schedule, recompute=cfg.recompute, zero=cfg.zero, dp_replicate=cfg.dp_replicate,
        ep=cfg.ep, cp=cfg.cp, sequence_parallel=cfg.sequence_parallel, rank_order=cfg.rank_order, stages=stages,
        block_names=tuple(b.name for b in profile.blocks), fits=fits, predicted=predicted,
    )


@dataclass(frozen=True)
class _FsdpExposed:
    """FSDP communication left exposed ([Note: FSDP communication] in cost/comm.py)."""

    fwd_s: list[float]
    """Per stage, per micro-batch: added to its forward."""
    bwd_s: list[float]
    """Per stage, per micro-batch: added to its backward."""
    tail_s: list[float]
    """Per pipeline rank, once per step: zero 2's all-gather, and with pp > 1 the gradient
    reduce-scatters after the last backward."""


def _fsdp_exposed(ctx: SearchContext, cfg: ParallelConfig, ranges: list[tuple[int, int]],
                  stage_times: list[BlockTimes]) -> _FsdpExposed | None:
    """What FSDP (zero >= 2) adds to each pass and to each rank's tail; None for zero 0 / 1."""
    if cfg.zero < 2:
        return None
    fwd = [0.0] * cfg.num_stages
    bwd = [0.0] * cfg.num_stages
    tail = [0.0] * cfg.pp
    if cfg.dp <= 1:
        return _FsdpExposed(fwd, bwd, tail)
    per_microbatch_reduce = cfg.pp == 1
    pp_gpus = _stage_gpus(ctx.cluster, cfg)
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
    return _FsdpExposed(fwd, bwd, tail)


def _memories(ctx: SearchContext, cfg: ParallelConfig, ranges: list[tuple[int, int]], pp_gpus: list,
              peak_inflight: tuple[int, ...], static: np.ndarray, acts: np.ndarray) -> list[MemoryBreakdown]:
    """Peak memory of each pipeline rank."""
    memories: list[MemoryBreakdown] = []
    held = None
    if cfg.schedule == "interleaved-1f1b" and cfg.virtual_stages > 1:
        held = interleaved_held(cfg.pp, cfg.num_microbatches, cfg.virtual_stages)
    for p in range(cfg.pp):
        mine = [k for k in range(cfg.num_stages) if k % cfg.pp == p]
        inflight = [peak_inflight[k] for k in mine]
        # The rank's chunks do not peak together (`interleaved_held`); its rows agree with the
        # simulated per-chunk peaks or are not used.
        rows = held[p] if held is not None and list(held[p].max(axis=0)) == inflight else None
        memories.append(rank_memory(ctx.profile, cfg, pp_gpus[p], ctx.job.dtype, [ranges[k] for k in mine],
                                    inflight, static=static, acts=acts, params=ctx.params(cfg), held=rows))
    return memories


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
    if cfg.schedule != "zb-h1":
        for r in range(1, p):
            t = ends[r]
            for q in range(r - 1, -1, -1):
                t += delays_b[q] + bwd[q]
                if t > lower[q]:
                    lower[q] = t
    return max(e + tail for e, tail in zip(lower, tails, strict=True))


def _bound(bubble: float, fwd_s: list[float], bwd_s: list[float], breakdown: dict[str, float], step: float,
           mem_ratio: float, fits: bool, cfg: ParallelConfig) -> str:
    """One line on what limits the plan most."""
    if not fits:
        return f"memory: needs {mem_ratio:.0%} of the GPU's memory; does not fit"
    stage = [a + b for a, b in zip(fwd_s, bwd_s, strict=True)]
    dp_exposed = breakdown["dp_comm_exposed_s"] + breakdown.get("fsdp_comm_exposed_s", 0.0)
    dp_cause = (f"FSDP all-gathers and reduce-scatters not hidden ({dp_exposed / step:.0%} of the step)" if cfg.zero >= 2
                else f"DP gradient reduction not hidden ({dp_exposed / step:.0%} of the step)")
    imbalance = max(stage) / (sum(stage) / len(stage)) - 1 if stage and sum(stage) else 0.0
    causes = {
        f"pipeline bubble ({bubble:.0%} of the step; more micro-batches or interleaving shrink it)": bubble,
        f"slowest stage {imbalance:.0%} above the mean (blocks do not split evenly)": imbalance * (1 - bubble) * 0.5,
        dp_cause: dp_exposed / step,
        f"TP communication ({breakdown['tp_comm_s'] / step:.0%} of the step)": breakdown["tp_comm_s"] / step * 0.5,
    }
    cause, weight = max(causes.items(), key=lambda kv: kv[1])
    if mem_ratio > 0.9 and weight < 0.1:
        return f"memory: {mem_ratio:.0%} of the GPU's memory in use, little room for larger micro-batches"
    if weight < 0.05:
        return "compute: the GPUs are busy most of the step"
    return cause


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


def min_gpus_needed(profile: ModelProfile, dtype: str, gpu_mem_bytes: float, allowance: float) -> int:
    """A lower bound on GPUs: weights, gradients and optimizer states fully sharded (16 bytes per
    parameter, ZeRO-3 / FSDP; cost/memory.py [Note: bytes per parameter]) spread over every GPU,
    each tied parameter once, activations ignored."""
    per_param = MIN_BYTES_PER_PARAM(dtype)
    return max(1, math.ceil(profile.num_params * per_param / max(gpu_mem_bytes - allowance, 1.0)))
