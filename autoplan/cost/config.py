"""`ParallelConfig`: one point of the search space (everything a plan chooses except the cuts)."""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.layout import LayoutCounts, carries_layout
from autoplan.plan import Plan, expert_positions

__all__ = ["DESCRIBE_LEAVES_OUT", "ParallelConfig"]

DESCRIBE_LEAVES_OUT = ("rank_order",)
"""Layout fields `describe` does not show: configurations that differ only in their rank order read
the same (the search keeps the faster of two such plans, search/space.py `_same_but_layout`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
@carries_layout  # a Layout field not declared below, with its default (layout.py)
class ParallelConfig(LayoutCounts):
    """The layout fields (layout.py `Layout`) and the choices made on them; the counts derived from
    the layout are `LayoutCounts`'."""

    tp: int
    """Tensor-parallel degree (Megatron column/row sharding inside a node)."""
    pp: int
    """Pipeline ranks."""
    dp: int
    """Data-parallel replicas."""
    micro_batch_size: int
    num_microbatches: int
    """Micro-batches per replica per step (gradient accumulation steps)."""
    schedule: str
    """gpipe, 1f1b, interleaved-1f1b or zb-h1."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved-1f1b only)."""
    recompute: str = "none"
    """none, selective (attention core) or full (whole transformer layers)."""
    zero: int = 0
    """0: replicated optimizer; 1: optimizer states sharded over dp (ZeroRedundancyOptimizer);
    2: FSDP2 keeping parameters gathered from forward to backward (`reshard_after_forward=False`);
    3: FSDP2 resharding after forward (ZeRO-3). See docs/running.md, "Sharded data parallelism"."""
    dp_replicate: int = 1
    """HSDP (zero >= 2): FSDP shards over dp / dp_replicate ranks, replicated dp_replicate times."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: norms/dropout sharded along the sequence over tp."""
    rank_order: str = "tp-dp-pp"
    """See plan.py [Note: rank layout]."""
    cp: int = 1
    """Context-parallel degree: groups of cp consecutive dp ranks split each sequence (2 * cp
    load-balanced chunks) and exchange keys and values; dp counts them, so dp / cp replicas take
    distinct batches (torchtitan's dp_shard x cp)."""
    ep: int = 1
    """Expert-parallel degree: each group of ep ranks splits a layer's experts ep ways and exchanges
    tokens by all-to-all: ep consecutive positions over tp x dp, the tp ranks splitting the experts'
    tokens (Megatron-Core's MoE parallel folding; plan.py [Note: expert layout])."""
    expert_tp: int = 1
    """Expert tensor-parallel degree (`Plan.expert_tp`), 1 or tp. 1: every expert whole on the rank
    that holds it, and with tp > 1 and ep > 1 each tp rank sends only its 1/tp of the tokens to the
    experts (Megatron-LM's `--expert-tensor-parallel-size 1`). tp: the tp ranks split every expert's
    hidden units and share the replica's tokens (plan.py [Note: expert layout])."""
    reduce_dtype: str = "float32"
    """The dtype FSDP (zero >= 2) reduce-scatters gradients in: float32 (FSDP2's
    `MixedPrecisionPolicy(reduce_dtype=float32)`, Megatron-LM's default for bf16) or bfloat16
    (`MixedPrecisionPolicy(reduce_dtype=bfloat16)`, Megatron-LM's `--grad-reduce-in-bf16`),
    which halves the reduction's bytes. Pinned by the user, never searched: it changes the numbers."""

    @property
    def expert_work_split(self) -> int:
        """Ways a replica's tp ranks share each expert operator's work: its tokens split under expert
        tp 1 (`expert_token_split`), each expert's hidden units under expert tp tp; tp either way with
        ep > 1 ([Note: experts on a GPU] in cost/experts.py)."""
        return self.expert_token_split * self.expert_tp

    @property
    def expert_dp(self) -> int:
        """Ranks that hold the same experts (the expert-data-parallel group), over which expert
        gradients are reduced and, with zero 1, expert optimizer state is sharded: tp x dp / ep
        (plan.py [Note: expert layout]), Megatron-Core's expert-data-parallel size
        tp * dp / (ep * expert tp) (Megatron-Core MoE README, "MoE parallel folding")."""
        return self.dp * self.tp // (self.ep * self.expert_tp)

    def expert_group_ranks(self, pp_index: int = 0) -> list[int]:
        """The global ranks of the first ep group of pipeline rank `pp_index` (positions 0 .. ep - 1),
        in ep-index order (at expert-tp index 0)."""
        width = self.tp // self.expert_tp
        return [self.rank(pp_index, j // width, (j % width) * self.expert_tp) for j in range(self.ep)]

    def expert_dp_ranks(self, pp_index: int) -> list[int]:
        """The global ranks of the first expert-data-parallel group of pipeline rank `pp_index` (the
        ranks holding the experts of rank (dp 0, tp 0)), in rank order: replica-major under HSDP."""
        return [self.rank(pp_index, d, t) for d, t in expert_positions(self.ep, self.tp, self.dp, 0, self.expert_tp)]

    def expert_fsdp_groups(self, pp_index: int) -> tuple[list[int], list[int]]:
        """(shard group, replicate group) over which FSDP shards and replicates the experts of rank
        (dp 0, tp 0) of pipeline rank `pp_index` (plan.py [Note: expert layout]): its expert-data-
        parallel group split by replica (ep divides tp x dp_shard); without HSDP all of it and itself
        alone."""
        ranks = self.expert_dp_ranks(pp_index)
        assert len(ranks) % self.dp_replicate == 0, (self.ep, self.tp, self.dp, self.dp_replicate)
        shard = len(ranks) // self.dp_replicate
        return ranks[:shard], ranks[::shard]

    @classmethod
    def of_plan(cls, plan: Plan) -> ParallelConfig:
        """The point of the search space a plan was made at."""
        return cls(**plan.layout_values(), micro_batch_size=plan.micro_batch_size,
                   num_microbatches=plan.num_microbatches, schedule=plan.schedule, recompute=plan.recompute,
                   zero=plan.zero, sequence_parallel=plan.sequence_parallel, reduce_dtype=plan.reduce_dtype)

    def batch_share(self, profile_batch: int) -> float:
        """The share of the profiled batch one GPU computes per micro-batch: the micro-batch's rows,
        and 1/cp of each sequence."""
        return self.micro_batch_size / profile_batch / self.cp

    def describe(self) -> str:
        """One line: the degrees and choices away from their defaults. The rank order is left out
        (`DESCRIBE_LEAVES_OUT`); a layout field added after the first ones reads `name=value`."""
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        extras = [self.schedule + v, f"recompute={self.recompute}"]
        if self.zero:
            extras.append(f"zero={self.zero}")
        if self.cp > 1:
            extras.append(f"cp={self.cp}")
        if self.ep > 1:
            extras.append(f"ep={self.ep}")
        if self.expert_tp > 1:
            extras.append(f"etp={self.expert_tp}")
        if self.dp_replicate > 1:
            extras.append(f"hsdp={self.dp_replicate}x{self.dp_shard}")
        if self.sequence_parallel:
            extras.append("sp")
        if self.reduce_dtype != "float32":
            extras.append(f"reduce={self.reduce_dtype}")
        extras += [f"{name}={value}" for name, value in self.later_fields().items() if name != "expert_tp"]  # etp above
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} mbs={self.micro_batch_size}x{self.num_microbatches} "
                + " ".join(extras))
