"""The profiled model as plain data: `Block`, `CutCandidate`, `ModelProfile`.

These are what the planner sees of a model. They hold numbers only (no modules, no tensors), so a
profile can be saved as JSON, cached, compared and fed to the search without torch.

Units: FLOPs, bytes, seconds. All per-micro-batch quantities refer to the batch size and
sequence length the profile was taken at (`ModelProfile.batch_size`, `.seq_len`); the planner
scales them linearly to other micro-batch sizes (every op in the zoo is linear in the batch).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BLOCK_KINDS", "Block", "CrossingTensor", "CutCandidate", "ModelProfile", "Op", "PROFILE_SCHEMA_VERSION"]

PROFILE_SCHEMA_VERSION = 2
"""2 added `Block.ops`; version-1 profiles still load (without operators, the cost model falls back to
block FLOPs)."""

BLOCK_KINDS = ("embedding", "layer", "attention", "mlp", "norm", "head", "other")
"""`layer` is a whole transformer layer (attention + MLP); `attention` and `mlp` appear when the
user names sub-layer leaf modules."""


@dataclass(frozen=True, slots=True)
class Op:
    """One operator (kernel) a block runs, as recorded on fake tensors (graph/operators.py), with how
    many times it runs per pass. The operator-level time model (cost/ops.py) prices these."""

    kind: str
    """`gemm` (mm, addmm, bmm, grouped and convolution GEMMs), `attention` (a fused attention kernel)
    or `memory` (everything else that launches a kernel: element-wise, norms, softmax, copies)."""
    phase: str
    """`fwd` or `bwd`."""
    name: str
    """The ATen operator, e.g. `mm`, `_scaled_dot_product_flash_attention_for_cpu`, `native_layer_norm`."""
    dtype: str
    """Dtype of its first floating-point input (what its math runs in)."""
    count: int
    """Calls per pass with these shapes."""
    flops: float = 0.0
    """FLOPs per call at the profile's batch (torch.utils.flop_counter conventions); 0 for memory ops."""
    bytes: float = 0.0
    """Bytes a call reads and writes that grow with the batch (at the profile's batch)."""
    fixed_bytes: float = 0.0
    """Bytes a call reads and writes whatever the batch (weights, a weight's gradient)."""
    shape: tuple[int, ...] = ()
    """gemm: (batch, m, n, k); attention: (batch, heads, q_len, kv_len, head_dim)."""
    batch_axis: int | None = None
    """Axis of `shape` proportional to the batch (found by recording at two batch sizes)."""
    tp_axis: int | None = None
    """Axis of `shape` tensor parallelism divides (the wider weight dimension of a GEMM, the heads of
    attention); None: see `tp`."""
    tp: str = "sharded"
    """How tensor parallelism splits a memory op: `sharded` (divides by tp), `hidden` (a tensor of
    the hidden size: replicated, divided by tp only under sequence parallelism), `expert` (an
    experts' operator: whole on every tp rank; expert parallelism divides its weights' bytes by ep
    and gathers ep times the tokens per expert, cost/ops.py `scaled_op`)."""
    causal: bool = False
    """Attention with a causal mask."""


