"""A user's model file that reads a tensor's value in its own top-level forward, outside any layer
(`tests/user_models/value_in_forward.py:build`). fx traces the `.item()` as a graph node, so the
failure comes only when the profile runs that node: the refusal names this file's line from the line
the tracer recorded for the node (issue 29, item 10; graph/trace.py, `_LeafTracer.create_node`)."""

from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, hidden: int = 16, num_layers: int = 3, classes: int = 4):
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(num_layers))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) / x.abs().max().item()


def build():
    return Net(), (torch.randn(2, 16),)
