"""What every export target shares: the result type, refusals, the plan's stages in layers, and the
model's shape as the targets' model definitions need it.

A target never falls back silently. Where it cannot state part of a plan it records a *difference*
(one sentence: what the plan says, what the written config does instead, and what that changes);
`export_plan` refuses an export with differences unless the user passed `--allow-approx`, and then
the differences head the written file and go to stderr. Where no nearest config exists (a model the
target does not have), the target raises `ExportError` itself.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from autoplan.plan import Plan

__all__ = [
    "Export",
    "ExportError",
    "Mismatch",
    "MoEShape",
    "TargetRefusal",
    "TransformerShape",
    "Findings",
    "collect_mismatches",
    "differ",
    "plan_summary",
    "model_kind",
    "model_shape",
    "moe_shape",
    "stage_blocks",
    "stage_layer_counts",
    "stage_layer_ranges",
    "stage_lines",
]


class ExportError(ValueError):
    """An export that cannot be made, in one line naming the problem and the fix; the CLI exits 2.
    `dims`: the plan fields the refusal depends on (as `Mismatch.dims`), where the target knows them."""

    def __init__(self, message: str = "", *, dims: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.dims = frozenset(dims)


class TargetRefusal(ExportError):
    """This target cannot run the plan at all (it has no such model, or no such parallelism), so no
    re-plan for the same target helps. `export_plan` completes the message with the targets that do
    write the plan, found by writing it with each of them, or says that none does (never a fixed
    list: a target named there must actually take the plan)."""


@dataclass(frozen=True)
class Export:
    """A written configuration."""

    target: str
    """The target's name, as `--to` takes it."""
    text: str
    """The file's contents; any differences are listed at its top."""
    command: str
    """The command line that runs the file (also written inside it)."""
    differences: tuple[str, ...] = ()
    """How the written config differs from the plan; empty when the target states the plan exactly."""
    notes: tuple[str, ...] = field(default=())
    """What the user must still supply (data, tokenizer, launcher), not a difference from the plan."""


# ---- what a target cannot run as planned ------------------------------------------------------

@dataclass(frozen=True)
class Mismatch:
    """One way a target cannot run a configuration as planned, found without the stage cuts: from
    the plan's degrees, schedule, memory options, job and model alone. Each target's `mismatches`
    lists them, and is the one source of truth for both its export (a difference in the file, or a
    refusal) and `autoplan suggest --target` (search/targets.py), which drops such configurations
    before cutting them."""

    dims: frozenset[str]
    """The plan fields it depends on (ParallelConfig's names, plus "model" and "job"): a search that
    varies none of them cannot avoid it."""
    text: str
    """The difference (or the refusal) in one sentence, as the export writes it."""
    error: type[ExportError] | None = None
    """The error the export raises (no nearest config), or None for a difference written with
    --allow-approx."""


