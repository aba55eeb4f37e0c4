"""Attention with what scaled_dot_product_attention cannot say: logit soft-capping (Gemma 2), a
sliding window (Gemma 2/3, GPT-OSS, Mistral), and per-head attention sinks (GPT-OSS), as one torch
operator, `autoplan::attention(q, k, v, sinks, scale, causal, window, softcap, offset)`.

q is (batch, heads, queries, head_dim), k and v (batch, heads, keys, head_dim) with as many heads
(a model repeats grouped key/value heads first). Query i sits `offset` positions after key i: it
sees key j when j <= i + offset (causal) and j > i + offset - window (a window of `window` tokens,
itself included: transformers' masking_utils `sliding_window_overlay`, `kv_idx > q_idx -
sliding_window`; 0 for none). The logits are `scale * q k^T`, soft-capped to `softcap * tanh(logit /
softcap)` when softcap > 0 (transformers' gemma2 `eager_attention_forward`); a head's sink joins the
softmax's denominator as a logit of a key with no value (transformers' gpt_oss
`eager_attention_forward`: the sink column is concatenated to the logits and dropped after the
softmax). One process calls it with offset 0; context parallelism (runtime/parallel/context.py) calls it per
local chunk against the gathered keys, with the chunk's true position as the offset, so the window
and causality are measured in positions of the whole sequence.

Why an operator, not the model's eager code: the runtime must find and reroute every attention
call of a traced graph (runtime/parallel/context.py `route_attention`), the profiler must price it as
attention (a FLOP formula: torch's SDPA formula, `sdpa_flop_count`, which counts the whole score
matrix as it does for the fused kernels), the tensor-parallel analysis must see where q, k and v
meet (graph/data_flow.py follows it as an attention kernel), and DTensor must run it on a rank's
heads (the sharding rule below: heads on dim 1 of q, k, v, dim 0 of the sinks). An eager body
inlines into matmuls, a tanh and a softmax that none of these can tell from other code.

The kernels are the math path: the scores are written out, a block of queries at a time (at most
`_BLOCK_SCORES` of them, over only the keys the block sees), on a GPU too (a flash kernel with
soft-capping and sinks is not built). Under cp a chunk's keys start at its window's
first key, so a chunk computes over its window only (the all-gather still brings every rank the
whole sequence's keys and values). The softmax runs in float32 (float64 for float64 inputs), as
transformers' eager attention does for Gemma; the backward recomputes the probabilities from the
saved log-sum-exp and uses D = rowsum(dO * O) (the flash-attention backward, Dao et al. 2022,
arXiv:2205.14135 Alg. 4, without tiling).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["attention", "is_attention_op"]


def _visible(q_len: int, k_len: int, causal: bool, window: int, offset: int, device) -> torch.Tensor | None:
    """(q_len, k_len) bool: which keys each query sees, or None when it sees every key."""
    if not causal and window <= 0:
        return None
    i = torch.arange(q_len, device=device).unsqueeze(1) + offset
    j = torch.arange(k_len, device=device).unsqueeze(0)
    seen = j <= i if causal else torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if window > 0:
        seen = seen & (j > i - window)
    return seen


def _acc(t: torch.Tensor) -> torch.Tensor:
    """At least float32: the precision the softmax and its gradient are computed in."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _logits(q, k, scale, softcap):
    """The (soft-capped) logits, at least float32, and tanh of the uncapped ones (what the backward
    needs)."""
    s = torch.matmul(_acc(q), _acc(k).transpose(-2, -1)) * scale
    if softcap > 0:
        t = torch.tanh(s / softcap)
        return softcap * t, t
    return s, None


def _probabilities(q, k, sinks, scale, causal, window, softcap, offset):
    """Probabilities (at least float32, masked keys 0), the row log-sum-exp (sink included), and tanh."""
    s, t = _logits(q, k, scale, softcap)
    seen = _visible(q.shape[-2], k.shape[-2], causal, window, offset, q.device)
    if seen is not None:
        s = s.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sink = sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1, keepdim=True)
    else:
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.exp(s - lse), lse, t


_BLOCK_SCORES = 1 << 26
"""Scores (float32: 256 MiB) one block of queries writes out at most, over all batch rows and heads."""


