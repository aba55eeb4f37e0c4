"""A user's model file that branches with `torch.cond` (`tests/user_models/cond_branches.py:build`):
inside each layer (a leaf the profile runs), or with `build_top` once in the top-level forward
(export traces it into the graph). Planning refuses it in one line naming the call's line and the
rewrite (graph/operators.py, [Note: higher-order operators]); it was a NotImplementedError
traceback ("no rule registered for HigherOrderOperator cond")."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int, gated: bool):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)
        self.gated = gated

    def forward(self, x):
        y = self.lin(x)
        if not self.gated:
            return torch.relu(y)
        return torch.cond(y.sum() > 0, lambda t: torch.relu(t), lambda t: t.clone(), (y,))


class Model(nn.Module):
    def __init__(self, hidden: int = 16, num_layers: int = 3, gated_layers: bool = True, gated_top: bool = False):
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.layers = nn.ModuleList([Block(hidden, gated_layers) for _ in range(num_layers)])
        self.head = nn.Linear(hidden, 4)
        self.gated_top = gated_top

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        if self.gated_top:
            x = torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t.clone(), (x,))
        return self.head(x)


def build():
    return Model(), (torch.randn(2, 16),)


def build_top():
    return Model(gated_layers=False, gated_top=True), (torch.randn(2, 16),)
