"""torchtitan 0.3 export: a config-registry Python file and the torchrun command that runs it.

torchtitan 0.3 reads no TOML. A run is `torchrun ... -m torchtitan.train --module M --config F`:
`ConfigManager._load_config` (torchtitan/config/manager.py) imports `M` (a short model name or any
importable module path) and calls `F()` for a `Trainer.Config`. So the export is a module whose
`autoplan_plan()` returns the plan as a `Trainer.Config`, and a command line whose PYTHONPATH holds
the file's directory.

Every rule below names the torchtitan 0.3.0 code it follows. What torchtitan cannot state exactly is
a *difference* (common.py); a model torchtitan has no definition for is refused.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from autoplan.plan import Plan
from autoplan.report.export.common import (
    Export,
    ExportError,
    Findings,
    Mismatch,
    MoEShape,
    TargetRefusal,
    TransformerShape,
    collect_mismatches,
    model_kind,
    model_shape,
    moe_shape,
    plan_summary,
    stage_blocks,
    stage_lines,
)
from autoplan.schedule import schedule_spec

__all__ = ["CONFIG_FUNCTION", "DEFAULT_MODULE", "TORCHTITAN_VERSION", "mismatches", "write"]

TORCHTITAN_VERSION = "0.3.0"
CONFIG_FUNCTION = "autoplan_plan"
"""The config-registry function the file defines (`--config`)."""
DEFAULT_MODULE = "autoplan_torchtitan"
"""The module name the command line uses when the file goes to stdout (save it as this name + .py)."""

# torchtitan/models/llama3/__init__.py `llama3_configs`: the flavors and the shapes their builders
# (_8b, _70b, _405b) make. Hidden sizes are compute_ffn_hidden_dim(dim, multiple_of, ffn_dim_multiplier)
# (torchtitan/models/common/feed_forward.py): 8B: 1024, 1.3 -> 14336; 70B: 4096, 1.3 -> 28672;
# 405B: 4096, 1.2 -> 53248. Key: (layers, dim, heads, kv heads, ffn, vocab, rope theta, norm eps).
# tests/test_export_torchtitan.py checks this table against torchtitan's registry.
_FLAVORS: dict[tuple, str] = {
    (32, 4096, 32, 8, 14336, 128256, 500000.0, 1e-5): "8B",
    (80, 8192, 64, 8, 28672, 128256, 500000.0, 1e-5): "70B",
    (126, 16384, 128, 8, 53248, 128256, 500000.0, 1e-5): "405B",
}
_HF_ASSETS = "./assets/hf/Llama-3.1-8B"
"""The tokenizer directory torchtitan's own llama3 configs name (config_registry.py llama3_8b); a
placeholder the user overrides with --hf-assets-path."""
_DEFAULT_NORM_EPS = 1e-5
"""torchtitan/models/common/nn_modules.py `RMSNorm.Config.eps`; the llama3 builders leave it."""


def write(plan: Plan, *, filename: str | None = None) -> Export:
    """The plan as a torchtitan 0.3 config-registry module (see the module docstring)."""
    mixture = moe_shape(plan)
    shape = mixture[0] if mixture else _llama_shape(plan)
    module, directory, copy = _module_name(filename)
    settings = _Settings()
    fqns = _stage_fqns(plan) if plan.pp > 1 else None
    _configure(plan, settings, shape, mixture[1] if mixture else None)
    command = _command(plan, module, directory, filename if copy else None, copy)
    text = _render(plan, settings, fqns, command)
    return Export("torchtitan", text, command, tuple(settings.differences), tuple(_notes(plan, shape)))



def mismatches(plan) -> list[Mismatch]:
    """What torchtitan cannot run as planned in `plan`'s configuration, found by the code `write`
    runs (every rule but the stage cuts', which torchtitan takes as given: module_fqns_per_model_part).
    `plan` is a Plan, or any object with a ParallelConfig's fields, `job` and `model` (the search's
    configurations: search/targets.py)."""

    def configure(found: Findings) -> None:
        mixture = moe_shape(plan)
        shape = mixture[0] if mixture else _llama_shape(plan)
        _configure(plan, _Settings(differences=found), shape, mixture[1] if mixture else None)

    return collect_mismatches(configure)


def _configure(plan: Plan, settings: _Settings, shape: TransformerShape, experts: MoEShape | None) -> None:
    """Every setting of the file but the stages, each rule recording what it cannot state."""
    _model(plan, shape, settings, experts)
    _batch(plan, settings)
    _parallelism(plan, settings)
    _schedule(plan, settings)
    _recompute(plan, settings)
    _precision(plan, settings)


# ---- what torchtitan has a model for ---------------------------------------------------------

def _llama_shape(plan: Plan) -> TransformerShape:
    """torchtitan builds only its own model definitions (torchtitan/models/*); the dense decoder
    autoplan's Llamas are is `Llama3Model` (torchtitan/models/llama3/model.py)."""
    shape = model_shape(plan)
    # export_plan completes both refusals with the targets that do write this plan.
    if shape is None:
        raise TargetRefusal(f"torchtitan has no model for {plan.model} ({model_kind(plan)}); torchtitan "
                            f"{TORCHTITAN_VERSION} builds only its own model definitions, and autoplan exports to "
                            "its Llama3Model alone", dims={"model"})
    if shape.family != "llama":
        raise TargetRefusal(f"torchtitan has no model for {plan.model} (no GPT-2 family definition in torchtitan "
                            f"{TORCHTITAN_VERSION})", dims={"model"})
    return shape


# Module names `--module` would not resolve to the file: ConfigManager._load_config first looks a name
# up among torchtitan's own models and experiments (torchtitan.models._supported_models,
# torchtitan.experiments._supported_experiments), and a file named torch or torchtitan on PYTHONPATH
# would shadow the packages themselves.
_TAKEN_MODULES = frozenset({
    "torch", "torchtitan", "deepseek_v3", "flux", "gpt_oss", "kimi_k2_7", "llama3", "muse_glimmer", "qwen3",
    "qwen3_5", "alphabet_sort", "autoparallel", "dapo_math", "graph_trainer", "rl", "search_r1", "torchft",
    "transformers_modeling_backend",
})


def _module_name(filename: str | None) -> tuple[str, str, str | None]:
    """(module name for --module, directory for PYTHONPATH, the .py copy the command makes or None).
    ConfigManager imports the module with importlib (torchtitan/config/manager.py `_load_config`), so
    it must be a NAME.py file with NAME an identifier no torchtitan short name takes. Any other --out
    path is still written as given; the command then first copies it to such a name beside it."""
    if filename is None:
        return DEFAULT_MODULE, ".", None
    path = Path(filename)
    directory = str(path.parent) if str(path.parent) else "."
    if path.suffix == ".py" and path.stem.isidentifier() and path.stem not in _TAKEN_MODULES:
        return path.stem, directory, None
    module = re.sub(r"\W", "_", path.name)  # plan.out -> plan_out, my.plan.py -> my_plan_py
    if not module.isidentifier() or module in _TAKEN_MODULES:
        module = f"autoplan_{module}"
    return module, directory, str(path.parent / f"{module}.py")


# ---- the settings, and what they cannot state -----------------------------------------------

@dataclass
class _Settings:
    """Python source lines of the `Trainer.Config` keyword arguments, and the differences."""

    model: list[str] = field(default_factory=list)
    """Lines of `_autoplan_model_spec()`'s body."""
    flavor: str | None = None
    description: str = "a torchtitan Llama3Model"
    """What `_autoplan_model_spec` builds, in the file's words."""
    training: dict[str, str] = field(default_factory=dict)
    parallelism: dict[str, str] = field(default_factory=dict)
    activation_checkpoint: str = "None"
    differences: Findings = field(default_factory=Findings)
    imports: set[str] = field(default_factory=set)


def _model(plan: Plan, shape: TransformerShape, settings: _Settings, experts: MoEShape | None = None) -> None:
    """A torchtitan flavor when the shape is one exactly; else `Llama3Model.Config` of that shape,
    built with the layer builder every llama3 flavor uses, so any ffn width is exact (the builders
    take `hidden_dim` itself; compute_ffn_hidden_dim is only how the flavors choose it). A mixture of
    experts (`experts`) is those layers with torchtitan's MoE in place of the feed-forward
    (`_moe_lines`)."""
    key = (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.ffn_hidden_size,
           shape.vocab_size, float(shape.rope_theta or 0.0), float(shape.norm_eps))
    if (experts is None and key in _FLAVORS and not shape.tie_embeddings and shape.head_size is None
            and not shape.qk_norm):  # the llama3 flavors have no q/k norm
        settings.imports.add("from torchtitan.models.llama3 import model_registry")
        settings.flavor = _FLAVORS[key]
        # torchtitan/models/llama3/__init__.py model_registry(flavor): its ModelSpec, unchanged.
        settings.model = [f"return model_registry({settings.flavor!r})"]
        return
    tie = shape.tie_embeddings
    if tie and plan.pp > 1:
        # torchtitan/models/common/decoder.py Decoder.Config.update_from_config: "Weight tying is
        # not supported with Pipeline Parallel."
        settings.differences.differ({"model", "pp"},
            f"the plan's model ties its input and output embeddings, which torchtitan refuses with pipeline "
            f"parallelism; written untied, adding {shape.vocab_size * shape.hidden_size:,} parameters (and "
            "their gradients and optimizer state) to the last stage")
        tie = False
    settings.imports.update({
        "import dataclasses",
        "from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm",
        "from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, "
        "_output_linear_init",
    })
    if experts is None:
        settings.imports.add("from torchtitan.models.llama3 import Llama3Model, model_registry")
    dim, vocab, eps = shape.hidden_size, shape.vocab_size, float(shape.norm_eps)
    # RoPE tables must cover training.seq_len (torchtitan/config/configs.py TrainingConfig.seq_len).
    max_seq = max(shape.max_seq_len, plan.job.seq_len)
    lines = [
        "# torchtitan/models/llama3/__init__.py: the builder every llama3 flavor (_8b, _70b, ...) uses, with",
        "# this plan's exact shape; plain RoPE (scaling 'none') as autoplan's Llama has.",
        "layers = _build_llama3_layers(",
        f"    n_layers={shape.num_layers}, dim={dim}, n_heads={shape.num_heads}, n_kv_heads={shape.num_kv_heads},",
        f"    hidden_dim={shape.ffn_hidden_size}, fuse_qkv=True, attn_backend='flex',",
        f"    rope=ComplexRoPE.Config(dim={shape.head_dim}, max_seq_len={max_seq}, theta={float(shape.rope_theta)!r},"
        " scaling='none'),",
        ")",
    ]
    if shape.head_size is not None or shape.qk_norm:
        # _build_llama3_layers has no head_dim and gives every head dim // n_heads, and no q/k norm;
        # the attention builder it calls (torchtitan/models/common/config_utils.py make_gqa_config)
        # takes both (torchtitan's qwen3 builders pass qk_norm=RMSNorm over head_dim), so each
        # layer's attention is rebuilt with the builder's own arguments plus these.
        settings.imports.update({
            "from torchtitan.models.common.config_utils import make_gqa_config",
            "from torchtitan.models.llama3 import _LINEAR_INIT, _depth_init",
        })
        said = []
        if shape.head_size is not None:
            said.append(f"heads are {shape.head_size} wide, not dim / n_heads = {dim // shape.num_heads}")
        if shape.qk_norm:
            said.append("queries and keys are RMS-normalised per head (Qwen3's q_norm, k_norm)")
        qk_norm = (f" qk_norm=RMSNorm.Config(normalized_shape={shape.head_dim}, eps={eps!r}, param_init=_NORM_INIT),"
                   if shape.qk_norm else "")
        lines += [
            f"# this model's {' and '.join(said)}: the attention as the builder",
            "# makes it (make_gqa_config, the same initializers), with those",
            "layers = [dataclasses.replace(layer, attention=make_gqa_config(",
            f"    dim={dim}, n_heads={shape.num_heads}, n_kv_heads={shape.num_kv_heads}, "
            f"head_dim={shape.head_dim}, fuse_qkv=True,{qk_norm}",
            "    wqkv_param_init=_LINEAR_INIT, wo_param_init=_depth_init(layer_id),",
            "    inner_attention=layer.attention.inner_attention, rope=layer.attention.rope))",
            "    for layer_id, layer in enumerate(layers)]",
        ]
    if eps != _DEFAULT_NORM_EPS:
        lines += [
            f"# the builder leaves RMSNorm.eps at {_DEFAULT_NORM_EPS}; this model uses {eps!r}",
            "layers = [dataclasses.replace(layer, attention_norm=dataclasses.replace(layer.attention_norm, "
            f"eps={eps!r}),",
            f"                               ffn_norm=dataclasses.replace(layer.ffn_norm, eps={eps!r}))",
            "          for layer in layers]",
        ]
    model_class = "Llama3Model"
    if experts is not None:
        lines += _moe_lines(plan, shape, experts, settings)
        model_class = "Qwen3Model"
        settings.description = "a torchtitan Qwen3Model of Llama layers with torchtitan's MoE"
    lines += [
        f"model = {model_class}.Config(",
        f"    dim={dim}, vocab_size={vocab},",
        f"    tok_embeddings=Embedding.Config(num_embeddings={vocab}, embedding_dim={dim}, "
        "param_init=_EMBEDDING_INIT),",
        f"    norm=RMSNorm.Config(normalized_shape={dim}, eps={eps!r}, param_init=_NORM_INIT),",
        f"    lm_head=Linear.Config(in_features={dim}, out_features={vocab}, "
        f"param_init=_output_linear_init({dim})),",
        "    layers=layers,",
        f"    enable_weight_tying={tie},",
        ")",
    ]
    if experts is None:
        lines += [
            "# model_registry's ModelSpec (parallelize_llama, pipeline_llm, the HF state-dict adapter) with",
            "# this model in place of the flavor's.",
            "return dataclasses.replace(model_registry('debugmodel'), flavor='autoplan', model=model)",
        ]
    else:
        lines += [
            "# qwen3's ModelSpec (parallelize_qwen3, which applies expert parallelism to MoE layers, pipeline_llm,",
            "# the MoE load-balancing hook) with this model in place of its MoE flavor's.",
            "return dataclasses.replace(qwen3_model_registry('debugmodel_moe'), flavor='autoplan', model=model)",
        ]
    settings.model = lines


def _moe_lines(plan: Plan, shape: TransformerShape, experts: MoEShape, settings: _Settings) -> list[str]:
    """The zoo moe's layers (models/moe.py), or transformers' Mixtral's and Qwen3-MoE's (common.py
    `_hf_moe_shape`), as torchtitan builds a mixture of experts: each Llama layer
    (attention, norms) as a `Qwen3TransformerBlock` (torchtitan/models/qwen3/model.py: attention, then
    `moe` in place of `feed_forward`, the forward Llama3's block has) whose MoE
    (torchtitan/models/common/moe.py, built by config_utils.make_moe_config) routes as the zoo's
    router does: softmax over the experts, top-k, renormalised when `normalize_top_k`
    (`score_func='softmax'`, `route_norm`); SwiGLU experts of the zoo's width (GroupedExperts,
    w1/w3: dim -> hidden, w2: hidden -> dim); the zoo's shared experts as one SwiGLU feed-forward
    num_shared x as wide (a sum of SwiGLU MLPs is one SwiGLU MLP over their concatenated hidden
    units). What torchtitan routes otherwise is a difference: it is dropless (no capacity), and its
    load balancing is the auxiliary-loss-free bias (`load_balance_coeff`, arXiv:2408.15664), not the
    zoo's Switch loss, so the file sets no balancing and says so."""
    settings.imports.update({
        "from torchtitan.models.common.config_utils import make_ffn_config, make_moe_config, make_router_config, "
        "make_routed_experts_config",
        "from torchtitan.models.llama3 import _LINEAR_INIT, _depth_init",
        "from torchtitan.models.qwen3 import Qwen3Model, model_registry as qwen3_model_registry",
        "from torchtitan.models.qwen3.model import Qwen3TransformerBlock",
    })
    dim, count, width = shape.hidden_size, experts.num_experts, experts.expert_ffn_hidden_size
    shared = (f"make_ffn_config(dim={dim}, hidden_dim={width * experts.num_shared_experts}, "
              "w1_param_init=_LINEAR_INIT, w2w3_param_init=_depth_init(layer_id))"
              if experts.num_shared_experts else "None")
    if not experts.dropless:
        # models/moe.py expert_capacity; at capacity_factor >= E / k an expert takes a whole sequence
        # and nothing is ever dropped, which is dropless.
        capacity = math.ceil(experts.capacity_factor * plan.job.seq_len * experts.experts_per_token / count)
        if experts.capacity_factor < count / experts.experts_per_token:
            settings.differences.differ({"model"},
                f"the plan's experts take at most {capacity} tokens of a sequence each (capacity factor "
                f"{experts.capacity_factor:g}) and drop the rest; torchtitan routes dropless (every token reaches its "
                "experts): the same model when nothing overflows, more expert work and no drops otherwise")
    if plan.job.dtype == "float32":
        settings.differences.differ({"job"},
            "the plan computes in float32; torchtitan's GroupedExperts compute the experts in bfloat16 whatever the "
            "training dtype (models/common/moe.py), so the experts' arithmetic differs")
    # torchtitan/trainer.py Trainer.Config._validate_cuda_graphs refuses an all-to-all token dispatcher
    # (expert parallelism) with CUDA graphs on, as it does pp > 1.
    if plan.ep > 1:
        settings.training["disable_cuda_graphs"] = "True"
    if experts.aux_loss_coef:
        over = ("over the batch's tokens and every layer, transformers' load_balancing_loss_func"
                if shape.hf_model_type else "per sequence")
        settings.differences.differ({"model"},
            f"the plan's router adds the Switch load-balancing loss (coefficient {experts.aux_loss_coef:g}, {over}); "
            "torchtitan 0.3.0 has no such loss (its balancing is the auxiliary-loss-free expert bias, "
            "load_balance_coeff), so the file trains without one (load_balance_coeff=None)")
    return [
        f"# each layer: its attention and norms, and the mixture of {count} experts (top {experts.experts_per_token})",
        "# in place of the feed-forward; a Qwen3TransformerBlock is Llama3's block with an optional MoE",
        "def _experts(layer_id):",
        "    return make_moe_config(",
        f"        num_experts={count},",
        f"        router=make_router_config(dim={dim}, num_experts={count}, gate_param_init=_LINEAR_INIT,",
        f"                                  top_k={experts.experts_per_token}, score_func='softmax', "
        f"route_norm={experts.normalize_top_k}),",
        f"        routed_experts=make_routed_experts_config(dim={dim}, hidden_dim={width}, num_experts={count},",
        f"                                                  top_k={experts.experts_per_token},",
        "                                                  param_init={'w1_EFD': _LINEAR_INIT['weight'],",
        "                                                              'w2_EDF': _depth_init(layer_id)['weight'],",
        "                                                              'w3_EFD': _LINEAR_INIT['weight']},",
        "                                                  comm_backend='standard'),",
        f"        shared_experts={shared},",
        "        load_balance_coeff=None,",
        "    )",
        "# Qwen3Model counts FLOPs from the attention's head_dim (get_nparams_and_flops), which the llama",
        "# builder leaves None: the width its heads have.",
        "layers = [Qwen3TransformerBlock.Config(",
        f"              attention=dataclasses.replace(layer.attention, head_dim={shape.head_dim}),",
        "              attention_norm=layer.attention_norm, ffn_norm=layer.ffn_norm, moe=_experts(layer_id))",
        "          for layer_id, layer in enumerate(layers)]",
    ]


def _batch(plan: Plan, settings: _Settings) -> None:
    """torchtitan/trainer.py Trainer.__init__: gradient_accumulation_steps = global_batch_size //
    (local_batch_size * batch degree), batch degree = dp_replicate * dp_shard; with pp > 1 each of
    those steps is split into local_batch_size // pipeline_parallel_microbatch_size micro-batches
    (torchtitan/distributed/pipeline_parallel.py _build_pipeline_schedule). One forward therefore
    sees the plan's micro-batch in both cases."""
    micro, count = plan.micro_batch_size, plan.num_microbatches
    if plan.job.global_batch != micro * count * plan.replicas:
        raise ExportError(f"the plan's global batch {plan.job.global_batch} is not micro-batch {micro} x "
                          f"{count} micro-batches x dp {plan.replicas}; re-plan it with autoplan suggest",
                          dims={"micro_batch_size", "num_microbatches", "dp", "cp"})
    if plan.pp > 1:
        # One accumulation step of `count` pipeline micro-batches.
        settings.training["local_batch_size"] = str(micro * count)
        settings.parallelism["pipeline_parallel_microbatch_size"] = str(micro)
    else:
        # `count` accumulation steps of one micro-batch each.
        settings.training["local_batch_size"] = str(micro)
    settings.training["global_batch_size"] = str(plan.job.global_batch)
    settings.training["seq_len"] = str(plan.job.seq_len)


def _parallelism(plan: Plan, settings: _Settings) -> None:
    """Degrees and data parallelism. torchtitan/models/llama3/parallelize.py parallelize_llama always
    applies FSDP2 (`apply_fsdp_to_decoder`, torchtitan/distributed/fsdp.py) over the
    (dp_replicate, fsdp) mesh: shard degree 1 is plain replication (DDP semantics), replicate x shard
    is HSDP. torchtitan/distributed/parallel_dims.py ParallelDims._validate: the degrees multiply to
    the world size."""
    p = settings.parallelism
    p["tensor_parallel_degree"] = str(plan.tp)
    p["pipeline_parallel_degree"] = str(plan.pp)
    # torchtitan/config/configs.py ParallelismConfig.enable_sequence_parallel defaults to True.
    p["enable_sequence_parallel"] = str(bool(plan.sequence_parallel))
    # torchtitan's world is dp_replicate x dp_shard x cp x tp x pp, and FSDP shards over dp_shard x cp
    # (parallel_dims.py, the "dp_shard_cp" mesh): autoplan's dp counts the cp ranks, so the batch
    # degrees are the plan's replicas (dp / cp).
    if plan.cp > 1:
        p["context_parallel_degree"] = str(plan.cp)
        # configs.py ParallelismConfig: "headtail" is rank i holding chunks i and 2 cp - 1 - i of
        # each sequence, autoplan's load balancing (runtime/parallel/context.py); written out, not defaulted.
        p["context_parallel_load_balancer"] = repr("headtail")
    if plan.zero == 0:
        replicate, shard, reshard = plan.replicas, 1, "never"  # no sharding: nothing to reshard
    elif plan.zero == 1:
        replicate, shard, reshard = 1, plan.replicas, "never"
        settings.differences.differ({"zero"},
            f"the plan shards only optimizer state over dp {plan.dp} (ZeRO-1), which torchtitan has no mode for; "
            f"written as FSDP over dp {plan.dp} without resharding after forward (ZeRO-2-like: parameters and "
            "gradients sharded too), so each GPU holds less memory than planned but pays parameter all-gathers "
            "and gradient reduce-scatters the plan did not predict")
    else:
        replicate, shard = plan.dp_replicate, plan.dp_shard // plan.cp
        if plan.dp_shard % plan.cp:
            raise ExportError(f"the plan's FSDP groups of {plan.dp_shard} ranks do not hold whole cp groups of "
                              f"{plan.cp}; torchtitan shards over dp_shard x cp; re-plan with --cp dividing them",
                              dims={"zero", "dp_replicate", "cp"})
        # fsdp.py get_fsdp_reshard_after_forward_policy: "always" / "never"; "default" would depend on pp.
        reshard = "always" if plan.zero == 3 else "never"
    if plan.ep > 1:
        # configs.py ParallelismConfig.expert_parallel_degree: "EP borrows ranks from FSDP and TP: efsdp =
        # dp_shard * cp * tp / ep", autoplan's expert layout folded over tp x dp (plan.py [Note: expert
        # layout]); torchtitan's experts are whole on each rank (no expert tp degree), as autoplan's are.
        if (shard * plan.cp * plan.tp) % plan.ep:
            replicate, shard = 1, plan.replicas
            settings.differences.differ({"ep", "zero", "dp_replicate", "tp", "cp"},
                f"the plan keeps every parameter whole over dp (zero {plan.zero}) while splitting the experts "
                f"over ep {plan.ep}; torchtitan's expert parallelism borrows its ranks from FSDP "
                "(dp_shard x cp x tp), so the file shards over dp: less memory than planned, and parameter "
                "all-gathers and gradient reduce-scatters the plan did not predict")
        p["expert_parallel_degree"] = str(plan.ep)
    if plan.expert_tp > 1:
        # torchtitan 0.3.0's ParallelismConfig has no expert tensor-parallel degree.
        settings.differences.differ({"expert_tp"},
            f"the plan splits each expert's hidden units over expert tp {plan.expert_tp}; torchtitan 0.3.0 has no "
            "expert tensor parallelism (its experts are whole on the ranks holding them), so each GPU holds "
            f"{plan.expert_tp} times the expert weights planned")
    p["data_parallel_replicate_degree"] = str(replicate)
    p["data_parallel_shard_degree"] = str(shard)
    p["fsdp_reshard_after_forward"] = repr(reshard)
    if plan.rank_order != "tp-dp-pp":
        # parallel_dims.py ParallelDims builds its mesh as ["pp", "dp_replicate", "fsdp", "tp"]:
        # tp innermost, pp outermost, which is autoplan's "tp-dp-pp".
        settings.differences.differ({"rank_order"},
            f"the plan orders ranks {plan.rank_order} (pipeline neighbours {plan.tp} ranks apart); torchtitan's "
            "device mesh is always pp-outermost (tp-dp-pp), so pipeline neighbours land "
            f"{plan.tp * plan.dp} ranks apart and their point-to-point traffic may cross nodes")


def _schedule(plan: Plan, settings: _Settings) -> None:
    if plan.pp == 1:
        return
    # torchtitan/trainer.py Trainer.Config._validate_cuda_graphs refuses pp > 1 with CUDA graphs on.
    settings.training["disable_cuda_graphs"] = "True"
    # torch.distributed.pipelining's get_schedule_class name for the plan's schedule (schedule/specs.py).
    target = schedule_spec(plan.schedule).exports["torchtitan"]
    name = (target.looped_name or target.name) if plan.virtual_stages > 1 else target.name
    count = plan.num_microbatches
    few = name == "1F1B" and count < plan.pp
    if few:
        # torch/distributed/pipelining/schedules.py Schedule1F1B.__init__ raises ValueError ("Number of
        # microbatches (m) must be greater than or equal to the number of stages (pp)") at startup.
        # GPipe takes any count, and with m < pp micro-batches 1F1B has no steady phase: the same
        # bubble, and the first stage holds all m micro-batches' activations in both schedules.
        name = "GPipe"
    if target.difference is not None:
        settings.differences.differ({"schedule", "pp"}, target.difference.format(name=name))
    if few:
        settings.differences.differ({"schedule", "virtual_stages", "num_microbatches", "pp"},
            f"the plan runs {count} micro-batches on {plan.pp} pipeline stages with one stage per rank, fewer than "
            f"torch's Schedule1F1B accepts (it refuses fewer micro-batches than stages at startup); written as GPipe, "
            f"which with so few micro-batches has 1F1B's bubble and its first stage's activation memory, but the "
            f"later stages hold all {count} micro-batches' activations, more than planned")
    if name == "Interleaved1F1B":
        # torch/distributed/pipelining/schedules.py ScheduleInterleaved1F1B.__init__: the micro-batches
        # run in rounds of max(1, n // pp) and must divide into them, else it raises at startup.
        rounds = max(1, count // plan.pp)
        if count % rounds:
            raise ExportError(f"torch's Interleaved1F1B cannot run {count} micro-batches on pp {plan.pp} (they must "
                              f"divide into {rounds} rounds); re-plan with a micro-batch count that is a multiple of "
                              f"pp {plan.pp}", dims={"schedule", "virtual_stages", "num_microbatches", "pp"})
    settings.parallelism["pipeline_parallel_schedule"] = repr(name)


def _recompute(plan: Plan, settings: _Settings) -> None:
    """torchtitan/distributed/activation_checkpoint.py: FullAC wraps each TransformerBlock in a
    checkpoint (= autoplan "full"); None (tyro subcommand "none") checkpoints nothing."""
    if plan.recompute == "full":
        settings.activation_checkpoint = "FullAC.Config()"
        settings.imports.add("from torchtitan.distributed.activation_checkpoint import FullAC")
        return
    settings.activation_checkpoint = "None"
    if plan.recompute == "selective":
        settings.differences.differ({"recompute"},
            "the plan's selective recompute (Korthikanti et al. 2022: only the attention core, softmax(QK^T)V, "
            "is recomputed) has no torchtitan policy; written as no activation checkpointing, since torchtitan's "
            "fused flex attention already keeps no seq x seq scores and recomputes them in its backward, while its "
            "SelectiveAC (op-level: saves matmuls and attention outputs, recomputes every other matmul and the "
            "pointwise ops) would recompute more than the plan; activation memory and backward time differ from "
            "the prediction")


def _precision(plan: Plan, settings: _Settings) -> None:
    """torchtitan/config/configs.py TrainingConfig: FSDP2's MixedPrecisionPolicy casts parameters to
    mixed_precision_param for compute (torchtitan/distributed/fsdp.py apply_fsdp_to_decoder, always
    applied) and keeps `dtype` (float32) as the stored, optimizer-updated copy: autoplan's
    "bfloat16 compute, fp32 optimizer state"."""
    settings.training["dtype"] = "'float32'"
    if plan.job.dtype == "float16":
        settings.training["mixed_precision_param"] = "'bfloat16'"
        settings.differences.differ({"job"},
            "the plan computes in float16, which torchtitan's mixed precision does not offer (bfloat16 or "
            "float32 only); written as bfloat16 (same memory and speed, no loss scaling)")
    else:
        settings.training["mixed_precision_param"] = repr(plan.job.dtype)
    if plan.reduce_dtype == "bfloat16":
        # TrainingConfig.mixed_precision_reduce is Literal["float32"] in torchtitan 0.3.0.
        settings.differences.differ({"reduce_dtype"},
            "the plan reduces FSDP gradients in bfloat16; torchtitan's mixed_precision_reduce takes only "
            "'float32', so its reduce-scatters move twice the bytes the prediction priced")


# ---- stages ----------------------------------------------------------------------------------

def _fqn(block: str) -> str:
    """A plan block name as torchtitan's Decoder names the module (torchtitan/models/common/decoder.py:
    tok_embeddings, layers.N (a ModuleDict), norm, lm_head)."""
    parts = block.split(".")
    if block == "embedding" or parts[-1] == "embed_tokens":
        return "tok_embeddings"
    if len(parts) >= 2 and parts[-2] == "layers" and parts[-1].isdigit():
        return f"layers.{parts[-1]}"
    if parts[-1] == "norm":
        return "norm"
    if block in ("output", "lm_head"):
        return "lm_head"
    raise ExportError(f"the plan's block {block!r} has no torchtitan Llama module; re-plan the model")


def _stage_fqns(plan: Plan) -> list[list[str]]:
    """parallelism.module_fqns_per_model_part: one list per (virtual) stage, in stage order. torchtitan
    gives pp rank r stages r, r + pp, ... (pipeline_parallel.py _get_pp_rank_to_stage_indices_mapping,
    "loop" style), as autoplan places stage s on rank s % pp; _split_module keeps exactly these."""
    return [[_fqn(b) for b in blocks] for blocks in stage_blocks(plan)]


# ---- the file --------------------------------------------------------------------------------

def _nodes(plan: Plan) -> tuple[int, int]:
    """(processes per node, nodes) for torchrun."""
    groups = plan.cluster.get("groups") or [{}]
    per_node = int(groups[0].get("gpus_per_node", plan.num_gpus) or plan.num_gpus)
    per_node = max(1, min(per_node, plan.num_gpus))
    return per_node, math.ceil(plan.num_gpus / per_node)


def _command(plan: Plan, module: str, directory: str, source: str | None, copy: str | None) -> str:
    """torchtitan/train.py runs `main()` as `python -m torchtitan.train` (its README launches it with
    torchrun); ConfigManager reads --module/--config from the same argument list."""
    per_node, nodes = _nodes(plan)
    launch = (f"torchrun --standalone --nproc-per-node {per_node}" if nodes == 1 else
              f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
              "--rdzv-endpoint $HEAD_NODE:29500")
    prefix = f"cp {shlex.quote(source)} {shlex.quote(copy)} && " if source and copy else ""
    return (f"{prefix}PYTHONPATH={shlex.quote(directory)} {launch} -m torchtitan.train "
            f"--module {module} --config {CONFIG_FUNCTION}")


def _notes(plan: Plan, shape: TransformerShape) -> list[str]:
    per_node, nodes = _nodes(plan)
    notes = [
        f"needs torchtitan {TORCHTITAN_VERSION} (and its torch) on every node",
        f"data and tokenizer: the file trains on torchtitan's 'c4' dataset with the tokenizer in hf_assets_path "
        f"({_HF_ASSETS!r}); point --hf-assets-path and --dataloader.dataset at yours, with token ids below "
        f"{shape.vocab_size}",
        "steps and learning rate are placeholders (--training.steps, --optimizer.lr on the command line)",
    ]
    if nodes > 1:
        notes.append(f"run the command on each of the {nodes} nodes with HEAD_NODE set to the first node's address")
    return notes


def _kwargs(items: dict[str, str], indent: str) -> list[str]:
    return [f"{indent}{key}={value}," for key, value in items.items()]


def _render(plan: Plan, settings: _Settings, fqns: list[list[str]] | None, command: str) -> str:
    lines: list[str] = []
    if settings.differences:
        lines.append("# DIFFERENCES FROM THE PLAN (written with --allow-approx):")
        lines += [f"# - {d}" for d in settings.differences]
        lines.append("#")
    lines += [f"# {line}" for line in plan_summary(plan)]
    if plan.pp > 1:
        lines += [f"#   {line}" for line in stage_lines(plan)]
    lines += [
        f"# torchtitan {TORCHTITAN_VERSION} config-registry module written by `autoplan export --to torchtitan`.",
        "# Run it:",
        f"#   {command}",
        '"""autoplan plan as a torchtitan config: `--module <this file\'s stem> --config autoplan_plan`."""',
        "",
    ]
    imports = set(settings.imports) | {
        "from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss",
        "from torchtitan.components.optimizer import default_adamw",
        "from torchtitan.config import ParallelismConfig, TrainingConfig",
        "from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader",
        "from torchtitan.trainer import Trainer",
    }
    plain = sorted(i for i in imports if i.startswith("import "))
    lines += plain + ([""] if plain else []) + sorted(i for i in imports if i.startswith("from ")) + ["", ""]
    flavor = f"torchtitan's llama3 flavor {settings.flavor!r}" if settings.flavor else settings.description
    lines += ["def _autoplan_model_spec():", f'    """The plan\'s model ({plan.model}) as {flavor}."""']
    lines += [f"    {line}" for line in settings.model]
    parallelism = dict(settings.parallelism)
    if fqns is not None:
        parallelism["module_fqns_per_model_part"] = "MODULE_FQNS_PER_MODEL_PART"
    lines += ["", ""]
    if fqns is not None:
        lines.append("# The plan's stages, in stage order; pp rank r runs stages r, r + pp, ... "
                     "(torchtitan's 'loop' placement).")
        lines.append("MODULE_FQNS_PER_MODEL_PART = [")
        lines += [f"    {stage!r},  # stage {i}, pp rank {i % plan.pp}" for i, stage in enumerate(fqns)]
        lines += ["]", "", ""]
    lines += [
        f"def {CONFIG_FUNCTION}() -> Trainer.Config:",
        f'    """The plan: tp {plan.tp} x pp {plan.pp} x dp {plan.dp} = {plan.num_gpus} GPUs."""',
        "    model_spec = _autoplan_model_spec()",
        "    return Trainer.Config(",
        "        model_spec=model_spec,",
        "        loss=ChunkedLossWrapper.Config(",
        "            loss_fn=CrossEntropyLoss.Config(global_vocab_size=model_spec.model.vocab_size),",
        "        ),",
        f"        hf_assets_path={_HF_ASSETS!r},",
        "        optimizer=default_adamw(lr=3e-4),",
        "        dataloader=HuggingFaceTextDataLoader.Config(dataset='c4'),",
        "        training=TrainingConfig(",
        *_kwargs(settings.training, "            "),
        "        ),",
        "        parallelism=ParallelismConfig(",
        *_kwargs(parallelism, "            "),
        "        ),",
        f"        activation_checkpoint={settings.activation_checkpoint},",
        "    )",
    ]
    return "\n".join(lines) + "\n"
