"""A user's model file whose layers branch on a tensor's value (`tests/user_models/branchy.py:build`):
planning runs the model on shapes only, so `autoplan suggest` refuses it in one line naming the
line below and the fix (issue 29, item 10). `build_mask` selects with a boolean mask instead (an
output shape that depends on values); `build_where` is the traceable rewrite the message advises."""

from __future__ import annotations

import torch
from torch import nn


class GatedLayer(nn.Module):
    def __init__(self, hidden: int, traceable: bool = False):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.traceable = traceable

    def forward(self, x):
        y = self.proj(x)
        if not self.traceable and y.sum() > 0:
            return torch.relu(y)
        if self.traceable:
            return torch.where(y.sum() > 0, torch.relu(y), y)
        return y


class GatedNet(nn.Module):
    def __init__(self, hidden: int = 16, num_layers: int = 3, classes: int = 4, traceable: bool = False,
                 mask: bool = False):
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.layers = nn.ModuleList(GatedLayer(hidden, traceable) for _ in range(num_layers))
        self.head = nn.Linear(hidden, classes)
        self.mask = mask

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self._keep_positive(x) if self.mask else x)

    @staticmethod
    def _keep_positive(x):
        return x + x[x > 0].mean()


def build():
    return GatedNet(), (torch.randn(2, 16),)


def build_mask():
    return GatedNet(traceable=True, mask=True), (torch.randn(2, 16),)


def build_where():
    return GatedNet(traceable=True), (torch.randn(2, 16),)
