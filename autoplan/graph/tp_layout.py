"""A tensor-parallel layout as data: which modules are column-, row- or vocabulary-parallel, what
tp must divide, and why a model cannot run at a given tp.

graph/sharding.py finds a layout from the model's data flow; the profile records its summary, the
search reads its refusals, and the runtime (runtime/parallel/tensor_parallel.py) applies it. Apart from the finding
so that the readers of a layout need none of its machinery.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ShardGroup", "TensorParallelLayout", "replicated_note"]


@dataclass(frozen=True)
class ShardGroup:
    """Column-parallel linears feeding one row-parallel linear."""

    kind: str
    """"attention" or "mlp"."""
    colwise: tuple[str, ...]
    rowwise: str
    counts: tuple[tuple[str, int], ...]
    """What tp must divide: ("num_heads", 32), ("num_kv_heads", 8) or ("ffn_hidden_size", 11008)."""
    parent: str
    """The innermost module holding all of them (the attention or MLP module)."""
    norm: str = ""
    """A normalization of q / k between them: "head" (over each head: Qwen3's q/k norm, sharded with
    the heads as is) or "full" (over a projection's whole width: OLMo2's; its statistics need
    every tp rank's part, which DTensor all-reduces on an inlined graph)."""
    shared: tuple[str, ...] = ()
    """Linears that feed the attention and its column-parallel linears too, left whole on every tp
    rank (latent attention's down-projections: [Note: latent attention] in graph/tp_pairs.py)."""


@dataclass
class TensorParallelLayout(Mapping):
    """A model's tensor-parallel layout: module path -> style, read as a mapping.

    Styles: "colwise" / "rowwise" (Megatron's column- and row-parallel linears), "vocab-embedding"
    (rows of the token table) and "vocab-head" (columns of the logits); modules absent stay
    replicated."""

    styles: dict[str, str] = field(default_factory=dict)
    groups: tuple[ShardGroup, ...] = ()
    divides: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Count name ("num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size") -> (the gcd of that
    count over the model's layers, the first module that has it): tp must divide each gcd. KV heads
    are not replicated, so tp must divide them too."""
    layers: tuple[str, ...] = ()
    """Transformer layers sequence parallelism lays out (norms, a sharded attention, sharded MLPs and
    units computed whole, as an MoE block: graph/sharding.py `sp_children`)."""
    replicated: dict[str, str] = field(default_factory=dict)
    """Attention modules left whole on every tp rank -> why: each computes its whole attention on
    every rank, and the cost model prices it so (profile_extra.py's per-block sharded share)."""
    note: str = ""
    """Why no tp > 1 is possible (one line), or "" when the layout shards something."""
    sharded_params: int = 0
    """Parameters the layout shards (each tp rank holds 1/tp of them); the rest are replicated."""
    total_params: int = 0
    parts: dict[str, int] = field(default_factory=dict)
    """A fused projection styled "colwise-qkv" -> the number of equal parts its output is cut into
    (3 for q, k and v; 2 for gate and up): each part is sharded on its own ([Note: fused projections]
    in graph/sharding.py)."""
    blocks: dict[str, tuple[tuple[int, bool], ...]] = field(default_factory=dict)
    """A "colwise-qkv" projection whose parts differ in size or are not all sharded -> (features,
    left whole) per part: [q | k | v] with grouped-query heads (each part sharded), or multi-query
    (q sharded, the one key and value head whole on every rank). Absent for equal parts, all sharded
    ([Note: fused projections] in graph/tp_pairs.py)."""
    head_params: tuple[str, ...] = ()
    """Parameters that only a sharded attention's heads read (the weight of a per-head q/k norm):
    left whole on every tp rank, each rank's gradient covers its own heads, so under module hooks
    the runtime sums it over tp (DTensor does so on an inlined graph)."""
    transposed: frozenset[str] = frozenset()
    """Sharded linears whose weight is stored (in, out) (transformers' `Conv1D`)."""
    tied: dict[str, str] = field(default_factory=dict)
    """Another name of a sharded parameter, under a module the layout does not style (BERT's
    `cls.predictions.bias` is `cls.predictions.decoder.bias`) -> the sharded parameter's name: a
    stage that holds the parameter only under that name must shard it the same way."""
    inlined: bool = False
    """The traced graph inlines the sharded modules (torch.export): the runtime runs such stages in
    DTensor ([Note: tensor parallelism on an inlined graph] in runtime/parallel/tensor_parallel_graph.py), without
    sequence parallelism. Set by `for_graph`."""

    def __getitem__(self, key: str) -> str:
        return self.styles[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.styles)

    def __len__(self) -> int:
        return len(self.styles)

    def refusal(self, tp: int) -> str | None:
        """One line saying why this model cannot run at `tp`, or None when it can."""
        if tp == 1:
            return None
        if self.note:
            return f"no tensor-parallel layout: {self.note}; plan with tp = 1"
        for name, (count, path) in self.divides.items():
            if count % tp:
                where = f" of '{path}'" if path else ""
                hint = ("pad the vocabulary to a multiple of tp (Megatron-LM pads to 128 * tp) or plan with another tp"
                        if name == "vocab_size" else "plan with a tp that divides it")
                return f"tp = {tp} does not divide {name} = {count}{where}; {hint}"
        return None

    def sharded_share(self, path: str) -> float:
        """The share of module `path`'s parameters that each tp rank holds 1/tp of: 1 for a styled
        module, 0 for one left whole; a fused projection with parts left whole (the key and value of
        multi-query attention: `blocks`) shards the rest."""
        if path not in self.styles:
            return 0.0
        parts = self.blocks.get(path)
        if not parts:
            return 1.0
        return sum(n for n, whole in parts if not whole) / sum(n for n, _ in parts)

    def degrees(self, max_tp: int) -> list[int]:
        """Every tp in 1..max_tp this layout can run."""
        return [t for t in range(1, max_tp + 1) if self.refusal(t) is None]

    def summary(self) -> dict[str, Any]:
        """What the profile records (`ModelProfile.extra["tensor_parallel"]`): JSON only."""
        return {"divides": {k: c for k, (c, _) in self.divides.items()}, "sequence_parallel": bool(self.layers),
                "note": self.note, "replicated": dict(self.replicated),
                # FSDP cannot shard a [q | k | v] projection's bias again along its one dim (fsdp.py)
                "fused_qkv": any(style == "colwise-qkv" for style in self.values()),
                "sharded_params": self.sharded_params, "total_params": self.total_params}


def replicated_note(summary: Mapping[str, Any], tp: int) -> str | None:
    """One line for a plan at `tp` whose layout (`TensorParallelLayout.summary()`) leaves modules
    whole on every tp rank: which, and why (the first one's reason); None when nothing is left so."""
    replicated = dict(summary.get("replicated") or {})
    if tp == 1 or not replicated:
        return None
    first, why = next(iter(replicated.items()))
    more = f" and {len(replicated) - 1} more" if len(replicated) > 1 else ""
    return (f"tp {tp} leaves '{first}'{more} whole on every tp rank (computed and held unsharded, and priced so): "
            f"{why}")
