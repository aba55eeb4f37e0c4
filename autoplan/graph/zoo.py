"""Built-in models (Megatron GPT, Llama, mixture-of-experts Llama) at any size, and the model spec grammar.

A model spec names a model in one string, for the CLI and for configs:

    gpt2-small                               a preset
    llama3-8b:num_layers=4                   a preset with some fields overridden
    gpt:num_layers=2,hidden_size=64,num_heads=4,vocab_size=128
    path/to/model.py:make_model              a user file; `make_model()` -> (module, example_inputs)

Every built-in model is a plain `nn.Module` that builds on the meta device at any size (no memory
is allocated), traces with `torch.fx.symbolic_trace` with the repeated layers either as leaf
modules or fully inlined, and initializes deterministically by parameter *name*, so a pipeline
stage that materializes only its own layers gets the same values as the full model would
(see [Note: name-keyed init]).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import sys
import typing
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoplan.graph.aux_loss import attach_aux_loss
from autoplan.graph.positions import sequence_positions

__all__ = [
    "LOWER_BOUNDS",
    "UPPER_BOUNDS",
    "GPTConfig",
    "GPTLayer",
    "GPTModel",
    "LlamaConfig",
    "LlamaLayer",
    "LlamaModel",
    "MoEConfig",
    "MoEFeedForward",
    "MoEModel",
    "ModelSpec",
    "ModelSpecError",
    "PRESETS",
    "PRESET_SOURCES",
    "RotaryEmbedding",
    "build_model",
    "example_inputs",
    "example_targets",
    "init_weights",
    "lm_loss",
    "load_function",
    "load_user_model",
    "materialize",
    "model_info",
    "parse_model_spec",
]

INIT_STD = 0.02
"""Standard deviation of the normal init of weights (GPT-2; Megatron-LM `init_method_std`)."""


class ModelSpecError(ValueError):
    """A model spec or model config is wrong; the message names the problem and the fix."""


# ---------------------------------------------------------------------------------------------
# Configs


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


def _check_positive(config: object, names: tuple[str, ...]) -> None:
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


def _check_heads(hidden_size: int, num_heads: int) -> None:
    if hidden_size % num_heads:
        raise ModelSpecError(
            f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}; "
            f"choose num_heads dividing hidden_size"
        )


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
        _check_positive(
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
        _check_heads(self.hidden_size, self.num_heads)

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

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", llama_ffn_hidden_size(self.hidden_size))
        _check_positive(
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
        _check_heads(self.hidden_size, self.num_heads)
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

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, ("num_experts", "experts_per_token", "capacity_factor")
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


def expert_capacity(seq_len: int, experts_per_token: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens of one sequence one expert takes: ceil(capacity_factor * seq_len * k / E) (GShard
    Sec. 2.2, per group; a group here is one sequence), at least 1 and at most seq_len (a token
    picks an expert once)."""
    return max(1, min(seq_len, math.ceil(capacity_factor * seq_len * experts_per_token / num_experts)))


ModelConfig = GPTConfig | LlamaConfig  # MoEConfig is a LlamaConfig

# ---------------------------------------------------------------------------------------------
# GPT (Megatron-LM)
#
# [Note: tensor-parallel friendly shapes]
# Head counts are inferred from the weight shapes at run time (`unflatten(-1, (-1, head_dim))`),
# and the fused QKV output is laid out per head as (head, {q,k,v}, head_dim) as in Megatron-LM, so
# a column-parallel shard of `qkv` / `wq` / `wk` / `wv` holds whole heads and the same code runs on
# a tensor-parallel shard without knowing the degree.


class GPTAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(h, 3 * h, bias=True)
        self.proj = nn.Linear(h, h, bias=True)
        # Megatron-LM scaled_init_method_normal: output projections of residual branches.
        self.proj.init_std = INIT_STD / math.sqrt(2 * config.num_layers)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.qkv(x).unflatten(-1, (-1, 3, self.head_dim)).permute(3, 0, 2, 1, 4)  # (3, b, nh, s, d)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return self.proj(out.transpose(1, 2).flatten(2))


class GPTMLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=True)
        self.fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=True)
        self.fc2.init_std = INIT_STD / math.sqrt(2 * config.num_layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class GPTLayer(nn.Module):
    """Pre-LN transformer layer: x + attn(LN(x)), then + mlp(LN(.))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attention = GPTAttention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GPTMLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def _embedding(num_embeddings: int, dim: int) -> nn.Embedding:
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


class GPTModel(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = _embedding(config.vocab_size, config.hidden_size)
        self.pos_embeddings = _embedding(config.max_seq_len, config.hidden_size)
        self.layers = nn.ModuleList(GPTLayer(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok_embeddings(input_ids) + self.pos_embeddings(positions)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


# ---------------------------------------------------------------------------------------------
# Llama


def _rope_tables(max_seq_len: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (max_seq_len, head_dim) in fp32, halves repeated (rotate_half layout;
    Su et al. 2021, RoFormer Eq. 34). Real arithmetic only: complex tensors break meta/fake tracing."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: Tensor) -> Tensor:
    halves = x.chunk(2, dim=-1)
    return torch.cat((-halves[1], halves[0]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary tables for one attention module, as non-persistent buffers (not in state_dict).

    Every layer owns a reference so a layer is self-contained (a pipeline stage needs nothing from
    the model's top); `init_weights` makes all layers share one tensor per device, so the memory is
    paid once.
    """

    def __init__(self, max_seq_len: int, head_dim: int, theta: float) -> None:
        super().__init__()
        self.max_seq_len, self.head_dim, self.theta = max_seq_len, head_dim, theta
        if torch.empty(0).device.type == "meta":
            # Built on meta (`build_model`): there are no values to compute, and computing them
            # runs meta reference kernels once per layer (about 5 ms each, plus torch._dynamo's
            # import, see `_embedding`). `reset_buffers` fills them after materialization.
            cos = torch.empty(max_seq_len, head_dim, dtype=torch.float32)
            sin = torch.empty(max_seq_len, head_dim, dtype=torch.float32)
        else:
            cos, sin = _rope_tables(max_seq_len, head_dim, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def reset_buffers(self, cache: dict | None = None) -> None:
        """Recompute the tables in place of whatever `to_empty` left (reusing `cache` entries)."""
        key = (self.max_seq_len, self.head_dim, self.theta, self.cos.device, self.cos.dtype)
        if cache is not None and key in cache:
            cos, sin = cache[key]
        else:
            cos, sin = _rope_tables(self.max_seq_len, self.head_dim, self.theta)
            cos, sin = cos.to(self.cos.device, self.cos.dtype), sin.to(self.sin.device, self.sin.dtype)
            if cache is not None:
                cache[key] = (cos, sin)
        self.cos, self.sin = cos, sin

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate q and k of shape (b, heads, s, head_dim)."""
        # torch.narrow rather than `self.cos[:seq_len]`: fx does not proxy buffers by default, and a
        # real tensor cannot be sliced by a Proxy length, while a torch function call records one.
        seq_len = q.shape[2]
        positions = sequence_positions()  # a share of the sequence under context parallelism
        if positions is not None and positions.numel() == seq_len:
            cos = self.cos.index_select(0, positions.to(self.cos.device)).to(q.dtype)
            sin = self.sin.index_select(0, positions.to(self.sin.device)).to(q.dtype)
        else:
            cos = torch.narrow(self.cos, 0, 0, seq_len).to(q.dtype)
            sin = torch.narrow(self.sin, 0, 0, seq_len).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.num_rep = config.num_heads // config.num_kv_heads
        self.wq = nn.Linear(h, config.num_heads * d, bias=False)
        self.wk = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.wv = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.wo = nn.Linear(config.num_heads * d, h, bias=False)
        self.wo.init_std = INIT_STD / math.sqrt(2 * config.num_layers)
        self.rope = RotaryEmbedding(config.max_seq_len, d, config.rope_theta)

    def forward(self, x: Tensor) -> Tensor:
        # (b, s, heads * d) -> (b, heads, s, d); head counts from shapes, see [Note: tensor-parallel ...]
        q = self.wq(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        k = self.wk(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        v = self.wv(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        q, k = self.rope(q, k)
        if self.num_rep > 1 and sequence_positions() is not None:
            # Under context parallelism the kernel reads each key/value head for its num_rep query
            # heads (`enable_gqa`), so the runtime gathers keys and values at their own size, as
            # Llama 3 does (runtime/context.py).
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            if self.num_rep > 1:  # grouped-query attention (Ainslie et al. 2023)
                k = k.repeat_interleave(self.num_rep, dim=1)
                v = v.repeat_interleave(self.num_rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).flatten(2))


class LlamaMLP(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.ffn_hidden_size, bias=False)
        self.w2.init_std = INIT_STD / math.sqrt(2 * config.num_layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attention = LlamaAttention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LlamaModel(nn.Module):
    positions_from_context = True
    """Rotary positions come from `sequence_positions()` (graph/positions.py): context parallel."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = _embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


# ---------------------------------------------------------------------------------------------
# Mixture of experts
#
# [Note: static dispatch]
# Tokens reach their experts through buffers of fixed shape: each expert takes at most `capacity`
# tokens of each sequence (`expert_capacity`), in token order, and a token over an expert's
# capacity skips it (GShard, arXiv:2006.16668, Algorithm 1 with one group per sequence). Fixed
# shapes let the model build and trace on meta, let FlopCounterMode count the experts' FLOPs at
# the capacity the run uses, and make expert parallelism one `all_to_all` of equal splits. One
# group per sequence makes the dropping, and the load-balancing loss computed per sequence
# (DeepSeek-V3's sequence-wise balance loss, arXiv:2412.19437 Eq. 17-20, with Switch's weighting),
# independent of how the batch is split into micro-batches and data-parallel shards, so a
# pipelined run reproduces a single-process one exactly.


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs stored as stacked matrices, applied to tokens grouped by expert:
    input (experts, tokens, h) -> (experts, tokens, h), one batched matmul per matrix.

    The leading dimension of every parameter and of the input is the expert, so an expert-parallel
    runtime can keep a slice of the experts on each rank and exchange the token groups (the
    contract `runtime/experts.py` relies on; torchtitan's GroupedExperts has the same layout)."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        # Megatron-LM scaled_init_method_normal for the output projection, as in LlamaMLP.
        self.init_stds = {"w2": INIT_STD / math.sqrt(2 * num_layers)}

    def forward(self, tokens: Tensor) -> Tensor:
        return torch.bmm(F.silu(torch.bmm(tokens, self.w1)) * torch.bmm(tokens, self.w3), self.w2)


class MoEFeedForward(nn.Module):
    """Top-k routing (Shazeer et al. 2017, arXiv:1701.06538) to GroupedExperts, plus shared experts;
    see [Note: static dispatch]."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.num_experts, self.top_k = config.num_experts, config.experts_per_token
        self.capacity_factor, self.aux_loss_coef = config.capacity_factor, config.router_aux_loss_coef
        self.normalize_top_k = config.normalize_top_k
        self.router = nn.Linear(h, config.num_experts, bias=False)
        self.experts = GroupedExperts(config.num_experts, h, f, config.num_layers)
        self.shared_experts = None
        if config.num_shared_experts:
            shared = dataclasses.replace(config, ffn_hidden_size=f * config.num_shared_experts)
            self.shared_experts = LlamaMLP(shared)  # n shared experts = one MLP n times as wide (DeepSeekMoE)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        E, k = self.num_experts, self.top_k
        capacity = expert_capacity(s, k, E, self.capacity_factor)
        probs = self.router(x).float().softmax(dim=-1)  # (b, s, E)
        weights, chosen = probs.topk(k, dim=-1)  # (b, s, k)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        chosen = chosen.flatten(1)  # (b, s*k), token-major
        picks = torch.zeros(b, s * k, E, dtype=torch.int32, device=x.device).scatter_(2, chosen.unsqueeze(2), 1)
        place = ((picks.cumsum(1) - 1) * picks).sum(2)  # each pick's place in its expert's queue
        slot = torch.where(place < capacity, chosen * capacity + place, E * capacity)  # dropped -> spare slot
        index = slot.unsqueeze(2).expand(b, s * k, h)
        tokens = x.unsqueeze(2).expand(b, s, k, h).reshape(b, s * k, h)
        buffer = x.new_zeros(b, E * capacity + 1, h).scatter_add(1, index, tokens)
        grouped = buffer[:, :-1].reshape(b, E, capacity, h).transpose(0, 1).reshape(E, b * capacity, h)
        done = self.experts(grouped).reshape(E, b, capacity, h).transpose(0, 1).reshape(b, E * capacity, h)
        done = torch.cat([done, done.new_zeros(b, 1, h)], dim=1).gather(1, index)  # the spare slot gives 0
        out = (done.view(b, s, k, h) * weights.to(done.dtype).unsqueeze(3)).sum(dim=2)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.aux_loss_coef:
            # Switch Transformer's load-balancing loss (arXiv:2101.03961 Eq. 4-6), per sequence:
            # E * sum_e f_e * P_e with f_e the share of the sequence's picks routed to e (not
            # differentiable) and P_e its mean router probability; averaged over sequences.
            share = picks.float().mean(dim=1)
            balance = E * (share * probs.mean(dim=1)).sum(dim=1).mean()
            out = attach_aux_loss(out, self.aux_loss_coef * balance)
        return out


class MoELayer(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attention = LlamaAttention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.moe = MoEFeedForward(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.mlp_norm(x))


class MoEModel(LlamaModel):
    """LlamaModel with MoELayer layers."""

    def __init__(self, config: MoEConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.tok_embeddings = _embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MoELayer(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross entropy over all b * s positions (logits (b, s, V), targets (b, s))."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


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


# ---------------------------------------------------------------------------------------------
# Presets (published sizes)

# Shared by every Llama 3 size (Dubey et al. 2024, Table 3; vocabulary, context and RoPE theta from
# the HF configs, as the presets below cite).
_LLAMA3 = {"num_kv_heads": 8, "vocab_size": 128256, "max_seq_len": 8192, "rope_theta": 500000.0}

_GPT2_PAPER = "https://cdn.openai.com/better-language-models/language_models_are_unsupervised_multitask_learners.pdf"
_GPT3_PAPER = "https://arxiv.org/abs/2005.14165"
_MEGATRON_GPT3 = "https://github.com/NVIDIA/Megatron-LM/tree/main/examples/gpt3"
_LLAMA2_PAPER = "https://arxiv.org/abs/2307.09288"
_LLAMA3_PAPER = "https://arxiv.org/abs/2407.21783"

PRESETS: dict[str, ModelConfig] = {
    # GPT-2: Radford et al. 2019, Table 2 (117M and 1542M rows; 12 and 25 heads from the HF configs
    # `gpt2`, `gpt2-xl`); vocabulary 50257, context 1024 (n_positions).
    "gpt2-small": GPTConfig(num_layers=12, hidden_size=768, num_heads=12, vocab_size=50257, max_seq_len=1024),
    "gpt2-xl": GPTConfig(num_layers=48, hidden_size=1600, num_heads=25, vocab_size=50257, max_seq_len=1024),
    # GPT-3: Brown et al. 2020, Table 2.1 (layers, d_model, heads; context 2048 for every size);
    # vocabulary 51200, Megatron's GPT-2 BPE (50257) padded to a multiple of 1024, as the Megatron-LM
    # runs this project checks against use (the paper's tokenizer has 50257 entries).
    # 1.3B: the paper lists 24 heads of d_head 128 for d_model 2048 (24 * 128 != 2048, and 24 does not
    # divide 2048); we follow Megatron-LM / Megatron-DeepSpeed's published 1.3B config: 16 heads of 128.
    "gpt3-1.3b": GPTConfig(num_layers=24, hidden_size=2048, num_heads=16),
    "gpt3-6.7b": GPTConfig(num_layers=32, hidden_size=4096, num_heads=32),
    # 13B: the paper lists d_model 5140 with 40 heads of 128; Megatron-LM uses 5120 = 40 * 128.
    "gpt3-13b": GPTConfig(num_layers=40, hidden_size=5120, num_heads=40),
    "gpt3-175b": GPTConfig(num_layers=96, hidden_size=12288, num_heads=96),
    # Llama 2: Touvron et al. 2023, Table 1 (context 4096; 70B uses GQA with 8 KV heads); MLP widths,
    # vocabulary 32000 and eps 1e-5 from the HF configs meta-llama/Llama-2-{7b,13b,70b}-hf.
    "llama2-7b": LlamaConfig(num_layers=32, hidden_size=4096, num_heads=32, ffn_hidden_size=11008),
    "llama2-13b": LlamaConfig(num_layers=40, hidden_size=5120, num_heads=40, ffn_hidden_size=13824),
    "llama2-70b": LlamaConfig(
        num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672
    ),
    # Llama 3: "The Llama 3 Herd of Models" (Dubey et al. 2024), Table 3 (layers, model/FFN dims,
    # heads, 8 KV heads, RoPE theta 500000); pre-training context 8192 (Sec. 3.4.1: sequences of 8,192
    # tokens; the HF configs meta-llama/Meta-Llama-3-{8B,70B} give max_position_embeddings 8192), then
    # extended to 131072 in the last stage of pre-training (Sec. 3.4.2): the llama3.1 presets below
    # (RoPE scaling is not modelled; shapes and FLOPs are the same).
    # Vocabulary 128256 from the HF configs (405B: meta-llama/Llama-3.1-405B).
    "llama3-8b": LlamaConfig(num_layers=32, hidden_size=4096, num_heads=32, ffn_hidden_size=14336, **_LLAMA3),
    "llama3-70b": LlamaConfig(num_layers=80, hidden_size=8192, num_heads=64, ffn_hidden_size=28672, **_LLAMA3),
    "llama3-405b": LlamaConfig(num_layers=126, hidden_size=16384, num_heads=128, ffn_hidden_size=53248, **_LLAMA3),
    # Llama 3.1: the same models after the long-context stage (Dubey et al. 2024, Sec. 3.4.2: context
    # extended to 131,072 tokens); shapes as Llama 3, max_position_embeddings 131072 from the HF configs
    # meta-llama/Llama-3.1-{8B,70B,405B}. For plans at long context (context parallelism).
    "llama3.1-8b": LlamaConfig(num_layers=32, hidden_size=4096, num_heads=32, ffn_hidden_size=14336,
                               **{**_LLAMA3, "max_seq_len": 131072}),
    "llama3.1-70b": LlamaConfig(num_layers=80, hidden_size=8192, num_heads=64, ffn_hidden_size=28672,
                                **{**_LLAMA3, "max_seq_len": 131072}),
    "llama3.1-405b": LlamaConfig(num_layers=126, hidden_size=16384, num_heads=128, ffn_hidden_size=53248,
                                 **{**_LLAMA3, "max_seq_len": 131072}),
    # Mixtral: Jiang et al. 2024 (arXiv:2401.04088), Table 1 for 8x7B (8 experts, top 2, 32k context);
    # the rest of both from the HF configs mistralai/Mixtral-8x7B-v0.1 and -8x22B-v0.1 (vocabulary,
    # RoPE theta 1e6, 64k context and the router loss weight of 8x22B).
    "mixtral-8x7b": MoEConfig(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
                              vocab_size=32000, max_seq_len=32768, rope_theta=1e6, num_experts=8, experts_per_token=2,
                              router_aux_loss_coef=0.02),
    "mixtral-8x22b": MoEConfig(num_layers=56, hidden_size=6144, num_heads=48, num_kv_heads=8, ffn_hidden_size=16384,
                               vocab_size=32768, max_seq_len=65536, rope_theta=1e6, num_experts=8, experts_per_token=2,
                               router_aux_loss_coef=0.001),
    # Qwen3-30B-A3B: Qwen3 Technical Report (arXiv:2505.09388), Table 2 (48 layers, 32 / 4 heads, 128
    # experts, 8 routed, no shared experts); widths, head size 128, vocabulary, context 40960, RoPE
    # theta and router loss weight from the HF config Qwen/Qwen3-30B-A3B. Qwen3's q/k RMSNorm is
    # not modelled (2 * head_size parameters per layer).
    "qwen3-30b-a3b": MoEConfig(num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4, head_size=128,
                               ffn_hidden_size=768, vocab_size=151936, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6,
                               num_experts=128, experts_per_token=8, router_aux_loss_coef=0.001),
}

PRESET_SOURCES: dict[str, tuple[str, ...]] = {
    "gpt2-small": (_GPT2_PAPER, "https://huggingface.co/openai-community/gpt2/blob/main/config.json"),
    "gpt2-xl": (_GPT2_PAPER, "https://huggingface.co/openai-community/gpt2-xl/blob/main/config.json"),
    "gpt3-1.3b": (_GPT3_PAPER, _MEGATRON_GPT3),
    "gpt3-6.7b": (_GPT3_PAPER, _MEGATRON_GPT3),
    "gpt3-13b": (_GPT3_PAPER, _MEGATRON_GPT3),
    "gpt3-175b": (_GPT3_PAPER, _MEGATRON_GPT3),
    "llama2-7b": (_LLAMA2_PAPER, "https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json"),
    "llama2-13b": (_LLAMA2_PAPER, "https://huggingface.co/meta-llama/Llama-2-13b-hf/blob/main/config.json"),
    "llama2-70b": (_LLAMA2_PAPER, "https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json"),
    "llama3-8b": (_LLAMA3_PAPER, "https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json"),
    "llama3-70b": (_LLAMA3_PAPER, "https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json"),
    "llama3-405b": (_LLAMA3_PAPER, "https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json"),
    "llama3.1-8b": (_LLAMA3_PAPER, "https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json"),
    "llama3.1-70b": (_LLAMA3_PAPER, "https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json"),
    "llama3.1-405b": (_LLAMA3_PAPER, "https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json"),
    "mixtral-8x7b": ("https://arxiv.org/abs/2401.04088",
                     "https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json"),
    "mixtral-8x22b": ("https://arxiv.org/abs/2401.04088",
                      "https://huggingface.co/mistralai/Mixtral-8x22B-v0.1/blob/main/config.json"),
    "qwen3-30b-a3b": ("https://arxiv.org/abs/2505.09388", "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json"),
}
"""Where each preset's shapes and context length come from (paper, then model card or config)."""

_FAMILIES: dict[str, type] = {"gpt": GPTConfig, "llama": LlamaConfig, "moe": MoEConfig}
_MODELS: dict[type, type] = {GPTConfig: GPTModel, LlamaConfig: LlamaModel, MoEConfig: MoEModel}
_REQUIRED_KEYS = ("num_layers", "hidden_size", "num_heads")

# ---------------------------------------------------------------------------------------------
# Spec grammar


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model spec. `config` is set for gpt/llama/moe; `path` and `function` for files."""

    text: str
    """The spec as written."""
    family: str
    """One of "gpt", "llama", "moe", "file"."""
    config: ModelConfig | None
    path: str | None
    function: str | None
    name: str
    """Display name: the preset or family and the overridden keys, or `file_stem:function`."""


def _family_of(config: ModelConfig) -> str:
    return next(family for family, cls in _FAMILIES.items() if type(config) is cls)


def _parse_value(family: str, key: str, raw: str, type_hint: object) -> object:
    args = set(typing.get_args(type_hint)) or {type_hint}
    value = raw.strip()
    if type(None) in args and value.lower() in ("none", "auto"):
        return None
    if bool in args:
        if value.lower() in ("true", "1"):
            return True
        if value.lower() in ("false", "0"):
            return False
        raise ModelSpecError(f"value {raw!r} for {key} is not a boolean; use true/false/1/0")
    if int in args:
        try:
            return int(value)
        except ValueError:
            raise ModelSpecError(f"value {raw!r} for {key} is not an integer") from None
    if float in args:
        try:
            return float(value)
        except ValueError:
            raise ModelSpecError(f"value {raw!r} for {key} is not a number") from None
    raise AssertionError(f"no parser for {family}.{key}: {type_hint!r}")


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def parse_model_spec(text: str) -> ModelSpec:
    """Parse `NAME[:key=value,...]` (NAME a family or preset) or `path/to/file.py:function`."""
    if not isinstance(text, str) or not text.strip():
        raise ModelSpecError(f"empty model spec {text!r}; expected NAME[:key=value,...] or FILE.py:FUNCTION")
    text = text.strip()
    if ".py:" in text or text.endswith(".py"):
        return _parse_file_spec(text)
    name, sep, rest = text.partition(":")
    name = name.strip()
    known = sorted(_FAMILIES) + list(PRESETS)
    if name not in known:
        raise ModelSpecError(f"unknown model {name!r}{_did_you_mean(name, known)} known: {', '.join(known)}")
    base = PRESETS.get(name)
    family = _family_of(base) if base is not None else name
    cls = _FAMILIES[family]
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]

    overrides: dict[str, object] = {}
    if sep:
        for item in rest.split(","):
            key, eq, raw = item.partition("=")
            key = key.strip()
            if not eq or not key or not raw.strip():
                raise ModelSpecError(f"malformed spec {text!r}; expected NAME[:key=value,...]")
            if key not in valid:
                raise ModelSpecError(
                    f"unknown key {key!r} for {family}{_did_you_mean(key, valid)}; valid keys: {', '.join(valid)}"
                )
            if key in overrides:
                raise ModelSpecError(f"key {key!r} given twice in spec {text!r}; give each key once")
            overrides[key] = _parse_value(family, key, raw, hints[key])

    if base is None:
        missing = [k for k in _REQUIRED_KEYS if k not in overrides]
        if missing:
            raise ModelSpecError(
                f"spec {text!r} is missing required keys {', '.join(missing)}; e.g. "
                f"'{family}:num_layers=2,hidden_size=64,num_heads=4' or a preset ({', '.join(PRESETS)})"
            )
        config = cls(**overrides)
    else:
        values = {f.name: getattr(base, f.name) for f in dataclasses.fields(cls)}
        # The preset's MLP width belongs to its hidden size: a new width re-derives it unless given.
        if "hidden_size" in overrides and "ffn_hidden_size" not in overrides:
            values["ffn_hidden_size"] = None
        values.update(overrides)
        config = cls(**values)
    canonical = ",".join(f"{k}={overrides[k]}" for k in overrides)
    display = f"{name}:{canonical}" if canonical else name
    return ModelSpec(text=text, family=family, config=config, path=None, function=None, name=display)


def _parse_file_spec(text: str) -> ModelSpec:
    head, sep, function = text.rpartition(".py:")
    if not sep:
        raise ModelSpecError(f"file spec {text!r} names no function; expected path/to/file.py:FUNCTION")
    path = head + ".py"
    function = function.strip()
    if not function.isidentifier():
        raise ModelSpecError(
            f"malformed spec {text!r}; expected path/to/file.py:FUNCTION with FUNCTION a Python name"
        )
    if not Path(path).is_file():
        raise ModelSpecError(f"model file {path!r} does not exist (spec {text!r}); check the path")
    return ModelSpec(
        text=text,
        family="file",
        config=None,
        path=path,
        function=function,
        name=f"{Path(path).stem}:{function}",
    )


def _as_spec(spec: str | ModelSpec | ModelConfig) -> ModelSpec:
    if isinstance(spec, ModelSpec):
        return spec
    if isinstance(spec, GPTConfig | LlamaConfig):
        family = _family_of(spec)
        return ModelSpec(text=family, family=family, config=spec, path=None, function=None, name=family)
    return parse_model_spec(spec)


# ---------------------------------------------------------------------------------------------
# Building


def load_function(spec: str | ModelSpec) -> typing.Callable:
    """Import `path/to/file.py` of a file spec and return its FUNCTION (one-line errors)."""
    spec = _as_spec(spec)
    if spec.family != "file":
        raise ModelSpecError(f"{spec.text!r} names no file; expected path/to/file.py:FUNCTION")
    mod_name = f"autoplan_user_model_{zlib.crc32(str(Path(spec.path).resolve()).encode()):08x}"
    try:
        import_spec = importlib.util.spec_from_file_location(mod_name, spec.path)
        if import_spec is None or import_spec.loader is None:
            raise ImportError("not a Python file")
        user_module = importlib.util.module_from_spec(import_spec)
        sys.modules[mod_name] = user_module  # dataclasses and pickling look modules up here
        import_spec.loader.exec_module(user_module)
    except FileNotFoundError:
        raise ModelSpecError(f"model file {spec.path!r} does not exist; check the path") from None
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise ModelSpecError(f"importing {spec.path!r} failed: {type(e).__name__}: {e}") from e
    fn = getattr(user_module, spec.function, None)
    if not callable(fn):
        defined = [n for n, v in vars(user_module).items() if callable(v) and not n.startswith("_")]
        raise ModelSpecError(
            f"{spec.path!r} has no function {spec.function!r}{_did_you_mean(spec.function, defined)}"
            f" defined: {', '.join(defined) or 'none'}"
        )
    return fn


def load_user_model(
    spec: str | ModelSpec | ModelConfig, device: torch.device | str = "meta", *, with_loss: bool = False
) -> tuple:
    """(module, example_inputs) for any spec, or (module, example_inputs, loss_fn or None) with
    `with_loss`. File specs: import the file and call FUNCTION() under `torch.device(device)`; it
    returns (module, example_inputs) or (module, example_inputs, loss_fn). Built-in specs: the
    model and (input_ids,) of batch 1 and a sequence of min(max_seq_len, 128)."""
    spec = _as_spec(spec)
    if spec.family != "file":
        model = build_model(spec, device=device)
        inputs = example_inputs(spec, batch_size=1, seq_len=min(spec.config.max_seq_len, 128), device=device)
        return (model, inputs, lm_loss) if with_loss else (model, inputs)
    fn = load_function(spec)
    try:
        with torch.device(device):
            result = fn()
    except Exception as e:
        raise ModelSpecError(f"{spec.name}() raised {type(e).__name__}: {e}") from e
    if isinstance(result, tuple | list) and len(result) in (2, 3) and isinstance(result[0], nn.Module):
        module, inputs, *rest = result
        loss_fn = rest[0] if rest else None
        if isinstance(inputs, Tensor):
            inputs = (inputs,)
        if isinstance(inputs, tuple | list) and (loss_fn is None or callable(loss_fn)):
            return (module, tuple(inputs), loss_fn) if with_loss else (module, tuple(inputs))
    raise ModelSpecError(
        f"{spec.name}() must return (nn.Module, example_inputs tuple) or (nn.Module, example_inputs, loss_fn), "
        f"got {type(result).__name__}; return e.g. (model, (torch.randint(0, 100, (2, 16)),))"
    )


def build_model(
    spec: str | ModelSpec | ModelConfig,
    device: torch.device | str = "meta",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> nn.Module:
    """Build the model a spec names. Built-ins are constructed on meta and, for a real device,
    materialized and initialized by name with `seed` (see [Note: name-keyed init])."""
    spec = _as_spec(spec)
    if spec.family == "file":
        module, _ = load_user_model(spec, device=device)
        return module.to(dtype=dtype) if dtype != torch.float32 else module
    with torch.device("meta"):
        model = _MODELS[type(spec.config)](spec.config)
    if dtype != torch.float32:
        model.to(dtype=dtype)
    if torch.device(device).type != "meta":
        materialize(model, device=device, seed=seed)
    return model


def _check_shape(config: ModelConfig, batch_size: int, seq_len: int) -> None:
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if value <= 0:
            raise ModelSpecError(f"{name} {value} must be positive")
    if seq_len > config.max_seq_len:
        raise ModelSpecError(
            f"seq_len {seq_len} exceeds max_seq_len {config.max_seq_len}; raise it, e.g. ':max_seq_len={seq_len}'"
        )


def _token_ids(spec_or_config, batch_size: int, seq_len: int, device, salt: int) -> tuple[Tensor]:
    spec = _as_spec(spec_or_config)
    if spec.family == "file":
        raise ModelSpecError(
            f"{spec.name} is a user model; its example inputs come from load_user_model(), not batch/seq sizes"
        )
    config = spec.config
    _check_shape(config, batch_size, seq_len)
    if torch.device(device).type == "meta":
        return (torch.empty((batch_size, seq_len), dtype=torch.int64, device="meta"),)
    gen = torch.Generator(device="cpu").manual_seed(salt)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=gen, dtype=torch.int64)
    return (ids.to(device),)


def example_inputs(
    spec_or_config, batch_size: int, seq_len: int, device: torch.device | str = "meta"
) -> tuple[Tensor]:
    """(input_ids,) int64 of shape (batch_size, seq_len) in [0, vocab_size); deterministic off meta."""
    return _token_ids(spec_or_config, batch_size, seq_len, device, salt=1234)


def example_targets(
    spec_or_config, batch_size: int, seq_len: int, device: torch.device | str = "meta"
) -> Tensor:
    """Targets for `lm_loss`, int64 (batch_size, seq_len) in [0, vocab_size); deterministic off meta."""
    return _token_ids(spec_or_config, batch_size, seq_len, device, salt=4321)[0]


def model_info(spec: str | ModelSpec | ModelConfig) -> dict:
    """Shape facts of a spec: name, family, num_layers, hidden_size, num_heads, num_kv_heads,
    vocab_size, max_seq_len, ffn_hidden_size (None for file models); num_experts and
    experts_per_token (None but for mixture-of-experts models)."""
    spec = _as_spec(spec)
    keys = (
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "vocab_size",
        "max_seq_len",
        "ffn_hidden_size",
    )
    info: dict = {"name": spec.name, "family": spec.family}
    info.update({k: (getattr(spec.config, k) if spec.config is not None else None) for k in keys})
    info.update({k: getattr(spec.config, k, None) for k in ("num_experts", "experts_per_token")})
    return info