@dataclass(frozen=True, slots=True)
class Block:
    """One unit the planner may place on a pipeline stage (a contiguous run of the traced graph)."""

    name: str
    """Original module path, e.g. `layers.3`; `embedding` for everything before the repeated layers."""
    kind: str
    """One of BLOCK_KINDS."""
    fwd_flops: float
    """Forward FLOPs for one micro-batch (torch.utils.flop_counter conventions: 2 per MAC)."""
    bwd_flops: float
    """Backward FLOPs (input and weight gradients) for one micro-batch."""
    num_params: int
    """Parameters this block owns (a parameter shared with an earlier block is not counted again)."""
    param_bytes: int
    """Bytes of every parameter the block *holds*, shared ones included (a tied head holds a copy)."""
    output_bytes: int
    """Bytes of all tensors crossing the cut right after this block (what a stage boundary here sends)."""
    saved_bytes: int
    """Bytes saved for backward by this block's ops per micro-batch (parameters and buffers excluded:
    they are model state; a storage saved by several ops counted once)."""
    saved_bytes_replicated_tp: int = 0
    """Part of `saved_bytes` that tensor parallelism does not shard (tensors of the layer's hidden
    shape: norm inputs, residuals, dropout masks); the rest divides by tp. Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", Sec. 4.2."""
    tp_comm_bytes: int = 0
    """Bytes of one activation all-reduce times the number of Megatron all-reduces this block does
    in forward under tensor parallelism (2 per transformer layer; Shoeybi et al. 2019, Fig. 3);
    backward does as many."""
    attention_core_fwd_flops: float = 0.0
    """Forward FLOPs of the attention core (QK^T, softmax, AV): what selective recompute redoes
    (Korthikanti et al. 2022, Sec. 5)."""
    attention_core_bwd_flops: float = 0.0
    """Backward FLOPs of the attention core (flash attention's backward recomputes the scores)."""
    attention_core_saved_bytes: int = 0
    """Saved bytes of the attention core (dropped under selective recompute)."""
    fwd_time_s: float | None = None
    """Measured forward time on `ModelProfile.device` (median), when timed."""
    bwd_time_s: float | None = None
    """Measured backward time on `ModelProfile.device` (median), when timed."""
    fwd_time_fixed_s: float = 0.0
    """Part of `fwd_time_s` that does not grow with the batch (weight reads, kernel launches): at batch
    b the forward takes fixed + (fwd_time_s - fixed) * b / batch_size. Timed profiles fit it from two
    batch sizes ([Note: batch scaling] in graph/profile.py); 0 scales linearly."""
    bwd_time_fixed_s: float = 0.0
    """The same for `bwd_time_s` (a 256k-vocabulary embedding's dense weight gradient: all of it)."""
    fingerprint: str = ""
    """Hash of the block's structure and input shapes; equal fingerprints were profiled once."""
    tied_params: int = 0
    """Parameters this block shares with block `tied_to_block` (a head tied to the embedding). When the
    two sit on different pipeline ranks, each holds a copy and their gradients are summed every step."""
    tied_to_block: int | None = None
    """Index of the earlier block that owns the shared parameters, if any."""
    ops: tuple[Op, ...] = ()
    """The operators of one forward and one backward, at the profile's batch (empty in a version-1
    profile or when recording failed: then the time model uses the block's FLOPs)."""

    @property
    def flops(self) -> float:
        return self.fwd_flops + self.bwd_flops


@dataclass(frozen=True, slots=True)
class CrossingTensor:
    """A value that is live across a cut: produced at or before the cut, used after it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    num_bytes: int


@dataclass(frozen=True, slots=True)
class CutCandidate:
    """The boundary after block `index` (between blocks index and index+1)."""

    index: int
    tensors: tuple[CrossingTensor, ...]
    legal: bool = True
    reason: str = ""
    """Why the cut is illegal (a non-tensor value crosses it), empty when legal."""

    @property
    def num_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tensors)


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """Blocks in execution order and the cuts between them."""

    model_name: str
    fingerprint: str
    """Hash of the model structure (module classes, parameter shapes) and input shapes."""
    blocks: tuple[Block, ...]
    cuts: tuple[CutCandidate, ...]
    """len(blocks) - 1 entries: cuts[i] is the boundary after blocks[i]."""
    batch_size: int
    seq_len: int
    dtype: str
    """Dtype the profile's activations were measured in (bytes scale with it)."""
    tracer: str
    """`fx`, `export` or `modules`: which tracer produced the graph."""
    device: str = "meta"
    """`meta` for analytic profiles, else the device name blocks were timed on."""
    num_heads: int | None = None
    """Attention heads (tensor parallelism must divide them), when known."""
    num_kv_heads: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    num_layers: int | None = None
    torch_version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_params(self) -> int:
        return sum(b.num_params for b in self.blocks)

    @property
    def fwd_flops(self) -> float:
        return sum(b.fwd_flops for b in self.blocks)

    @property
    def flops(self) -> float:
        return sum(b.flops for b in self.blocks)

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def is_timed(self) -> bool:
        return all(b.fwd_time_s is not None and b.bwd_time_s is not None for b in self.blocks)

    def legal_cuts(self) -> list[int]:
        return [c.index for c in self.cuts if c.legal]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["schema_version"] = PROFILE_SCHEMA_VERSION
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelProfile:
        d = dict(d)
        version = d.pop("schema_version", PROFILE_SCHEMA_VERSION)
        if version not in (1, PROFILE_SCHEMA_VERSION):
            raise ValueError(
                f"profile schema version {version} is not supported (this autoplan reads {PROFILE_SCHEMA_VERSION}); "
                "re-profile the model"
            )
        d["blocks"] = tuple(
            Block(**{**b, "ops": tuple(Op(**{**o, "shape": tuple(o.get("shape", ()))}) for o in b.get("ops", ()))})
            for b in d["blocks"]
        )
        d["cuts"] = tuple(
            CutCandidate(
                index=c["index"],
                tensors=tuple(CrossingTensor(t["name"], tuple(t["shape"]), t["dtype"], t["num_bytes"]) for t in c["tensors"]),
                legal=c["legal"],
                reason=c.get("reason", ""),
            )
            for c in d["cuts"]
        )
        return cls(**d)

    def with_blocks(self, blocks: Sequence[Block]) -> ModelProfile:
        return dataclasses.replace(self, blocks=tuple(blocks))
