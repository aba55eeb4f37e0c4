"""A model file whose attention normalizes q and k (tests/test_tp_fused.py): per head after the
per-head view (`build_head`, Qwen3's q/k norm) or over the whole projection before it (`build_full`,
OLMo2's). Traced with fx, its layers called whole: tensor parallelism runs by module hooks."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn


class Attn(nn.Module):
    def __init__(self, d, hd, full):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.hd, self.full = hd, full
        self.qn = nn.RMSNorm(d if full else hd)
        self.kn = nn.RMSNorm(d if full else hd)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.full:
            q, k = self.qn(q), self.kn(k)
        q, k, v = (t.view(b, s, -1, self.hd).transpose(1, 2) for t in (q, k, v))
        if not self.full:
            q, k = self.qn(q), self.kn(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))



class Layer(nn.Module):
    def __init__(self, d, hd, full):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attn(d, hd, full)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.down(F.gelu(self.up(self.n2(x))))



class Model(nn.Module):
    def __init__(self, full, vocab=256, d=64, hd=16, depth=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, hd, full) for _ in range(depth))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        hidden = functools.reduce(lambda x, layer: layer(x), self.layers, self.emb(ids))
        return self.head(self.norm(hidden))



def build_head():
    return Model(full=False), (torch.randint(0, 256, (1, 32)),)


def build_full():
    return Model(full=True), (torch.randint(0, 256, (1, 32)),)