class Findings(list):
    """A target's differences as `write` lists them (plain strings), each one that does not depend
    on the stage cuts also kept as a `Mismatch` with the plan fields it depends on (`differ`), for
    the target's `mismatches`."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[Mismatch] = []

    def differ(self, dims: Iterable[str], text: str) -> None:
        self.append(text)
        self.found.append(Mismatch(frozenset(dims), text))


def differ(differences: list[str], dims: Iterable[str], text: str) -> None:
    """`differences.differ(dims, text)`, or a plain append for a plain list of differences."""
    if isinstance(differences, Findings):
        differences.differ(dims, text)
    else:
        differences.append(text)


def collect_mismatches(configure: Callable[[Findings], None]) -> list[Mismatch]:
    """Run a target's config-level checks (`configure`, the very code its `write` runs, minus what
    needs the stage cuts) and return what they found: the differences, and a refusal as the last
    entry (`Mismatch.error`), with the fields it names ("model" when it names none)."""
    found = Findings()
    try:
        configure(found)
    except ExportError as exc:
        return [*found.found, Mismatch(exc.dims or frozenset({"model"}), str(exc), type(exc))]
    return list(found.found)


# ---- stages as layers ------------------------------------------------------------------------

_LAYER_RE = re.compile(r"^(?:.*\.)?layers\.(\d+)(?:\..*)?$")


def stage_blocks(plan: Plan) -> list[list[str]]:
    """The block names of every (virtual) stage, in stage order (stage s runs on pp rank s % pp)."""
    return [list(plan.block_names[s.first_block:s.end_block]) for s in plan.stages]


def _layer_indices(blocks: list[str]) -> list[int]:
    return sorted({int(m.group(1)) for b in blocks if (m := _LAYER_RE.match(b))})


def stage_layer_counts(plan: Plan) -> list[int]:
    """Transformer layers (distinct `layers.N` indices) per (virtual) stage, in stage order."""
    return [len(_layer_indices(blocks)) for blocks in stage_blocks(plan)]


def stage_layer_ranges(plan: Plan) -> list[range]:
    """The layer indices of every (virtual) stage as a range; raises ExportError if a stage's layers
    are not consecutive (a plan cuts a chain of blocks, so they always are)."""
    ranges = []
    for index, blocks in enumerate(stage_blocks(plan)):
        layers = _layer_indices(blocks)
        if layers and layers != list(range(layers[0], layers[-1] + 1)):
            raise ExportError(f"stage {index} holds layers {layers}, which are not consecutive; re-plan the model")
        ranges.append(range(layers[0], layers[-1] + 1) if layers else range(0))
    return ranges


# ---- comments every target writes ------------------------------------------------------------

def plan_summary(plan: Plan) -> list[str]:
    """Three lines: the plan, its layout, its prediction."""
    layout = (f"tp {plan.tp} x pp {plan.pp} x dp {plan.dp}"
              + (f" (cp {plan.cp}: {plan.replicas} replicas)" if plan.cp > 1 else "")
              + (f" (ep {plan.ep})" if plan.ep > 1 else "")
              + (f" (expert tp {plan.expert_tp})" if plan.expert_tp > 1 else "") + f"; {plan.schedule}"
              + (f" with {plan.virtual_stages} virtual stages per rank" if plan.virtual_stages > 1 else "")
              + f"; {plan.num_microbatches} micro-batch{'es' if plan.num_microbatches != 1 else ''} of {plan.micro_batch_size}; recompute {plan.recompute}; "
              f"zero {plan.zero}" + (f" (HSDP {plan.dp_replicate} x {plan.dp_shard})" if plan.dp_replicate > 1 else "")
              + ("; sequence parallel" if plan.sequence_parallel else "") + f"; {plan.job.dtype}")
    return [f"autoplan plan for {plan.model} on {plan.cluster.get('name', '?')} ({plan.num_gpus} GPUs)",
            layout,
            f"predicted: {plan.predicted.step_time_s:.4f} s/step, {plan.predicted.tokens_per_s:,.0f} tokens/s, "
            f"MFU {plan.predicted.mfu:.1%}, peak {plan.predicted.peak_memory_bytes / 2**30:.2f} GiB/GPU"]


def stage_lines(plan: Plan) -> list[str]:
    """One line per (virtual) stage: its pp rank and its blocks."""
    return [f"stage {s.index} (pp rank {s.pp_rank}): blocks {s.first_block}..{s.end_block - 1} "
            f"({s.first_block_name} .. {s.last_block_name})" for s in plan.stages]


# ---- the model's shape -----------------------------------------------------------------------

@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer as the targets' own model definitions describe one."""

    family: str
    """"llama" (RMSNorm, rotary positions, SwiGLU, no biases) or "gpt" (LayerNorm, learned
    positions, GELU MLP, biases)."""
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    max_seq_len: int
    """Positions the model accepts (learned position rows, or the rotary tables' length)."""
    tie_embeddings: bool
    norm_eps: float
    rope_theta: float | None = None
    """Rotary base; None for learned positions."""
    preset: str | None = None
    """The zoo preset the plan names unchanged (e.g. "llama3-8b"), else None."""
    hf_model_type: str | None = None
    """For `hf:` sources: the transformers model type (e.g. "llama")."""
    hf_path: str | None = None
    """For `hf:PATH` sources: the directory (or config.json) the plan was made from."""
    head_size: int | None = None
    """Width of one attention head where the model sets it apart from hidden_size / num_heads (a
    Hugging Face config's `head_dim`, e.g. Mistral NeMo's 128 beside 5120 / 32); None otherwise."""
    qk_norm: bool = False
    """Each head's queries and keys RMS-normalised before the rotary positions (Qwen3's `q_norm`,
    `k_norm`, over head_dim with the model's epsilon)."""

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads


# transformers model types whose decoder is Llama's (RMSNorm, rope, SwiGLU, GQA, no biases) and
# whose config uses Llama's field names (transformers' LlamaConfig, MistralConfig).
_HF_LLAMA_LIKE = ("llama", "mistral")


