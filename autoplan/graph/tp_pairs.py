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

Pair = tuple[str, tuple[tuple[str, int], ...], int, str, tuple[tuple[int, bool], ...]]
"""A column- and row-parallel pair found: (kind, counts, parts of a fused projection or 0, norm, the
blocks of a fused projection whose parts differ in size or are left whole: (features, whole) per
part, else ())."""


def attention_pair(flow: Flow, feeders: Sequence[str], b_in: int, src: frozenset,
                   shared: Sequence[str] = ()) -> Pair | str:
    """Column-parallel `feeders` of a row-parallel linear of width `b_in` through attention, or why
    not (one phrase): separate q, k and v projections, one fused projection laid out per head (or
    per key/value group), in blocks, or with one key/value head every query head shares
    ([Note: fused projections]); with `shared` (projections that feed the attention and other
    linears too, left whole: latent attention), per-head projections ([Note: latent attention])."""
    head_dim = next((d for k, d in flow.head_dim.items() if k <= set(feeders) | set(shared)), None)
    if shared:
        return _latent_pair(flow, feeders, b_in, src, head_dim)
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
        return "attention", (("num_heads", q),) + ((("num_kv_heads", kv),) if kv != q else ()), 0, norm, ()
    fused, width = feeders[0], flow.widths[feeders[0]][1]
    first = next(iter(flow.uses.get(fused, ())), None)
    groups = _groups(first, width, head_dim, q)
    if groups:  # per head or per key/value group: a contiguous shard holds whole groups
        return "attention", (("num_heads", q),) + ((("num_kv_heads", groups),) if groups != q else ()), 0, norm, ()
    sizes = _parts(flow.uses.get(fused, ()), width) or _shared_heads(first, width, head_dim, q)
    if sizes is None:
        return (f"its fused q/k/v projection '{fused}' is neither cut into q, k and v parts nor reshaped into "
                "groups of whole query, key and value heads, so autoplan cannot shard it by heads")
    if len(set(sizes)) == 1 and sizes[0] % head_dim == 0:  # [q | k | v] of equal parts: a strided shard
        return "attention", (("num_heads", sizes[0] // head_dim),), len(sizes), norm, ()
    if len(sizes) != 3 or any(n % head_dim for n in sizes) or sizes[0] != q * head_dim or sizes[1] != sizes[2]:
        return (f"its fused q/k/v projection '{fused}' is cut into parts {sizes} that are not q, k and v of whole "
                "heads")
    kv = sizes[1] // head_dim
    if kv == 1:  # multi-query: the one key/value head every query head shares stays whole on every rank
        return "attention", (("num_heads", q),), 3, norm, ((sizes[0], False), (sizes[1], True), (sizes[2], True))
    # grouped-query: rank r holds the query heads of its key/value groups and those key/value heads
    return ("attention", (("num_heads", q), ("num_kv_heads", kv)), 3, norm,
            tuple((n, False) for n in sizes))


def _latent_pair(flow: Flow, feeders: Sequence[str], b_in: int, src: frozenset, head_dim: int | None) -> Pair | str:
    """[Note: latent attention]: the per-head projections of an attention some of whose inputs come
    from projections left whole (DeepSeek's latent down-projections); each feeder and the output
    projection's input must hold a whole number of features per head."""
    if not head_dim:
        return "its projections' widths are not whole heads"
    if NORM in src:
        return "a normalization between its per-head projections and its output projection"
    # q's width is heads * head_dim; the others (k and v up-projections, the output's input) hold
    # their own features per head
    widths = [flow.widths[a][1] for a in feeders]
    heads = max((w // head_dim for w in widths if w % head_dim == 0
                 and all(x % (w // head_dim) == 0 for x in (*widths, b_in))), default=0)
    if not heads:
        return "its per-head projections' widths are not a whole number of features per head"
    return "attention", (("num_heads", heads),), 0, "", ()


def mlp_pair(flow: Flow, feeders: Sequence[str], b_in: int, src: frozenset) -> Pair | str:
    """Column-parallel `feeders` of a row-parallel linear of width `b_in` through element-wise ops
    (up/gate -> down), a fused gate/up projection cut into equal parts included, or why not."""
    if NORM in src:
        return "a normalization over the features between them needs the whole width"
    counts = (("ffn_hidden_size", b_in),)
    if all(flow.widths[a][1] == b_in for a in feeders):
        return "mlp", counts, 0, "", ()
    if len(feeders) == 1:
        sizes = _parts(flow.uses.get(feeders[0], ()), flow.widths[feeders[0]][1])
        if sizes and len(sizes) > 1 and set(sizes) == {b_in}:
            return "mlp", counts, len(sizes), "", ()
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
#   grouped-query attention) are sharded part by part as well: rank r holds [q_r | k_r | v_r], its
#   query heads of its key/value groups (query heads are grouped in order, head i reading key/value
#   head i // (heads / kv_heads)) and those key/value heads, which is the rank's slice of Megatron-
#   LM's fused QKV (megatron/core/transformer/attention.py, SelfAttention.get_query_key_value_tensors:
#   the weight is laid out per query group, [q heads of group g | k_g | v_g], so a contiguous 1/tp of
#   it is num_query_groups / tp whole groups). The model's own weight stays [q | k | v] (its
#   checkpoints, its `full_tensor()`); the layout lists each part's size (`TensorParallelLayout.
#   blocks`) and the runtime holds each rank's slices side by side ([Note: blocks of a fused
#   projection] in runtime/parallel/tensor_parallel_graph.py);
# - one key/value head every query head shares (multi-query: Falcon's `view(b, s, heads + 2,
#   head_dim)` with k and v the last two, or [q | k | v] parts of one head each, as GPT-BigCode's
#   `c_attn(x).unsqueeze(1).split((embed, head_dim, head_dim), dim=3)`, whose unsqueeze the data
#   flow sees through to the split): the query part is sharded, the key and value parts are left
#   whole on every rank (`_shared_heads`), as vLLM's QKVParallelLinear replicates key/value heads
#   when tp is at least their number (vllm/model_executor/layers/linear.py, `num_kv_head_replicas`);
#   their weights' gradients, of this rank's heads only, are summed over tp (runtime/
#   tensor_parallel_graph.py [Note: repeated whole heads] when they reach the attention repeated).
#
# [Note: latent attention]
# DeepSeek's multi-head latent attention (DeepSeek-V2 report, Sec. 2.1; transformers'
# DeepseekV3Attention) projects the hidden state down to latents (`q_a_proj`, `kv_a_proj_with_mqa`,
# whose last features are one rotary key head every query head shares) and up per head (`q_b_proj`,
# `kv_b_proj`) before `o_proj`. The down-projections feed other linears and the attention, so they
# pair with nothing: they stay whole on every rank (computed replicated), and the up-projections are
# column-parallel by heads with `o_proj` row-parallel, as Megatron-LM's MLASelfAttention builds
# linear_q_up_proj / linear_kv_up_proj column-parallel and, with Transformer Engine, its down-
# projections `parallel_mode='duplicated'` (whole on every tp rank;
# megatron/core/transformer/multi_latent_attention.py). The head count is the q projection's width
# over the head size (the q k^T inner dim); every per-head projection and the output projection's
# input hold a whole number of features per head (the value head may differ from the q/k head).


def _shared_heads(first_use, width: int, head_dim: int, num_heads: int) -> tuple[int, ...] | None:
    """[q | k | v] sizes when a fused output is first reshaped into (num_heads + 2, head_dim):
    num_heads query heads, then one key and one value head all queries share (Falcon's multi-query
    layout), else None."""
    if first_use is None:
        return None
    func, in_shape, out_shape, _ = first_use
    lead = len(in_shape) - 1
    if (func not in VIEWS or out_shape is None or len(out_shape) != lead + 2
            or tuple(out_shape[:lead]) != tuple(in_shape[:lead]) or tuple(out_shape[lead:]) != (num_heads + 2, head_dim)
            or width != (num_heads + 2) * head_dim):
        return None
    return num_heads * head_dim, head_dim, head_dim


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


