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
(see [Note: name-keyed init] in init.py).

The definitions live here, apart from `autoplan.graph`, which analyses any model and never imports
this package (pyproject.toml's import contract). The models mark what the analysis and the runtime
must know through graph's markers (graph/positions.py, graph/aux_loss.py, graph/experts.py), which
user models use the same way. The package, one concept a module:

    bounds.py    the bounds of every config field, and ModelSpecError
    config.py    GPTConfig, LlamaConfig, MoEConfig
    common.py    what the models share: INIT_STD, the meta embedding, lm_loss
    gpt.py, llama.py, moe.py    the modules
    init.py      initialization by name, materialize
    presets.py   published sizes with their sources
    spec.py      the spec grammar (ModelSpec, parse_model_spec)
    build.py     build_model, load_user_model, example inputs and targets, model_info
"""

from __future__ import annotations

from autoplan.models.bounds import LOWER_BOUNDS, UPPER_BOUNDS, ModelSpecError
from autoplan.models.build import (
    build_model,
    example_inputs,
    example_targets,
    load_function,
    load_user_model,
    model_info,
)
from autoplan.models.common import INIT_STD, lm_loss
from autoplan.models.config import GPTConfig, LlamaConfig, ModelConfig, MoEConfig, llama_ffn_hidden_size
from autoplan.models.gpt import GPTLayer, GPTModel
from autoplan.models.init import init_weights, materialize
from autoplan.models.llama import LlamaLayer, LlamaModel, RotaryEmbedding
from autoplan.models.moe import MoEFeedForward, MoEModel, expert_capacity
from autoplan.models.presets import PRESET_SOURCES, PRESETS
from autoplan.models.spec import ModelSpec, parse_model_spec

__all__ = [
    "INIT_STD",
    "LOWER_BOUNDS",
    "UPPER_BOUNDS",
    "GPTConfig",
    "GPTLayer",
    "GPTModel",
    "LlamaConfig",
    "LlamaLayer",
    "LlamaModel",
    "ModelConfig",
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
    "expert_capacity",
    "init_weights",
    "llama_ffn_hidden_size",
    "lm_loss",
    "load_function",
    "load_user_model",
    "materialize",
    "model_info",
    "parse_model_spec",
]
