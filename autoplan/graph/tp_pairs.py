"""One candidate column- and row-parallel pair judged from the recorded data flow: whether
column-parallel linears feeding a row-parallel one through attention or element-wise ops can be
sharded, with what counts tp must divide, and how a fused projection is cut into its parts.

graph/sharding.py walks the model's linears and assembles the layout from these verdicts; apart so
that the rules for one pair (fused projections, q/k norms) read in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autoplan.graph.data_flow import NORM, VIEWS, Flow

__all__ = ["Pair", "attention_pair", "mlp_pair"]

Pair = tuple[str, tuple[tuple[str, int], ...], int, str]
"""A column- and row-parallel pair found: (kind, counts, parts of a fused projection or 0, norm)."""


def attention_pair(flow: Flow, feeders: Sequence[str], b_in: int, src: frozenset) -> Pair | str:
    """Column-parallel `feeders` of a row-parallel linear of width `b_in` through attention, or why
    not (one phrase): separate q, k and v projections, or one fused projection laid out per head
    (or per key/value group) or in equal blocks ([Note: fused projections])."""
    head_dim = next((d for k, d in flow.head_dim.items() if k <= set(feeders)), None)
    if not head_dim or any(flow.widths[a][1] % head_dim for a in feeders):
        return "its projections' widths are not whole heads"
    norm = ""
    if NORM in src:  # q/k norms: per head (Qwen3), or over the projection's whole width (OLMo2)
        normed = set().union(*(w for k, w in flow.norms.items() if k & set(feeders)))
        if normed == {head_dim}:
            norm = "head"
        elif normed and normed <= {flow.widths[a][1] for a in feeders}:
            norm = "full"
        else:
            return "a normalization between its projections and its output projection spans several heads"
    q = b_in // head_dim
    if len(feeders) > 1:
        kv = min(flow.widths[a][1] // head_dim for a in feeders)
        return "attention", (("num_heads", q),) + ((("num_kv_heads", kv),) if kv != q else ()), 0, norm
    fused, width = feeders[0], flow.widths[feeders[0]][1]
    groups = _groups(next(iter(flow.uses.get(fused, ())), None), width, head_dim, q)
    if groups:  # per head or per key/value group: a contiguous shard holds whole groups
        return "attention", (("num_heads", q),) + ((("num_kv_heads", groups),) if groups != q else ()), 0, norm
    sizes = _parts(flow.uses.get(fused, ()), width)
    if sizes is None:
        return (f"its fused q/k/v projection '{fused}' is neither cut into q, k and v parts nor reshaped into "
                "groups of whole query, key and value heads (multi-query: one key/value head every query head "
                "shares), so autoplan cannot shard it by heads")
    if len(set(sizes)) != 1 or sizes[0] % head_dim:
        return (f"its fused q/k/v projection '{fused}' is cut into unequal parts {sizes} (grouped-query heads): "
                "a strided shard holds equal parts only")
    return "attention", (("num_heads", sizes[0] // head_dim),), len(sizes), norm


def mlp_pair(flow: Flow, feeders: Sequence[str], b_in: int, src: frozenset) -> Pair | str:
    """Column-parallel `feeders` of a row-parallel linear of width `b_in` through element-wise ops
    (up/gate -> down), a fused gate/up projection cut into equal parts included, or why not."""
    if NORM in src:
        return "a normalization over the features between them needs the whole width"
    counts = (("ffn_hidden_size", b_in),)
    if all(flow.widths[a][1] == b_in for a in feeders):
        return "mlp", counts, 0, ""
    if len(feeders) == 1:
        sizes = _parts(flow.uses.get(feeders[0], ()), flow.widths[feeders[0]][1])
        if sizes and len(sizes) > 1 and set(sizes) == {b_in}:
            return "mlp", counts, len(sizes), ""
    return "its projections' widths do not match"


# [Note: fused projections]
# A fused projection computes several column-parallel outputs in one linear (q, k and v; gate and
# up). How its output is cut decides how it shards:
# - reshaped at once into (groups, ...) where each group holds whole heads of q, k and v (Megatron-
#   LM's per-head layout, Falcon's `view(b, s, heads, 3, head_dim)` and, with key/value groups,
#   `new_decoder_architecture`'s `view(b, s, kv_heads, heads / kv_heads + 2, head_dim)`): a
#   contiguous shard of the output features holds whole groups, so it is a plain column-parallel
#   linear (`_groups`);
# - cut along its features into equal parts by `split` / `chunk` / slices, or reshaped into
#   (3, heads, ...) ([q | k | v]: GPT-2's `c_attn`, Phi-3's `qkv_proj` and `gate_up_proj`): each
#   part is sharded on its own, rank r holding [q_r | k_r | v_r] (the "colwise-qkv" style; the
#   number of parts in `TensorParallelLayout.parts`), as Megatron-LM's fused QKV holds each rank's
#   heads of all three (Shoeybi et al. 2019, Sec. 3; megatron/core/transformer/attention.py).
#   DTensor's `_StridedShard(dim, split_factor=parts)` is that placement (runtime/
#   tensor_parallel_graph.py [Note: fused q/k/v]); the split on each rank yields its own parts.
# - parts of unequal sizes ([q | k | v] with fewer key/value heads than query heads: Phi-3 with
#   grouped-query attention) have no such placement: the attention stays replicated and the layout
#   says so (`TensorParallelLayout.replicated`), as it does for a reshape into single heads shared
#   by all queries (Falcon's multi-query layout, one key/value head).


def _parts(uses: Sequence[Any], width: int) -> tuple[int, ...] | None:
    """The sizes of the blocks a fused projection's output (`width` features) is cut into along its
    last dim: by `split`, `split_with_sizes`, `chunk`, slices covering it, or a reshape into
    (3, ...); None when it is not cut so."""
    aten = torch.ops.aten
    slices = []
    for func, in_shape, out_shape, extra in uses:
        last = len(in_shape) - 1

        def on_last(dim: int, rank: int = len(in_shape)) -> bool:
            return dim % rank == rank - 1

        if func in (aten.split.Tensor, aten.chunk.default) and extra and on_last(extra[1] if len(extra) > 1 else 0):
            size = extra[0] if func is aten.split.Tensor else -(-width // extra[0])
            return (size,) * (width // size) + ((width % size,) if width % size else ())
        if func is aten.split_with_sizes.default and extra and on_last(extra[1] if len(extra) > 1 else 0):
            return tuple(extra[0])
        if func is aten.slice.Tensor:
            dim, start, end, step = (*extra, None, None, None, None)[:4]
            if on_last(dim or 0) and step in (None, 1):
                slices.append((start or 0, width if end is None else min(end, width)))
        elif (func in VIEWS and not slices and out_shape is not None and len(out_shape) > last + 1
              and tuple(out_shape[:last]) == tuple(in_shape[:last]) and out_shape[last] == 3):
            return (width // 3,) * 3
    slices.sort()
    if not slices or slices[0][0] != 0 or slices[-1][1] != width:
        return None
    if any(a[1] != b[0] for a, b in zip(slices, slices[1:])):
        return None
    return tuple(end - start for start, end in slices)


def _groups(first_use, width: int, head_dim: int, num_heads: int) -> int:
    """The number of groups when a fused q/k/v output is first reshaped into (groups, ...) each of
    whole query heads and their key and value heads (per head: Megatron-LM's and the zoo's layout;
    per key/value group: Falcon's `new_decoder_architecture`), else 0."""
    if first_use is None:
        return 0
    func, in_shape, out_shape, _ = first_use
    if func not in VIEWS:
        return 0
    lead = len(in_shape) - 1
    if out_shape is None or len(out_shape) <= lead + 1 or tuple(out_shape[:lead]) != tuple(in_shape[:lead]):
        return 0
    groups = out_shape[lead]
    if groups < 1 or width % groups or num_heads % groups:
        return 0
    per_group = width // groups  # its query heads, one key head and one value head
    return groups if per_group == (num_heads // groups + 2) * head_dim else 0


