"""examples/custom_model.py's model at test size, as a user's model file
(`tests/user_models/small_custom.py:build`): the same classes (nn.MultiheadAttention blocks in a
ModuleList), 4 blocks of width 64 instead of 12 of width 512. The example's own 46M parameters made
the user-path matrix's model-file case the slowest test of the default suite (136 s of 32 minutes);
what the case checks is the source (a file and a function), not the size."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_model.py"
_spec = importlib.util.spec_from_file_location("autoplan_example_custom_model_small", _EXAMPLE)
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)

VOCAB = 256


def build():
    model = _example.TinyTransformer(vocab=VOCAB, width=64, depth=4, heads=4)
    return model, (torch.randint(0, VOCAB, (1, 32)),)
