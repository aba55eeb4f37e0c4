"""Small test models, each built to exercise one path of the tracer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Layer(nn.Module):
    def __init__(self, hidden: int, num_heads: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.num_heads = num_heads

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.num_heads, h // self.num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, h))


class SkipModel(nn.Module):
    """The embedding output is added back after layer 2: it crosses cuts 0, 1 and 2."""

    def __init__(self, hidden: int = 32, vocab: int = 64, num_layers: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        skip = x
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 2:
                x = x + skip
        return self.head(self.norm(x))


class ShapeBranchModel(SkipModel):
    """Branches on a shape: fx cannot (a Proxy has no truth value), torch.export can."""

    def forward(self, idx):
        x = self.emb(idx)
        if idx.shape[1] % 2 == 0:
            x = x * 2.0
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class ValueCheckModel(nn.Module):
    """A NaN check on values between layers defeats fx and export alike; its children are a chain."""

    def __init__(self, hidden: int = 32, vocab: int = 64, num_layers: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden) for _ in range(num_layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
            if not torch.isfinite(x).all():
                raise FloatingPointError("non-finite activations")
        return self.head(x)


class Untraceable(nn.Module):
    """Value-dependent control flow and no repeated layer list: nothing can cut it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else self.b(x)


class IntCrossingModel(nn.Module):
    """The sequence length (a Python int in the graph) is computed once and used by every layer."""

    def __init__(self, hidden: int = 16, num_layers: int = 3):
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.layers = nn.ModuleList(IntLayer(hidden) for _ in range(num_layers))

    def forward(self, x):
        n = x.size(1)
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x, n)
        return x


class IntLayer(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)

    def forward(self, x, n):
        return self.lin(x) / n