def model_shape(plan: Plan) -> TransformerShape | None:
    """The plan's model as a TransformerShape: zoo gpt / llama specs and presets, and `hf:` sources
    of a Llama-like model type (llama, mistral); None for anything else (model files, other
    Hugging Face types, the zoo's mixtures of experts), which a target then refuses in its own words."""
    text = plan.model
    if text.startswith("hf:"):
        return _hf_shape(text)
    return _zoo_shape(text)


@functools.lru_cache(maxsize=64)
def _zoo_shape(text: str) -> TransformerShape | None:
    # A zoo spec is a pure string (a model file's is None below), so its shape is cached: the search
    # for one target asks for it once per configuration (search/targets.py).
    from autoplan import models as zoo

    try:
        spec = zoo.parse_model_spec(text)
    except zoo.ModelSpecError:
        return None
    config = spec.config
    if config is None:  # a model file
        return None
    preset = spec.name if spec.name in zoo.PRESETS else None
    if isinstance(config, zoo.MoEConfig):  # a mixture of experts: no dense shape to state
        return None
    if isinstance(config, zoo.LlamaConfig):
        return TransformerShape("llama", config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
                                config.ffn_hidden_size, config.vocab_size, config.max_seq_len, config.tie_embeddings,
                                config.norm_eps, rope_theta=config.rope_theta, preset=preset, qk_norm=config.qk_norm)
    return TransformerShape("gpt", config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
                            config.ffn_hidden_size, config.vocab_size, config.max_seq_len, config.tie_embeddings,
                            config.norm_eps, preset=preset)


@dataclass(frozen=True)
class MoEShape:
    """The mixture-of-experts part of a zoo `moe` model (models/moe.py), beside its Llama decoder's
    TransformerShape: what a target's MoE layer needs to build the same experts and routing."""

    num_experts: int
    experts_per_token: int
    expert_ffn_hidden_size: int
    """Width of one expert (and of each shared expert)."""
    num_shared_experts: int
    capacity_factor: float
    dropless: bool
    """Every routed token computed (no capacity, no drops); else capacity routing."""
    aux_loss_coef: float
    normalize_top_k: bool
    """The chosen experts' probabilities rescaled to sum to 1 (softmax, top-k, renormalise)."""


def moe_shape(plan: Plan) -> tuple[TransformerShape, MoEShape] | None:
    """The plan's model as a Llama decoder shape and its experts, for a zoo `moe` spec or preset or
    an `hf:` source of a mixture-of-experts type the targets build (`_hf_moe_shape`); None for
    anything else (`model_shape` covers the dense models)."""
    if plan.model.startswith("hf:"):
        return _hf_moe_shape(plan.model)
    return _zoo_moe_shape(plan.model)


@functools.lru_cache(maxsize=64)
def _zoo_moe_shape(text: str) -> tuple[TransformerShape, MoEShape] | None:
    from autoplan import models as zoo

    try:
        spec = zoo.parse_model_spec(text)
    except zoo.ModelSpecError:
        return None
    config = spec.config
    if not isinstance(config, zoo.MoEConfig):
        return None
    shape = TransformerShape("llama", config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
                             config.ffn_hidden_size, config.vocab_size, config.max_seq_len, config.tie_embeddings,
                             config.norm_eps, rope_theta=config.rope_theta,
                             preset=spec.name if spec.name in zoo.PRESETS else None,
                             head_size=config.head_size if config.head_size and config.head_size * config.num_heads
                             != config.hidden_size else None, qk_norm=config.qk_norm)
    experts = MoEShape(config.num_experts, config.experts_per_token, config.ffn_hidden_size,
                       config.num_shared_experts, config.capacity_factor, config.dropless,
                       config.router_aux_loss_coef, config.normalize_top_k)
    return shape, experts


# transformers model types whose layers are a Llama attention (Qwen3's with per-head q/k RMSNorm)
# and a mixture of SwiGLU experts routed by a softmax over the experts and top-k, with no shared
# expert and no bias: what the targets' MoE layers build (transformers' MixtralSparseMoeBlock /
# MixtralTopKRouter and Qwen3MoeSparseMoeBlock, modeling_mixtral.py / modeling_qwen3_moe.py).
_HF_MOE = ("mixtral", "qwen3_moe")


