"""Initialization by parameter name ([Note: name-keyed init]) and materializing a meta-built model.

Apart from the models because it serves any model: the sources initialize a user's or a Hugging
Face model's stages by the same rule.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch
from torch import nn

from autoplan.models.common import INIT_STD
from autoplan.models.llama import RotaryEmbedding

__all__ = ["init_weights", "materialize"]

# ---------------------------------------------------------------------------------------------
# Initialization
#
# [Note: name-keyed init]
# Each parameter is drawn from its own CPU generator seeded by crc32(f"{seed}:{full name}"), so its
# value depends only on the seed and its name in the full model, never on which other parameters
# were initialized before it or on the device. A pipeline stage that materializes `layers.7` alone
# calls `init_weights(layer, seed, prefix="layers.7.")` and gets the full model's values. Drawing
# on the CPU and copying keeps CPU and CUDA runs bit-identical. Tied parameters are visited once,
# under their first name (`tok_embeddings.weight`); pass `aliases={"output.weight":
# "tok_embeddings.weight"}` when a stage holds an untied copy of a tied head.


def _param_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode())


@torch.no_grad()
def init_weights(
    module: nn.Module, seed: int = 0, prefix: str = "", aliases: Mapping[str, str] | None = None
) -> None:
    """Initialize every non-meta parameter of `module` from its full name `prefix + local name`.

    Weights ~ N(0, 0.02) (GPT-2; Megatron-LM), or N(0, 0.02 / sqrt(2 * num_layers)) for modules
    with an `init_std` attribute (residual output projections `proj`/`fc2`/`wo`/`w2`, Megatron-LM
    scaled_init_method_normal); biases zero; norm weights (and other 1-D non-bias parameters) one.
    Parameters on meta are skipped. Rotary buffers are recomputed.
    """
    norm_types = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d)
    seen: set[int] = set()
    for mod_name, mod in module.named_modules():
        for local, param in mod.named_parameters(recurse=False):
            if id(param) in seen or param.device.type == "meta":
                continue
            seen.add(id(param))
            name = prefix + (f"{mod_name}.{local}" if mod_name else local)
            name = (aliases or {}).get(name, name)
            if local.endswith("bias"):
                param.zero_()
            elif isinstance(mod, norm_types) or (param.dim() < 2 and not isinstance(mod, nn.Embedding)):
                param.fill_(1.0)  # norm scales (and other 1-D scales of user modules)
            else:
                std = getattr(mod, "init_stds", {}).get(local, getattr(mod, "init_std", INIT_STD))
                gen = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
                values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
                param.copy_(values)
    cache: dict = {}
    for mod in module.modules():
        if isinstance(mod, RotaryEmbedding) and mod.cos.device.type != "meta":
            mod.reset_buffers(cache)


def materialize(
    module: nn.Module, device: torch.device | str = "cpu", seed: int = 0, prefix: str = ""
) -> nn.Module:
    """Allocate a meta-built `module` on `device` and initialize it by name; returns `module`.

    `to_empty` may untie shared parameters, so modules with `tie_weights()` are re-tied first.
    """
    module.to_empty(device=device)
    for mod in module.modules():
        tie = getattr(mod, "tie_weights", None)
        if callable(tie):
            tie()
    init_weights(module, seed=seed, prefix=prefix)
    return module

