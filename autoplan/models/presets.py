"""Published sizes of the built-in models, each with the paper and config it comes from.

Apart from the configs so that the citations beside each preset read as one table.
"""

from __future__ import annotations

from autoplan.models.config import GPTConfig, LlamaConfig, ModelConfig, MoEConfig

__all__ = ["PRESETS", "PRESET_SOURCES"]

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
    # theta and router loss weight from the HF config Qwen/Qwen3-30B-A3B; each head's queries and
    # keys RMS-normalised (Sec. 2: "QK-Norm"; transformers' Qwen3MoeAttention q_norm / k_norm).
    "qwen3-30b-a3b": MoEConfig(num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4, head_size=128,
                               ffn_hidden_size=768, vocab_size=151936, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6,
                               num_experts=128, experts_per_token=8, router_aux_loss_coef=0.001, qk_norm=True),
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
