"""What a model config may hold: the bounds of each field and the checks against them, and the
error a wrong model spec or config raises.

Apart from the configs because hf.py's configs share the same bounds (the sources import them
without importing the built-in models).
"""

from __future__ import annotations

import math

__all__ = ["LOWER_BOUNDS", "UPPER_BOUNDS", "ModelSpecError"]


class ModelSpecError(ValueError):
    """A model spec or model config is wrong; the message names the problem and the fix."""



UPPER_BOUNDS: dict[str, float] = {
    "num_layers": 1024,          # published dense and MoE models: at most 128 (Megatron-LM's 1T, arXiv:2104.04473)
    "hidden_size": 65536,        # at most 25600 (the same 1T model); PaLM 540B: 18432 (arXiv:2204.02311)
    "num_heads": 1024,           # at most 160 (the 1T model's 160 heads)
    "num_kv_heads": 1024,
    "ffn_hidden_size": 262144,   # 4 x the widest hidden size
    "vocab_size": 2**20,         # at most 262144 (Gemma 3's tokenizer)
    "max_seq_len": 2**24,        # at most 10M tokens (Llama 4 Scout's context)
    "rope_theta": 1e12,          # Llama 3: 5e5; long-context variants up to about 1e8
    "norm_eps": 1.0,
    "num_experts": 4096,         # at most 384 routed experts (Kimi K2, arXiv:2507.20534); DeepSeek-V3: 256
    "experts_per_token": 4096,   # checked against num_experts too
    "num_shared_experts": 64,    # DeepSeekMoE 16B: 2, DeepSeek-V3: 1 (arXiv:2401.06066, 2412.19437)
    "capacity_factor": 4096.0,   # above num_experts / experts_per_token nothing is dropped anyway
    "head_size": 1024,           # at most 256 (Gemma 2)
}
"""Largest value of each config field a spec may give: well above every published model (the
sources beside each), low enough that a model of these sizes still fits some cluster's memory
(about 5e13 parameters at the bounds) and that tracing it ends in seconds. Without them
`gpt:num_layers=99999999999999999999` traced for ever (issue "Faults and hostile input")."""


LOWER_BOUNDS: dict[str, tuple[int, str]] = {
    "vocab_size": (2, "a vocabulary of one token has nothing to predict: the cross-entropy loss is 0 and "
                      "no gradient flows"),
}
"""Smallest value (above 0) a field may take where 1 cannot train, with the reason (hf.py's
configs share these bounds)."""


def _check_lower_bound(name: str, value: float) -> None:
    low = LOWER_BOUNDS.get(name)
    if low is not None and value < low[0]:
        raise ModelSpecError(f"value {value!r} for {name} must be at least {low[0]} ({low[1]}); set {name}={low[0]} or more")


def check_positive(config: object, names: tuple[str, ...]) -> None:
    """Each field finite, above 0 (at least its LOWER_BOUNDS entry) and at most its UPPER_BOUNDS entry."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ModelSpecError(f"value {value!r} for {name} must be a finite number")
        if not value > 0:
            raise ModelSpecError(f"value {value!r} for {name} must be positive")
        _check_lower_bound(name, value)
        bound = UPPER_BOUNDS.get(name)
        if bound is not None and (value >= bound if name == "norm_eps" else value > bound):
            limit = "below 1" if name == "norm_eps" else f"at most {bound:,g}" if isinstance(bound, float) else \
                f"at most {bound:,}"
            raise ModelSpecError(f"value {value!r} for {name} must be {limit} (larger than any published model)")


def check_heads(hidden_size: int, num_heads: int) -> None:
    if hidden_size % num_heads:
        raise ModelSpecError(
            f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}; "
            f"choose num_heads dividing hidden_size"
        )

