"""What every built-in model shares: the init scale, an embedding that builds on meta for free,
and the language-model loss.

Apart so that gpt.py, llama.py and moe.py (and init.py) can use them without importing each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["INIT_STD", "lm_loss", "make_embedding"]

INIT_STD = 0.02
"""Standard deviation of the normal init of weights (GPT-2; Megatron-LM `init_method_std`)."""


def make_embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """nn.Embedding, without its normal_ initialization when built on meta.

    `build_model` constructs every model on meta, where values do not exist and `materialize`
    initializes by name later. nn.Embedding's own init calls normal_, whose meta kernel is a Python
    reference wrapped by torch._disable_dynamo, which imports torch._dynamo on first use (about 1 s
    on a 2-core machine, measured with torch 2.13 and -X importtime) for nothing. Passing the weight
    skips reset_parameters (torch/nn/modules/sparse.py); off meta the usual init runs.
    """
    if torch.empty(0).device.type == "meta":
        return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))
    return nn.Embedding(num_embeddings, dim)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross entropy over all b * s positions (logits (b, s, V), targets (b, s))."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