def _hf_config(text: str):
    """(source, config) of an `hf:` spec; ExportError in one line when it cannot be read."""
    from autoplan.sources import SourceError
    from autoplan.sources.hf import HFSource

    try:
        source = HFSource.from_spec(text)
    except (SourceError, ImportError) as exc:
        raise ExportError(f"cannot read the plan's model {text!r}: {exc}") from None
    return source, source._config


def _hf_decoder(source, config, ffn_hidden_size: int, qk_norm: bool = False) -> TransformerShape:
    """A Llama-like transformers config as a TransformerShape (its own field names: LlamaConfig's)."""
    heads = config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = float(theta if theta is not None else getattr(config, "rope_theta", 10000.0))
    # transformers' LlamaConfig / MistralConfig: `head_dim` defaults to hidden_size // heads and a
    # config may set another (the attention projections are heads x head_dim wide, not hidden_size).
    head_dim = getattr(config, "head_dim", None)
    return TransformerShape(
        "llama", config.num_hidden_layers, config.hidden_size, heads,
        getattr(config, "num_key_value_heads", None) or heads, ffn_hidden_size, config.vocab_size,
        config.max_position_embeddings, bool(getattr(config, "tie_word_embeddings", False)), float(config.rms_norm_eps),
        rope_theta=theta, hf_model_type=config.model_type, hf_path=str(source.path) if source.path is not None else None,
        head_size=int(head_dim) if head_dim and int(head_dim) * heads != config.hidden_size else None, qk_norm=qk_norm)


def _hf_moe_shape(text: str) -> tuple[TransformerShape, MoEShape] | None:
    """An `hf:` mixture of experts of a type in `_HF_MOE` as the targets build one; None for other
    types and for configurations that leave that shape: sliding-window attention, router jitter,
    biases, an activation other than SiLU, or Qwen3-MoE layers that keep a dense MLP
    (`decoder_sparse_step`, `mlp_only_layers`)."""
    source, config = _hf_config(text)
    model_type = getattr(config, "model_type", None)
    if model_type not in _HF_MOE:
        return None
    windowed = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    if (windowed or getattr(config, "router_jitter_noise", 0.0) or getattr(config, "attention_bias", False)
            or getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "decoder_sparse_step", 1) != 1
            or getattr(config, "mlp_only_layers", None)):
        return None
    # Every layer's MLP is the experts: the decoder's feed-forward width is theirs, as the zoo moe's.
    width = config.moe_intermediate_size if model_type == "qwen3_moe" else config.intermediate_size
    shape = _hf_decoder(source, config, width, qk_norm=model_type == "qwen3_moe")
    # Mixtral's router always renormalises the top k (MixtralTopKRouter); Qwen3-MoE's when
    # norm_topk_prob. Its balance loss enters the training loss only with output_router_logits.
    balance = float(config.router_aux_loss_coef) if getattr(config, "output_router_logits", False) else 0.0
    experts = MoEShape(int(config.num_local_experts), int(config.num_experts_per_tok), int(width), 0, 1.0, True, balance,
                       bool(getattr(config, "norm_topk_prob", True)) if model_type == "qwen3_moe" else True)
    return shape, experts


def _hf_shape(text: str) -> TransformerShape | None:
    source, config = _hf_config(text)
    model_type = getattr(config, "model_type", None)
    if model_type not in _HF_LLAMA_LIKE or getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return None
    return _hf_decoder(source, config, config.intermediate_size)


def model_kind(plan: Plan) -> str:
    """What the plan's model is, in a few words, for a target that refuses it ("a mixture of experts
    (moe)", "a model file", "a Hugging Face bert model", "a GPT-2 family decoder", "a Llama decoder")."""
    text = plan.model
    if text.startswith("hf:"):
        from autoplan.sources import SourceError
        from autoplan.sources.hf import HFSource

        try:
            model_type = getattr(HFSource.from_spec(text)._config, "model_type", None) or "?"
        except (SourceError, ImportError):
            return "a Hugging Face model"
        if model_type in _HF_LLAMA_LIKE:
            return f"a Hugging Face {model_type} model with attention or MLP biases"
        return f"a Hugging Face {model_type} model"
    from autoplan import models as zoo

    try:
        spec = zoo.parse_model_spec(text)
    except zoo.ModelSpecError:
        return "a model autoplan cannot read back"
    if spec.config is None:
        return "a model file"
    if isinstance(spec.config, zoo.MoEConfig):
        return "a mixture of experts"
    return "a Llama decoder" if isinstance(spec.config, zoo.LlamaConfig) else "a GPT-2 family decoder"
