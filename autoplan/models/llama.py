"""Llama 2 / 3 as plain nn.Modules that build on meta at any size: rotary positions (read from
graph/positions.py under context parallelism), grouped-query attention, SwiGLU MLP.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoplan.graph.positions import sequence_positions
from autoplan.models.common import INIT_STD, make_embedding
from autoplan.models.config import LlamaConfig
from autoplan.models.ops import RMSNorm, swiglu

__all__ = ["LlamaAttention", "LlamaLayer", "LlamaMLP", "LlamaModel", "RotaryEmbedding"]

# ---------------------------------------------------------------------------------------------
# Llama


def _rope_tables(max_seq_len: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (max_seq_len, head_dim) in fp32, halves repeated (rotate_half layout;
    Su et al. 2021, RoFormer Eq. 34). Real arithmetic only: complex tensors break meta/fake tracing."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: Tensor) -> Tensor:
    halves = x.chunk(2, dim=-1)
    return torch.cat((-halves[1], halves[0]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary tables for one attention module, as non-persistent buffers (not in state_dict).

    Every layer owns a reference so a layer is self-contained (a pipeline stage needs nothing from
    the model's top); `init_weights` makes all layers share one tensor per device, so the memory is
    paid once.
    """

    def __init__(self, max_seq_len: int, head_dim: int, theta: float) -> None:
        super().__init__()
        self.max_seq_len, self.head_dim, self.theta = max_seq_len, head_dim, theta
        if torch.empty(0).device.type == "meta":
            # Built on meta (`build_model`): there are no values to compute, and computing them
            # runs meta reference kernels once per layer (about 5 ms each, plus torch._dynamo's
            # import, see `make_embedding`). `reset_buffers` fills them after materialization.
            cos = torch.empty(max_seq_len, head_dim, dtype=torch.float32)
            sin = torch.empty(max_seq_len, head_dim, dtype=torch.float32)
        else:
            cos, sin = _rope_tables(max_seq_len, head_dim, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def reset_buffers(self, cache: dict | None = None) -> None:
        """Recompute the tables in place of whatever `to_empty` left (reusing `cache` entries)."""
        key = (self.max_seq_len, self.head_dim, self.theta, self.cos.device, self.cos.dtype)
        if cache is not None and key in cache:
            cos, sin = cache[key]
        else:
            cos, sin = _rope_tables(self.max_seq_len, self.head_dim, self.theta)
            cos, sin = cos.to(self.cos.device, self.cos.dtype), sin.to(self.sin.device, self.sin.dtype)
            if cache is not None:
                cache[key] = (cos, sin)
        self.cos, self.sin = cos, sin

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate q and k of shape (b, heads, s, head_dim)."""
        # torch.narrow rather than `self.cos[:seq_len]`: fx does not proxy buffers by default, and a
        # real tensor cannot be sliced by a Proxy length, while a torch function call records one.
        seq_len = q.shape[2]
        positions = sequence_positions()  # a share of the sequence under context parallelism
        if positions is not None and positions.numel() == seq_len:
            cos = self.cos.index_select(0, positions.to(self.cos.device)).to(q.dtype)
            sin = self.sin.index_select(0, positions.to(self.sin.device)).to(q.dtype)
        else:
            cos = torch.narrow(self.cos, 0, 0, seq_len).to(q.dtype)
            sin = torch.narrow(self.sin, 0, 0, seq_len).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.num_rep = config.num_heads // config.num_kv_heads
        self.wq = nn.Linear(h, config.num_heads * d, bias=False)
        self.wk = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.wv = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.wo = nn.Linear(config.num_heads * d, h, bias=False)
        self.wo.init_std = INIT_STD / math.sqrt(2 * config.num_layers)
        # Qwen3's q/k norm: one RMSNorm of head_dim for every query head, one for every key head
        # (transformers' Qwen3MoeAttention `q_norm`, `k_norm`; torchtitan's qwen3 `qk_norm`). It
        # normalizes within a head, so under tp each rank normalizes its own heads with the whole
        # weight, whose gradient runtime/parallel/tensor_parallel.py sums over tp (`_sum_head_grads`).
        self.q_norm = RMSNorm(d, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, eps=config.norm_eps) if config.qk_norm else None
        self.rope = RotaryEmbedding(config.max_seq_len, d, config.rope_theta)

    def forward(self, x: Tensor) -> Tensor:
        # (b, s, heads * d) -> (b, heads, s, d); head counts from shapes, see [Note: tensor-parallel ...]
        q = self._heads(self.wq(x), self.q_norm)
        k = self._heads(self.wk(x), self.k_norm)
        v = self._heads(self.wv(x), None)
        q, k = self.rope(q, k)
        # Grouped-query attention (Ainslie et al. 2023) with the kernel reading each key/value head
        # for its num_rep query heads (`enable_gqa`): keys and values are kept for backward at their
        # own num_kv_heads, not repeated to the query heads (num_rep times the bytes), and context
        # parallelism gathers them at their own size, as Llama 3 does (runtime/parallel/context.py).
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.num_rep > 1)
        return self.wo(out.transpose(1, 2).flatten(2))

    def _heads(self, projected: Tensor, norm: nn.Module | None) -> Tensor:
        """(b, s, heads * d) -> (b, heads, s, d), normalized per head first when `norm` is given
        (after the per-head view, before the rotary positions: Qwen3's order)."""
        heads = projected.unflatten(-1, (-1, self.head_dim))
        if norm is not None:
            heads = norm(heads)
        return heads.transpose(1, 2)


class LlamaMLP(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False)
        self.w2.init_std = INIT_STD / math.sqrt(2 * config.num_layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))  # [Note: lean SwiGLU] in models/ops.py


class LlamaLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attention = LlamaAttention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LlamaModel(nn.Module):
    positions_from_context = True
    """Rotary positions come from `sequence_positions()` (graph/positions.py): context parallel."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = make_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))