def _blocks(q: torch.Tensor, k: torch.Tensor, causal: bool, window: int, offset: int):
    """(first row, end row, first key, end key): blocks of queries whose scores fit `_BLOCK_SCORES`,
    each over only the keys some query of it sees (causality and the window bound them)."""
    num_rows, num_keys = q.shape[-2], k.shape[-2]
    step = max(1, min(num_rows, _BLOCK_SCORES // max(1, q.shape[:-2].numel() * num_keys)))
    for r0 in range(0, num_rows, step):
        r1 = min(num_rows, r0 + step)
        k0 = min(num_keys, max(0, r0 + offset - window + 1)) if window > 0 else 0
        k1 = min(num_keys, r1 + offset) if causal else num_keys
        yield (r0, r1, k0, k1) if k1 > k0 else (r0, r1, 0, num_keys)


@torch.library.custom_op("autoplan::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, scale: float,
               causal: bool, window: int, softcap: float, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty(*q.shape[:-1], v.shape[-1], dtype=v.dtype)
    lse = q.new_empty(q.shape[:-1], dtype=torch.promote_types(q.dtype, torch.float32))
    for r0, r1, k0, k1 in _blocks(q, k, causal, window, offset):
        p, block_lse, _ = _probabilities(q[..., r0:r1, :], k[..., k0:k1, :], sinks, scale, causal, window, softcap,
                                         offset + r0 - k0)
        out[..., r0:r1, :] = torch.matmul(p.to(v.dtype), v[..., k0:k1, :])
        lse[..., r0:r1] = block_lse.squeeze(-1)
    return out, lse


@_attention.register_fake
def _(q, k, v, sinks, scale, causal, window, softcap, offset):
    lse_dtype = torch.promote_types(q.dtype, torch.float32)
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=lse_dtype)


@torch.library.custom_op("autoplan::attention_backward", mutates_args=())
def _attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, sinks: torch.Tensor | None, scale: float, causal: bool, window: int,
                        softcap: float, offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = lse.dtype
    g = grad.to(acc)
    # d logit_j = p_j (dP_j - D) with D = sum_j p_j dP_j = <grad, out> (the sink's dP is 0, its value none)
    delta = (g * out.to(acc)).sum(-1, keepdim=True)
    grad_q = torch.zeros(q.shape, dtype=acc, device=q.device)
    grad_k = torch.zeros(k.shape, dtype=acc, device=k.device)
    grad_v = torch.zeros(v.shape, dtype=acc, device=v.device)
    for r0, r1, k0, k1 in _blocks(q, k, causal, window, offset):
        qb, kb, vb, gb = q[..., r0:r1, :], k[..., k0:k1, :], v[..., k0:k1, :], g[..., r0:r1, :]
        s, t = _logits(qb, kb, scale, softcap)
        p = torch.exp(s - lse[..., r0:r1].unsqueeze(-1))
        seen = _visible(r1 - r0, k1 - k0, causal, window, offset + r0 - k0, q.device)
        if seen is not None:
            p = p.masked_fill(~seen, 0.0)
        grad_v[..., k0:k1, :] += torch.matmul(p.transpose(-2, -1), gb)
        ds = p * (torch.matmul(gb, vb.to(acc).transpose(-2, -1)) - delta[..., r0:r1, :])
        if t is not None:
            ds = ds * (1 - t * t)  # d(c tanh(x / c)) / dx
        grad_q[..., r0:r1, :] = torch.matmul(ds, kb.to(acc)) * scale
        grad_k[..., k0:k1, :] += torch.matmul(ds.transpose(-2, -1), qb.to(acc)) * scale
    grads = grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)
    if sinks is None:
        return *grads, q.new_empty(0)
    p_sink = torch.exp(sinks.to(acc).view(1, -1, 1) - lse)
    return *grads, (-(p_sink * delta.squeeze(-1))).sum(dim=(0, 2)).to(sinks.dtype)


@_attention_backward.register_fake
def _(grad, q, k, v, out, lse, sinks, scale, causal, window, softcap, offset):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(sinks) if sinks is not None else q.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, sinks, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.options = options


def _backward(ctx, grad, grad_lse):
    q, k, v, out, lse, sinks = ctx.saved_tensors
    grad_q, grad_k, grad_v, grad_sinks = _attention_backward(grad.contiguous(), q, k, v, out, lse, sinks, *ctx.options)
    return grad_q, grad_k, grad_v, grad_sinks if sinks is not None else None, None, None, None, None, None


_attention.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.autoplan.attention)
def _flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    """torch.utils.flop_counter's SDPA count (the whole score matrix, as for the fused kernels;
    the causal and window savings are the cost model's, graph/operators.py records `causal`)."""
    return sdpa_flop_count(q_shape, k_shape, v_shape)


@register_flop_formula(torch.ops.autoplan.attention_backward)
def _backward_flops(grad_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_shape, q_shape, k_shape, v_shape)


def _sharding(q, k, v, sinks, scale, causal, window, softcap, offset):
    """DTensor's rule: every rank its heads (dim 1 of q, k, v and the outputs, dim 0 of the sinks),
    or everything whole."""
    from torch.distributed.tensor import Replicate, Shard

    sink = (Shard(0) if sinks is not None else None, Replicate() if sinks is not None else None)
    heads = ([Shard(1), Shard(1)], [Shard(1)] * 3 + [sink[0]] + [None] * 5)
    whole = ([Replicate(), Replicate()], [Replicate()] * 3 + [sink[1]] + [None] * 5)
    return [heads, whole]


def _backward_sharding(grad, q, k, v, out, lse, sinks, scale, causal, window, softcap, offset):
    """The backward's rule, as the forward's: (grad, q, k, v, out, lse) -> (dq, dk, dv, dsinks)."""
    from torch.distributed.tensor import Replicate, Shard

    # without sinks the fourth output is an empty placeholder, the same on every rank
    heads = ([Shard(1)] * 3 + [Shard(0) if sinks is not None else Replicate()],
             [Shard(1)] * 6 + [Shard(0) if sinks is not None else None] + [None] * 5)
    whole = ([Replicate()] * 4, [Replicate()] * 6 + [Replicate() if sinks is not None else None] + [None] * 5)
    return [heads, whole]


def _register_sharding() -> None:
    try:
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:  # a torch built without distributed: nothing runs DTensor
        return
    register_sharding(torch.ops.autoplan.attention.default)(_sharding)
    register_sharding(torch.ops.autoplan.attention_backward.default)(_backward_sharding)


_register_sharding()


def is_attention_op(target) -> bool:
    """Whether an fx node's target is this operator's forward."""
    return target is torch.ops.autoplan.attention.default


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sinks: torch.Tensor | None = None,
              scale: float | None = None, causal: bool = True, window: int | None = None,
              softcap: float | None = None, offset: int = 0) -> torch.Tensor:
    """See the module docstring; `scale` defaults to 1 / sqrt(head_dim), `window` None or 0 for none."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.ops.autoplan.attention.default(q, k, v, sinks, scale, bool(causal), int(window or 0),
                                                float(softcap or 0.0), int(offset))[0]
