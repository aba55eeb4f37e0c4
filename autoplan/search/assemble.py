"""The plan of one cutting: per-stage pass times, transfer delays and each rank's tail (tied
gradients, DP reduction, optimizer), the schedule simulated, memory counted, and the result written
down as a `Plan` with its breakdown and the one line on what bounds it.

Apart from search/evaluate.py, which chooses the cutting (the DP, the cutoffs, the refusals): this
module only scores a cutting it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoplan.cost.comm import dp_reduction_exposed_s
from autoplan.cost.config import ParallelConfig
from autoplan.cost.experts import expert_comm_times_s
from autoplan.cost.memory import (
    BYTES_PER_PARAM,
    expert_params,
    expert_shard_surplus,
    held_params,
    rank_memory,
)
from autoplan.cost.sharing import simulate_shared_cores
from autoplan.cost.time import (
    BlockTimes,
    cpu_sharing,
    cut_transfer_time_s,
    kv_exchange_times_s,
    optimizer_time_s,
    tied_sync_times_s,
)
from autoplan.plan import BreakdownTerm as Term
from autoplan.plan import MemoryBreakdown, Plan, Predicted, StagePlan
from autoplan.schedule import ActionKind, make_schedule, schedule_spec, simulate
from autoplan.search.bounds import simulated_step_lower_bound
from autoplan.search.context import SearchContext
from autoplan.search.fsdp_exposed import fsdp_exposed
from autoplan.search.inflight import rank_moments, schedule_inflight
from autoplan.search.stage_model import Cuts

__all__ = ["Unsimulated", "make_plan", "rank_memories"]


@dataclass(frozen=True)
class Unsimulated:
    """`make_plan` stopped before simulating: the step time provably reaches the cutoff."""

    fits: bool
    bound_s: float
    """The lower bound on the step time that reached it."""


def make_plan(ctx: SearchContext, cfg: ParallelConfig, cuts: Cuts, stage_times: list[BlockTimes], pp_gpus: list,
               inflight: np.ndarray, static: np.ndarray, acts: np.ndarray,
               cutoff_s: float = float("inf")) -> Plan | Unsimulated:
    profile, cluster, job = ctx.profile, ctx.cluster, ctx.job
    ranges = cuts.stage_ranges()
    num_stages = cfg.num_stages
    fwd_s, bwd_s = ctx.pass_times(stage_times, ranges)
    split = schedule_spec(cfg.schedule).split_backward
    fsdp = fsdp_exposed(ctx, cfg, ranges, stage_times)

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
            # With ep the experts' gradients are reduced over the ranks holding the same experts
            # (`ParallelConfig.expert_dp`: the expert-data-parallel group, Megatron-Core MoE README;
            # runtime/execution/partitioned.py `reduce_expert_grads`), the rest over dp; each stream becomes
            # ready over its share of the backward.
            experts = sum(float(np.sum(expert_params(profile)[a:b])) for a, b in (ranges[k] for k in mine)) \
                / (cfg.ep * cfg.expert_tp) if cfg.holds_expert_slices else 0.0
            last_bwd = bwd_s[mine[0]]
            dense_share = 1.0 - experts / rank_params if rank_params > 0 else 1.0
            exposed = dp_reduction_exposed_s(cluster, dp_ranks, (rank_params - experts) * grad_b, last_bwd * dense_share,
                                             slowdown=cal.overlap_slowdown, overlap=cal.overlap_grad_reduce)
            if experts > 0:
                exposed += dp_reduction_exposed_s(cluster, cfg.expert_dp_ranks(p), experts * grad_b,
                                                  last_bwd * (1.0 - dense_share), slowdown=cal.overlap_slowdown,
                                                  overlap=cal.overlap_grad_reduce)
        shards = cfg.dp_shard if cfg.zero >= 2 else cfg.dp if cfg.zero == 1 else 1
        opt = optimizer_time_s(pp_gpus[p], (rank_params + expert_shard_surplus(profile, cfg, [ranges[k] for k in mine]))
                               / shards, ctx.calibration(pp_gpus[p]).optimizer_bytes_per_param)
        dp_exposed.append(exposed)
        optim_s.append(opt)
        tails.append(tied_s[p] + exposed + opt)  # the order the runtime does them in (runtime/execution/partitioned.py, step)

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
            memories = rank_memories(ctx, cfg, ranges, pp_gpus,
                                 schedule_inflight(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.virtual_stages),
                                 static, acts)
            return Unsimulated(all(m.total_bytes <= pp_gpus[p].mem_bytes for p, m in enumerate(memories)), bound)

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

    memories = rank_memories(ctx, cfg, ranges, pp_gpus, sim.peak_inflight, static, acts)
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
    if cfg.holds_expert_slices:  # the experts' all-to-alls and tp collectives, folded into the tp arrays by `block_times`
        exchange = expert_comm_times_s(profile, ctx.cluster, cfg, ctx.calibration(pp_gpus[0]).expert_dispatch)
        passes = [1.0 + (2.0 if cfg.recompute == "full" else 1.0)] * num_stages
        ep_total = sum(float(exchange[a:b].sum()) * passes[k] for k, (a, b) in enumerate(ranges)) \
            * cfg.num_microbatches / cfg.pp
    cp_total = 0.0
    if cfg.cp > 1:  # the key/value all-gathers, folded into the tp arrays by `block_times`
        gather = kv_exchange_times_s(profile, ctx.cluster, cfg)
        passes = 1.0 + (2.0 if cfg.recompute == "full" else 1.0)
        cp_total = sum(float(gather[a:b].sum()) * passes for a, b in ranges) * cfg.num_microbatches / cfg.pp
    breakdown = {
        Term.COMPUTE: compute_total - tp_total,
        Term.TP_COMM: tp_total - ep_total - cp_total,
        **({Term.EP_COMM: ep_total} if cfg.holds_expert_slices else {}),
        **({Term.CP_COMM: cp_total} if cfg.cp > 1 else {}),
        Term.BUBBLE: max(0.0, step - busy - max(tails)),
        Term.TIED_GRAD_SYNC: max(tied_s),
        Term.DP_COMM_EXPOSED: max(dp_exposed),
        Term.OPTIMIZER: max(optim_s),
    }
    if fsdp is not None:
        breakdown[Term.FSDP_COMM_EXPOSED] = max(
            cfg.num_microbatches * sum(fsdp.fwd_s[k] + fsdp.bwd_s[k] for k in range(num_stages) if k % cfg.pp == p)
            for p in range(cfg.pp))
    peak_mem = max(m.total_bytes for m in memories)
    capacity = min(g.mem_bytes for g in pp_gpus)
    devices = "CPU ranks" if all(g.name == "cpu" for g in pp_gpus) else "GPUs"
    bound = _bound(sim.bubble_fraction, fwd_s, bwd_s, breakdown, step, peak_mem / capacity, fits, cfg, devices)
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
        **cfg.layout_values(), micro_batch_size=cfg.micro_batch_size, num_microbatches=cfg.num_microbatches,
        schedule=cfg.schedule, recompute=cfg.recompute, zero=cfg.zero, reduce_dtype=cfg.reduce_dtype,
        sequence_parallel=cfg.sequence_parallel, stages=stages,
        block_names=tuple(b.name for b in profile.blocks), fits=fits, predicted=predicted,
    )


def rank_memories(ctx: SearchContext, cfg: ParallelConfig, ranges: list[tuple[int, int]], pp_gpus: list,
              peak_inflight: tuple[int, ...], static: np.ndarray, acts: np.ndarray) -> list[MemoryBreakdown]:
    """Peak memory of each pipeline rank."""
    memories: list[MemoryBreakdown] = []
    for p in range(cfg.pp):
        mine = [k for k in range(cfg.num_stages) if k % cfg.pp == p]
        inflight = [peak_inflight[k] for k in mine]
        # The rank's chunks do not peak together, nor do their FSDP gradients live together
        # (`rank_moments`); the moments agree with the simulated per-chunk peaks or are not used.
        moments = rank_moments(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.virtual_stages, p, inflight)
        memories.append(rank_memory(ctx.profile, cfg, pp_gpus[p], ctx.job.dtype, [ranges[k] for k in mine],
                                    inflight, static=static, acts=acts, params=ctx.params(cfg),
                                    held=None if moments is None else moments.held,
                                    lifetimes=None if moments is None else moments[1:],
                                    stack=ctx.calibrations.stack))
    return memories


def _bound(bubble: float, fwd_s: list[float], bwd_s: list[float], breakdown: dict[str, float], step: float,
           mem_ratio: float, fits: bool, cfg: ParallelConfig, devices: str = "GPUs") -> str:
    """One line on what limits the plan most (`devices`: what the ranks run on, for the wording)."""
    if not fits:
        return f"memory: needs {mem_ratio:.0%} of the GPU's memory; does not fit"
    stage = [a + b for a, b in zip(fwd_s, bwd_s, strict=True)]
    dp_exposed = breakdown[Term.DP_COMM_EXPOSED] + breakdown.get(Term.FSDP_COMM_EXPOSED, 0.0)
    dp_cause = (f"FSDP all-gathers and reduce-scatters not hidden ({dp_exposed / step:.0%} of the step)" if cfg.zero >= 2
                else f"DP gradient reduction not hidden ({dp_exposed / step:.0%} of the step)")
    imbalance = max(stage) / (sum(stage) / len(stage)) - 1 if stage and sum(stage) else 0.0
    causes = {
        f"pipeline bubble ({bubble:.0%} of the step; more micro-batches or interleaving shrink it)": bubble,
        f"slowest stage {imbalance:.0%} above the mean (blocks do not split evenly)": imbalance * (1 - bubble) * 0.5,
        dp_cause: dp_exposed / step,
        f"TP communication ({breakdown[Term.TP_COMM] / step:.0%} of the step)": breakdown[Term.TP_COMM] / step * 0.5,
    }
    cause, weight = max(causes.items(), key=lambda kv: kv[1])
    if mem_ratio > 0.9 and weight < 0.1:
        return f"memory: {mem_ratio:.0%} of the GPU's memory in use, little room for larger micro-batches"
    if weight < 0.05:
        return f"compute: the {devices} are busy most of the step"
    return cause
