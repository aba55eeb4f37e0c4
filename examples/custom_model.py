"""A user's own model for autoplan: a function returning (module, example_inputs).

    autoplan profile --model examples/custom_model.py:build
    autoplan suggest --model examples/custom_model.py:build --cluster 1x8xA100-80GB --global-batch 64 --seq-len 256

autoplan calls `build()` under `torch.device("meta")`, so nothing is allocated however large the model;
the repeated `blocks` list becomes one pipeline block per layer.
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 8192, width: int = 512, depth: int = 12, heads: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build():
    model = TinyTransformer()
    return model, (torch.randint(0, 8192, (1, 256)),)
