"""What expert parallelism costs beyond the experts' own operators: the all-to-alls of the exchange
on the links the expert group crosses, the tp all-gather of the experts' outputs under expert tp 1,
and the expert layout a plan runs (which ranks exchange with which, over which links).

Apart from cost/time.py, which sums a block's operators and adds these per-block times to its
communication: a mixture-of-experts layer's layout (ep, expert tp, the expert-data-parallel group)
is one concept, priced here and described to the user from the same numbers (`expert_links`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autoplan.cluster import Cluster, allgather_time_s, allreduce_time_s, p2p_time_s
from autoplan.cost.comm import priced_once
from autoplan.cost.config import ParallelConfig
from autoplan.graph.blocks import Block, ModelProfile

__all__ = ["ExpertLinks", "all_to_all_time_s", "dispatch_share", "expert_comm_times_s", "expert_exchange_times_s", "expert_flops", "expert_group_ranks",
           "expert_links", "expert_output_gather_times_s", "expert_tp_reduce_times_s", "sharded_but_experts"]


# [Note: experts on a GPU]
# autoplan's runtime splits a mixture-of-experts layer's experts over ep ranks of tp x dp
# (runtime/parallel/experts.py, plan.py [Note: expert layout]) and leaves each expert whole on the rank
# that holds it (expert tp 1; graph/sharding.py finds no Megatron pattern in stacked expert
# weights; cost/memory.py
# `param_counts`), while tp shards the layer's attention. The recorded operators of the experts say
# so (`tp = "expert"`, [Note: expert operators] in graph/operators.py): `scaled_op` keeps them whole
# under tp and divides their weights' bytes by ep. Such a layer is priced operator by operator at
# tp, not whole over an Amdahl share of its parameters (`tp_divisor`): most expert parameters are
# idle for a given token (top-k of E), so the parameter share (3% sharded for Qwen3-235B-A22B's
# layer) misstates the time share (about half of the layer's FLOPs is attention, which tp divides).
# With ep > 1 and tp > 1 each tp rank sends only its 1/tp of the tokens to the experts (Megatron-LM
# `--expert-tensor-parallel-size 1`, the Megatron-Core MoE README's "MoE parallel folding"), so the
# expert GEMMs, the all-to-all buffers and the experts' FLOPs all divide by tp
# (`ParallelConfig.expert_token_split`), and without sequence parallelism a tp all-gather puts the
# outputs back together (`expert_output_gather_times_s`). What the experts compute and receive is
# what the profiled run computed and sent: capacity routing's (experts, capacity, ...) groups (the
# capacity, padding and all), dropless routing's routed (token, expert) copies, tokens x k of them
# (graph/profile_extra.py `recording_expert_inputs`; GShard, arXiv:2006.16668, Sec. 2.2, for the
# capacity; Gale et al. 2023, MegaBlocks, MLSys, Sec. 3, for dropless grouped GEMMs).
# Under cp a rank's experts take the capacity of the s / cp tokens it holds of each sequence (models/moe.py
# [Note: capacity under context parallelism], Megatron-LM's `get_capacity` over a rank's tokens), so the
# profile's groups at the whole sequence, scaled per token like every operator (`batch_share`: 1/cp),
# are a rank's own (equal when capacity_factor * s * k / (E * cp) is whole, else within a token per
# expert): no term of its own.
# Under expert tp (`ParallelConfig.expert_tp` = tp, runtime/parallel/expert_tp.py) each tp rank holds 1/tp of
# every expert's hidden units and runs all of the replica's tokens: the same FLOPs as a 1/tp share of
# the tokens (`expert_work_split`), the weights divided by ep x tp, no token split for the all-to-all,
# and an all-reduce of the partial outputs over tp (`expert_tp_reduce_times_s`).


def expert_flops(block: Block, f: float, recomputed: bool) -> float:
    """FLOPs of a block's expert operators for one micro-batch at batch factor f, the forward twice
    when it is recomputed."""
    out = 0.0
    for op in block.ops:
        if op.tp == "expert":
            out += op.count * op.flops * f * (2.0 if recomputed and op.phase == "fwd" else 1.0)
    return out


def sharded_but_experts(profile: ModelProfile, index: int) -> bool:
    """Whether block `index` has expert operators and tp shards all of its parameters but its
    experts' (the layout's sharded share over the parameters outside the experts, at least 95%: the router and the norms stay whole)."""
    block = profile.blocks[index]
    if not any(op.tp == "expert" for op in block.ops):
        return False
    experts = (profile.extra.get("experts") or {}).get("block_params") or []
    shares = (profile.extra.get("tensor_parallel") or {}).get("block_sharded_share")
    if index >= len(experts) or not shares or index >= len(shares) or not block.num_params:
        return False
    rest = block.num_params - experts[index]
    return rest > 0 and shares[index] * block.num_params >= 0.95 * rest


def dispatch_share(profile: ModelProfile, cfg: ParallelConfig, dispatch: str) -> float:
    """Share of the routed (token, expert) copies an all-to-all sends under the stack's
    `expert_dispatch` (calibration.py [Note: software stacks]): 1 for "copies"; for "ranks" (DeepEP:
    a token goes once to each rank holding one of its experts, the rank fans it out to them) the
    expected number of distinct ranks among a token's k experts over k. With E experts, E / ep on
    each rank and k distinct experts chosen uniformly (a balanced router), a rank holds none of them
    with the hypergeometric probability C(E - E/ep, k) / C(E, k), so a token reaches
    ep (1 - C(E - E/ep, k) / C(E, k)) ranks: 5.3 of 8 for Qwen3-235B's 8 of 128 experts at ep 8
    (share 0.66); exactly k for Mixtral's 2 of 8 at ep 8 (one expert per rank, share 1). A model
    whose k the profile does not record is priced by its copies."""
    if dispatch != "ranks" or cfg.ep == 1:
        return 1.0
    summary = profile.extra.get("experts") or {}
    experts, k = int(summary.get("num_experts") or 0), int(summary.get("experts_per_token") or 0)
    if not experts or not 0 < k <= experts or experts % cfg.ep:
        return 1.0
    none_here = math.comb(experts - experts // cfg.ep, k) / math.comb(experts, k)
    return min(1.0, cfg.ep * (1.0 - none_here) / k)


def expert_exchange_times_s(profile: ModelProfile, cluster: Cluster, cfg: ParallelConfig,
                            dispatch: str = "copies") -> np.ndarray:
    """Per block, seconds of expert parallelism's two all-to-alls in one pass of one micro-batch:
    dispatch (tokens to the ranks holding their experts) and combine (results back), each of the
    bytes the block's experts receive (`extra["experts"]`). In an all-to-all over n ranks each
    rank sends 1/n of its buffer to each peer (Thakur et al. 2005, Sec. 2; GShard,
    arXiv:2006.16668, Sec. 3.2, prices MoE dispatch the same way), all pairs at once (NCCL's
    all-to-all is one group of sends and receives): a rank's peers in its node take theirs over
    NVLink while those in other nodes take theirs over its network rail, so a rank's time is the
    slower of (peers in its node) / n of its buffer as one NVLink message and (peers elsewhere) / n
    as one network message (one latency per peer), and the exchange waits for its slowest rank. The
    group is `expert_group_ranks` (plan.py [Note: expert layout]).

    Under expert tp 1 with tp > 1 each tp rank sends only its 1/tp of the tokens
    (`ParallelConfig.expert_token_split`; Megatron-Core MoE README, "MoE parallel folding", ETP 1),
    so a rank's buffer is the block's dispatched bytes over tp, and the group is ep consecutive positions
    over tp x dp. The exchanges are not overlapped with
    compute (torchtitan and Megatron-LM's default dispatchers wait for them). A stack that sends a
    token once per rank sends `dispatch_share` of the copies. Zero for blocks without experts."""
    experts = profile.extra.get("experts") or {}
    sent = np.asarray(experts.get("block_dispatch_bytes") or [0] * profile.num_blocks, dtype=float)
    if cfg.ep == 1 or not sent.any():
        return np.zeros(profile.num_blocks)
    ranks = expert_group_ranks(cfg)
    share = dispatch_share(profile, cfg, dispatch)
    return 2 * priced_once(sent * share * cfg.batch_share(profile.batch_size) / cfg.expert_token_split,
                            lambda n: all_to_all_time_s(cluster, ranks, n))


def expert_comm_times_s(profile: ModelProfile, cluster: Cluster, cfg: ParallelConfig,
                        dispatch: str = "copies") -> np.ndarray:
    """Per block, seconds of expert parallelism's communication in one forward of one micro-batch:
    the all-to-alls (`expert_exchange_times_s`), the tp all-gather of the outputs under expert tp 1
    (`expert_output_gather_times_s`) and the all-reduce of the partial outputs under expert tp
    (`expert_tp_reduce_times_s`). The backward moves as much again."""
    return (expert_exchange_times_s(profile, cluster, cfg, dispatch) + expert_output_gather_times_s(profile, cluster, cfg)
            + expert_tp_reduce_times_s(profile, cluster, cfg))


def expert_tp_reduce_times_s(profile: ModelProfile, cluster: Cluster, cfg: ParallelConfig) -> np.ndarray:
    """Per block with experts, seconds of the all-reduce over the expert-tp group (the tp ranks of a
    replica) that sums the partial outputs of experts split along their hidden units (expert tp > 1,
    runtime/parallel/expert_tp.py [Note: expert tp]), in one pass of one micro-batch: the layer's hidden state
    (the bytes crossing the cut after the block), a ring all-reduce (Thakur et al. 2005,
    `allreduce_time_s`); the backward all-reduces the inputs' gradients, the same volume (Megatron-LM's
    copy-to / reduce-from pair, Shoeybi et al. 2019, Fig. 3a). Zero under expert tp 1."""
    out = np.zeros(profile.num_blocks)
    experts = (profile.extra.get("experts") or {}).get("block_dispatch_bytes") or []
    if cfg.expert_tp == 1 or not any(experts) or not profile.cuts:
        return out
    hidden = np.array([profile.cuts[min(i, len(profile.cuts) - 1)].num_bytes if i < len(experts) and experts[i]
                       else 0.0 for i in range(profile.num_blocks)])
    tp_ranks = list(range(cfg.tp))
    return priced_once(hidden * cfg.batch_share(profile.batch_size), lambda n: allreduce_time_s(cluster, tp_ranks, n))


def expert_group_ranks(cfg: ParallelConfig) -> list[int]:
    """The global ranks of the first expert-parallel group of the first pipeline rank (plan.py
    [Note: expert layout]): ep consecutive positions over tp x dp (one node when ep GPUs fit one;
    at tp 1, ep consecutive dp replicas)."""
    return cfg.expert_group_ranks(0)


def expert_output_gather_times_s(profile: ModelProfile, cluster: Cluster, cfg: ParallelConfig) -> np.ndarray:
    """Per block with experts, seconds of the tp all-gather that puts back together the expert
    outputs the tp ranks computed for their 1/tp of the tokens (expert tp 1, `expert_token_split`),
    in one pass of one micro-batch: the layer's hidden state (the bytes crossing the cut after the
    block, or before it for the last block), over the tp group in the node (a ring all-gather,
    Thakur et al. 2005, `allgather_time_s`). The backward moves the same volume once (the split's
    backward all-gathers the tokens' gradients, the gather's keeps its rows: Megatron-LM's
    scatter-to / gather-from-sequence-parallel-region pair, megatron/core/tensor_parallel/mappings.py).
    None under sequence parallelism, where the layer's tokens are already split over tp and stay so
    (Korthikanti et al. 2022, Sec. 4.2.2; Megatron-Core's MoE layer takes the sequence-parallel
    input as it is)."""
    out = np.zeros(profile.num_blocks)
    experts = (profile.extra.get("experts") or {}).get("block_dispatch_bytes") or []
    if cfg.expert_token_split == 1 or cfg.sequence_parallel or not any(experts) or not profile.cuts:
        return out
    hidden = np.array([profile.cuts[min(i, len(profile.cuts) - 1)].num_bytes if i < len(experts) and experts[i]
                       else 0.0 for i in range(profile.num_blocks)])
    tp_ranks = list(range(cfg.tp))
    return priced_once(hidden * cfg.batch_share(profile.batch_size), lambda n: allgather_time_s(cluster, tp_ranks, n))


def all_to_all_time_s(cluster: Cluster, ranks: list[int], num_bytes: float) -> float:
    """One all-to-all over `ranks`, each rank sending 1/n of its `num_bytes` buffer to each of the
    n - 1 others, every pair at once: the slowest rank's slower link class, its messages on one link
    priced as one (`p2p_time_s`, measured curves included) plus a latency per further peer (see
    `expert_exchange_times_s`)."""
    n = len(ranks)
    worst = 0.0
    for r in ranks:
        node = r // cluster.gpus_per_node
        near = [q for q in ranks if q != r and q // cluster.gpus_per_node == node]
        far = [q for q in ranks if q // cluster.gpus_per_node != node]
        for peers in (near, far):
            if peers:
                link = cluster.link(r, peers[0])
                seconds = p2p_time_s(cluster, r, peers[0], num_bytes * len(peers) / n) + (len(peers) - 1) * link.latency_s
                worst = max(worst, seconds)
    return worst


@dataclass(frozen=True)
class ExpertLinks:
    """The expert layout of a configuration, as the cost model prices it."""

    ep: int
    expert_tp: int
    token_split: int
    """Ways a replica's tp ranks split the tokens that reach the experts (`expert_token_split`)."""
    group_ranks: tuple[int, ...]
    """The first expert-parallel group's global ranks."""
    nodes: int
    """Nodes that group spans."""
    nvlink_peers: int
    """Peers a rank of the group reaches inside its node (the most over the group's ranks)."""
    network_peers: int
    """Peers a rank of the group reaches across the network (the most over the group's ranks)."""
    expert_dp: int
    """Ranks holding the same experts (`ParallelConfig.expert_dp`)."""

    def describe(self) -> str:
        """One line: `expert tp 1, tokens split over tp 2: all-to-all over ranks 0, 1, ..., 7 (1 node: 7
        peers over NVLink); expert gradients over 4 ranks holding the same experts`."""
        ranks = self.group_ranks
        shown = ", ".join(map(str, ranks)) if len(ranks) <= 4 else f"{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}"
        split = f", tokens split over tp {self.token_split}" if self.token_split > 1 else ""
        if self.expert_tp > 1:
            split = f", each expert's hidden units split over the {self.expert_tp} tp ranks (the all-to-all at each tp index)"
        links = [f"{self.nvlink_peers} peer{'s' if self.nvlink_peers != 1 else ''} over NVLink"] if self.nvlink_peers else []
        if self.network_peers:
            links.append(f"{self.network_peers} over the network")
        where = f"{self.nodes} node{'s' if self.nodes > 1 else ''}"
        return (f"expert tp {self.expert_tp}{split}: all-to-all over ranks {shown} ({where}: "
                f"{', '.join(links)}); expert gradients over {self.expert_dp} rank{'s' if self.expert_dp > 1 else ''} "
                "holding the same experts")


def expert_links(cluster: Cluster, cfg: ParallelConfig) -> ExpertLinks:
    """The expert layout `expert_exchange_times_s` prices: the group, the nodes it spans and, for its
    worst rank, the peers on each link class (NVLink inside a node, the network across)."""
    ranks = expert_group_ranks(cfg)
    node_of = [r // cluster.gpus_per_node for r in ranks]
    near = max((sum(1 for n in node_of if n == mine) - 1 for mine in node_of), default=0)
    far = max((sum(1 for n in node_of if n != mine) for mine in node_of), default=0)
    return ExpertLinks(ep=cfg.ep, expert_tp=cfg.expert_tp, token_split=cfg.expert_token_split,
                       group_ranks=tuple(ranks), nodes=len(set(node_of)), nvlink_peers=near, network_peers=far,
                       expert_dp=cfg.expert_dp)
