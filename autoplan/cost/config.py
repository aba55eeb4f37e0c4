"""`ParallelConfig`: one point of the search space (everything a plan chooses except the cuts)."""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.plan import layout_rank

__all__ = ["ParallelConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
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

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    def rank(self, pp_index: int, dp_index: int, tp_index: int = 0) -> int:
        return layout_rank(self.rank_order, self.tp, self.pp, self.dp, pp_index, dp_index, tp_index)

    def describe(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        extras = [self.schedule + v, f"recompute={self.recompute}"]
        if self.zero:
            extras.append(f"zero={self.zero}")
        if self.dp_replicate > 1:
            extras.append(f"hsdp={self.dp_replicate}x{self.dp_shard}")
        if self.sequence_parallel:
            extras.append("sp")
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} mbs={self.micro_batch_size}x{self.num_microbatches} "
                + " ".join(extras))
