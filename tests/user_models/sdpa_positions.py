"""A user's model file as context parallelism takes one (`tests/user_models/sdpa_positions.py:build`):
causal `F.scaled_dot_product_attention` with rotary position embeddings computed from a
`position_ids` argument of the forward, which the source feeds `arange(seq_len)` and the runtime
cuts to a rank's tokens under cp. `build_without_positions` is the same model computing its
positions with `torch.arange(seq)`: it cannot be told where its tokens are, and cp is refused."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, LAYERS = 128, 32, 4, 2


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, device=x.device).float() / half))
    angles = positions.float().unsqueeze(-1) * freqs  # (b, s, half)
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)  # (b, 1, s, half)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.out = nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = (proj(h).unflatten(-1, (HEADS, -1)).transpose(1, 2) for proj in self.qkv)
        q, k = _rotate(q, positions), _rotate(k, positions)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).flatten(2))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class PositionsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, position_ids)
        return self.head(self.norm(x))


class ArangeModel(PositionsModel):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # positions the model makes up itself
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return super().forward(input_ids, positions)


def build():
    ids = torch.randint(0, VOCAB, (1, 32))
    return PositionsModel(), (ids, torch.arange(32).unsqueeze(0))


def build_without_positions():
    return ArangeModel(), (torch.randint(0, VOCAB, (1, 32)),)
