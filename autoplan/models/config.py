"""The configs of the built-in models (GPT, Llama, mixture-of-experts Llama): frozen dataclasses,
a docstring per field, checked on construction against bounds.py.

Apart from the modules so that specs, presets and the planner read a model's shape without
building it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoplan.models.bounds import UPPER_BOUNDS, ModelSpecError, check_heads, check_positive

__all__ = ["GPTConfig", "LlamaConfig", "ModelConfig", "MoEConfig", "llama_ffn_hidden_size"]


@dataclass(frozen=True)
class GPTConfig:
    """Megatron-LM GPT: learned positions, pre-LayerNorm, GELU MLP, biases everywhere."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width h."""
    num_heads: int
    """Attention heads; must divide hidden_size."""
    ffn_hidden_size: int | None = None
    """MLP width; None means 4 * hidden_size (resolved at construction)."""
    vocab_size: int = 51200
    """Vocabulary size (51200: Megatron's GPT-2 BPE padded to a multiple of 1024)."""
    max_seq_len: int = 2048
    """Rows of the learned position embedding; the longest sequence the model accepts."""
    tie_embeddings: bool = True
    """Share the output projection with the token embedding."""
    norm_eps: float = 1e-5
    """LayerNorm epsilon."""

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        check_positive(
            self,
            (
                "num_layers",
                "hidden_size",
                "num_heads",
                "ffn_hidden_size",
                "vocab_size",
                "max_seq_len",
                "norm_eps",
            ),
        )
        check_heads(self.hidden_size, self.num_heads)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads


def llama_ffn_hidden_size(hidden_size: int, multiple_of: int = 256) -> int:
    """Llama's default MLP width: 2/3 of 4h (SwiGLU has three matrices), rounded up to
    `multiple_of` (facebookresearch/llama `model.py`, FeedForward)."""
    ffn = int(2 * 4 * hidden_size / 3)
    return multiple_of * ((ffn + multiple_of - 1) // multiple_of)


@dataclass(frozen=True)
class LlamaConfig:
    """Llama 2 / 3: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width h."""
    num_heads: int
    """Query heads; must divide hidden_size."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means num_heads. Must divide num_heads."""
    ffn_hidden_size: int | None = None
    """SwiGLU width; None means Llama's rule int(8h/3) rounded up to a multiple of 256."""
    vocab_size: int = 32000
    """Vocabulary size."""
    max_seq_len: int = 4096
    """Length the rotary tables are computed for; the longest sequence the model accepts."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the output projection with the token embedding."""
    qk_norm: bool = False
    """RMS-normalise each head's queries and keys over head_dim, with a learned scale of head_dim
    each (`q_norm`, `k_norm`), before the rotary positions: Qwen3's attention (transformers'
    models/qwen3_moe/modeling_qwen3_moe.py `Qwen3MoeAttention`). Off for Llama and Mixtral."""

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", llama_ffn_hidden_size(self.hidden_size))
        check_positive(
            self,
            (
                "num_layers",
                "hidden_size",
                "num_heads",
                "num_kv_heads",
                "ffn_hidden_size",
                "vocab_size",
                "max_seq_len",
                "rope_theta",
                "norm_eps",
            ),
        )
        check_heads(self.hidden_size, self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ModelSpecError(
                f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}; "
                f"choose num_kv_heads dividing num_heads"
            )
        if self.head_dim % 2:
            raise ModelSpecError(
                f"head_dim {self.head_dim} (hidden_size / num_heads) must be even for rotary embeddings"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """A Llama decoder whose MLPs are mixtures of experts: a router picks `experts_per_token` of
    `num_experts` SwiGLU experts per token (Mixtral, Jiang et al. 2024, arXiv:2401.04088; Qwen3-MoE),
    optionally beside always-used shared experts (DeepSeekMoE, Dai et al. 2024, arXiv:2401.06066).
    `ffn_hidden_size` is the width of one expert (and of each shared expert)."""

    head_size: int | None = None
    """Width of one attention head; None means hidden_size / num_heads (Qwen3 sets 128 beside a
    hidden size of 2048 and 32 heads)."""
    num_experts: int = 8
    """Routed experts per layer."""
    experts_per_token: int = 2
    """Experts each token is sent to (top-k)."""
    num_shared_experts: int = 0
    """Experts every token goes through besides the routed ones (DeepSeekMoE); 0 for none."""
    capacity_factor: float = 1.25
    """Each expert takes at most ceil(capacity_factor * seq_len * experts_per_token / num_experts)
    tokens of a sequence; the rest of its tokens skip that expert (pass through the residual).
    GShard (Lepikhin et al. 2020, arXiv:2006.16668, Sec. 2.2) and Switch Transformer (Fedus et al.
    2022, arXiv:2101.03961, Sec. 2.2; 1.25 in its Table 1). num_experts / experts_per_token or more
    drops nothing."""
    router_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (Switch Transformer Eq. 4: alpha = 0.01); 0 disables it."""
    normalize_top_k: bool = True
    """Rescale the chosen experts' router probabilities to sum to 1 (Mixtral, Qwen3-MoE)."""
    dropless: bool = False
    """Route every token to all of its experts, whatever their load (torchtitan's and Megatron-LM's
    default): a grouped GEMM over variable token counts (models/moe.py `RoutedExperts`). False keeps
    capacity routing ([Note: static dispatch]), whose fixed shapes the cost model prices;
    `capacity_factor` is then unused."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, ("num_experts", "experts_per_token", "capacity_factor")
                        + (("head_size",) if self.head_size is not None else ()))
        if self.experts_per_token > self.num_experts:
            raise ModelSpecError(
                f"experts_per_token {self.experts_per_token} exceeds num_experts {self.num_experts}; "
                f"choose experts_per_token <= num_experts"
            )
        for name in ("num_shared_experts", "router_aux_loss_coef"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ModelSpecError(f"value {value!r} for {name} must be 0 or more")
        if self.num_shared_experts > UPPER_BOUNDS["num_shared_experts"]:
            raise ModelSpecError(f"value {self.num_shared_experts} for num_shared_experts must be at most "
                                 f"{UPPER_BOUNDS['num_shared_experts']}")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads



ModelConfig = GPTConfig | LlamaConfig  # MoEConfig is a LlamaConfig
