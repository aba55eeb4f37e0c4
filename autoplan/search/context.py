"""What the search knows of one (profile, cluster, job): `SearchContext`, its per-search memos, and
the cutting problems it has already solved.

Apart from the scoring (search/evaluate.py) because every configuration the search scores reads it,
and because it only gathers and caches inputs (block times and bytes, P2P and FSDP link times,
memory reserves); it decides nothing about a plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from autoplan.cluster import Cluster, group_layout
from autoplan.cost.calibration import Calibrations
from autoplan.cost.comm import fsdp_groups, fsdp_unit_times_s
from autoplan.cost.config import ParallelConfig
from autoplan.cost.memory import (
    block_act_bytes,
    block_static_bytes,
    expert_params,
    fsdp_transient_bytes,
    gathered_bytes_per_param,
    head_backward_bytes,
    param_counts,
    reduced_bytes_per_param,
    stage_is_one_unit,
)
from autoplan.cost.time import BlockTimes, block_times, cut_transfer_times_s
from autoplan.graph.blocks import ModelProfile
from autoplan.layout import layout_key_getter
from autoplan.plan import Job
from autoplan.schedule import SimResult
from autoplan.search.partition import DPSolver
from autoplan.search.stage_model import CutProblem, Cuts

__all__ = ["MEMO_KEY_INSTEAD", "MEMO_LEAVES_OUT", "CutCache", "SearchContext", "stage_gpus"]

MEMO_LEAVES_OUT = {
    "times": ("dp", "dp_replicate", "virtual_stages"),  # the rank order and pp only where ep or cp spread groups
    "static": ("cp", "rank_order"),  # pp and virtual stages as whether there is one stage
    "acts": ("pp", "dp", "ep", "expert_tp", "dp_replicate", "virtual_stages", "rank_order"),
    "fsdp-groups": ("cp", "ep", "expert_tp", "virtual_stages"),
    "fsdp": ("pp", "dp", "cp", "virtual_stages", "rank_order"),  # the groups' layouts over the nodes stand for them
    "params": ("pp", "dp", "cp", "dp_replicate", "virtual_stages", "rank_order"),
    "reserve": ("dp", "dp_replicate", "rank_order"),  # pp as whether there is one pipeline rank
    "link": ("pp", "dp", "ep", "expert_tp", "dp_replicate", "virtual_stages", "rank_order"),  # its two ranks stand for them
}
"""The layout fields each per-search memo provably does not depend on. Its key holds every other
layout field (`LayoutCounts.layout_key`), so a field added to `Layout` enters every key until a memo
names it here (tests/test_layout.py)."""

MEMO_KEY_INSTEAD = {"times": ("rank_order", "pp"), "static": ("pp", "virtual_stages"), "reserve": ("pp",)}
"""The layout fields a memo depends on only in part: its key holds a value made from each (in this
order) in place of the field (`LayoutCounts.layout_key`'s `instead`)."""

_KEY = {memo: layout_key_getter(without, MEMO_KEY_INSTEAD.get(memo, ())) for memo, without in MEMO_LEAVES_OUT.items()}
"""Each memo's key getter, made once: the search builds tens of thousands of keys."""


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
        self.cut_cache: dict[tuple, CutCache] = {}
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
        key = ("times", gpu.name, cfg.micro_batch_size, cfg.recompute, cfg.sequence_parallel,
               *_KEY["times"](cfg), cfg.rank_order if spread else None, cfg.pp if spread else None)
        return self.cached(key, lambda: block_times(self.profile, gpu, self.cluster, cfg, self.job.dtype,
                                                    self.calibration(gpu)))

    def static_bytes(self, cfg: ParallelConfig) -> np.ndarray:
        key = ("static", cfg.zero, cfg.reduce_dtype,
               *_KEY["static"](cfg), cfg.pp == 1, cfg.num_stages == 1)
        return self.cached(key, lambda: block_static_bytes(self.profile, cfg, self.job.dtype))

    def act_bytes(self, cfg: ParallelConfig) -> np.ndarray:
        key = ("acts", cfg.micro_batch_size, cfg.recompute, cfg.sequence_parallel, *_KEY["acts"](cfg))
        # A CPU rank runs F.rms_norm's composite form, which saves more (cost/memory.py [Note: fused
        # RMSNorm]); a cluster with any CPU rank is counted as one, the larger of the two.
        cpu = any(g.name == "cpu" for g in self.gpu_types)
        # Counted as the stack's runtime holds them (cost/memory_stacks.py [Note: memory per stack]).
        return self.cached(key, lambda: block_act_bytes(self.profile, cfg, cpu, self.calibrations.stack))

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
        groups_key = ("fsdp-groups", pp_index, *_KEY["fsdp-groups"](cfg))

        def groups():
            first = cfg.rank(pp_index, 0, 0)
            shard, replicate = fsdp_groups(first, cfg.rank(pp_index, 1, 0) - first if cfg.dp > 1 else 1, cfg.dp,
                                           cfg.dp_replicate)
            # A collective's time depends on its ranks only through their layout over the nodes.
            return shard, replicate, (group_layout(self.cluster, shard), group_layout(self.cluster, replicate))

        shard, replicate, layouts = self.cached(groups_key, groups)
        gather_bytes = gathered_bytes_per_param(self.job.dtype)
        reduce_bytes = reduced_bytes_per_param(cfg.reduce_dtype)
        key = ("fsdp", cfg.reduce_dtype, layouts, *_KEY["fsdp"](cfg))
        if not cfg.holds_expert_slices:
            return self.cached(key, lambda: fsdp_unit_times_s(
                self.cluster, shard, replicate, self.params(cfg), gather_bytes, reduce_bytes))

        def with_experts() -> tuple[np.ndarray, np.ndarray]:
            # A block's experts are a unit of their own, sharded over the ranks holding the same
            # experts (runtime/parallel/fsdp.py): the expert-data-parallel group, under HSDP split by replica
            # (plan.py [Note: expert layout]).
            local_experts = np.asarray(expert_params(self.profile), dtype=float) / (cfg.ep * cfg.expert_tp)
            gather, reduce = fsdp_unit_times_s(self.cluster, shard, replicate, self.params(cfg) - local_experts,
                                               gather_bytes, reduce_bytes)
            expert_gather, expert_reduce = fsdp_unit_times_s(self.cluster, *cfg.expert_fsdp_groups(pp_index),
                                                             local_experts, gather_bytes, reduce_bytes)
            return gather + expert_gather, reduce + expert_reduce

        return self.cached(key, with_experts)

    def params(self, cfg: ParallelConfig) -> np.ndarray:
        return self.cached(("params", *_KEY["params"](cfg)),
                           lambda: param_counts(self.profile, cfg))

    def reserve(self, cfg: ParallelConfig) -> float:
        """Bytes reserved per GPU for buffers (receive buffers, backward transients) before cutting:
        two receive buffers of the largest boundary per virtual stage and two of the largest block
        output (`rank_memory` counts the same at the actual cuts), so the reserve never under-counts
        the GPU it lands on; then the larger of the largest block's full activations (full
        recompute) and the head's backward transients (`head_backward_bytes`); then FSDP's units in
        flight (`fsdp_transient_bytes`)."""
        key = ("reserve", cfg.micro_batch_size, cfg.recompute, cfg.sequence_parallel, cfg.zero, cfg.reduce_dtype,
               *_KEY["reserve"](cfg), cfg.pp == 1)

        def make() -> float:
            f = cfg.batch_share(self.profile.batch_size)
            cut_bytes = np.array([0.0] + [nb * f for nb in self.cut_num_bytes] + [0.0])
            reserve = 2 * cfg.virtual_stages * cut_bytes.max() + 2 * (self.largest_output_bytes * f)
            recompute = float(np.max(self.act_bytes(_no_recompute(cfg)))) if cfg.recompute == "full" else 0.0
            head = head_backward_bytes(self.profile, self.act_bytes(cfg), range(self.profile.num_blocks),
                                       self.calibrations.stack, cfg.tp)
            # FSDP's few-units terms, for the largest units anywhere ([Note: FSDP gathered bytes]).
            fsdp = fsdp_transient_bytes(self.job.dtype, cfg.zero, cfg.pp, self.params(cfg),
                                        stage_is_one_unit(self.profile), reduced_bytes_per_param(cfg.reduce_dtype))
            return reserve + max(recompute, head) + fsdp

        return self.cached(key, make)

    def link_times(self, cfg: ParallelConfig) -> np.ndarray:
        src, dst = cfg.rank(0, 0), cfg.rank(1 % cfg.pp, 0)
        key = ("link", cfg.micro_batch_size, src, dst, *_KEY["link"](cfg))

        def make() -> np.ndarray:
            out = np.zeros(self.profile.num_blocks + 1)
            if cfg.pp > 1:
                out[1:-1] = cut_transfer_times_s(self.profile, self.cluster, cfg, src, dst)
            return out

        return self.cached(key, make)


def stage_gpus(cluster: Cluster, cfg: ParallelConfig) -> list:
    """GPU type of each pipeline rank (the slowest type among its tp x dp ranks)."""
    if cluster.is_homogeneous:
        return [cluster.gpu] * cfg.pp
    gpus = []
    for p in range(cfg.pp):
        types = {cluster.gpu_of_rank(cfg.rank(p, d, t)).name: cluster.gpu_of_rank(cfg.rank(p, d, t))
                 for d in range(cfg.dp) for t in range(cfg.tp)}
        gpus.append(min(types.values(), key=lambda g: (g.peak_flops.get("bf16", 0.0), g.mem_bytes)))
    return gpus


class CutCache:
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


def _no_recompute(cfg: ParallelConfig) -> ParallelConfig:
    return dataclasses.replace(cfg, recompute="none")
