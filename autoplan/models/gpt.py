"""Megatron-LM's GPT as plain nn.Modules that build on meta at any size.

[Note: tensor-parallel friendly shapes] is here; llama.py's attention follows it too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoplan.models.common import INIT_STD, make_embedding
from autoplan.models.config import GPTConfig

__all__ = ["GPTAttention", "GPTLayer", "GPTMLP", "GPTModel"]

# ---------------------------------------------------------------------------------------------
# GPT (Megatron-LM)
#
# [Note: tensor-parallel friendly shapes]
# Head counts are inferred from the weight shapes at run time (`unflatten(-1, (-1, head_dim))`),
# and the fused QKV output is laid out per head as (head, {q,k,v}, head_dim) as in Megatron-LM, so
# a column-parallel shard of `qkv` / `wq` / `wk` / `wv` holds whole heads and the same code runs on
# a tensor-parallel shard without knowing the degree.


class GPTAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(h, 3 * h, bias=True)
        self.proj = nn.Linear(h, h, bias=True)
        # Megatron-LM scaled_init_method_normal: output projections of residual branches.
        self.proj.init_std = INIT_STD / math.sqrt(2 * config.num_layers)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.qkv(x).unflatten(-1, (-1, 3, self.head_dim)).permute(3, 0, 2, 1, 4)  # (3, b, nh, s, d)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return self.proj(out.transpose(1, 2).flatten(2))


class GPTMLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=True)
        self.fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=True)
        self.fc2.init_std = INIT_STD / math.sqrt(2 * config.num_layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class GPTLayer(nn.Module):
    """Pre-LN transformer layer: x + attn(LN(x)), then + mlp(LN(.))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attention = GPTAttention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GPTMLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))



class GPTModel(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = make_embedding(config.vocab_size, config.hidden_size)
        self.pos_embeddings = make_embedding(config.max_seq_len, config.hidden_size)
        self.layers = nn.ModuleList(GPTLayer(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok_embeddings(input_ids) + self.pos_embeddings(positions)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))

