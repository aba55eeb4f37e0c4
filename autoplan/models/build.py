"""Building what a model spec names: a built-in model on meta (materialized by name off meta), a
user's file imported and its function called, and example inputs and targets of any shape.

Apart from the spec grammar (spec.py) because this is the part that imports the model modules and
runs user code.
"""

from __future__ import annotations

import importlib.util
import sys
import typing
import zlib
from pathlib import Path

import torch
from torch import Tensor, nn

from autoplan.models.bounds import ModelSpecError
from autoplan.models.common import lm_loss
from autoplan.models.config import GPTConfig, LlamaConfig, ModelConfig, MoEConfig
from autoplan.models.gpt import GPTModel
from autoplan.models.init import materialize
from autoplan.models.llama import LlamaModel
from autoplan.models.moe import MoEModel
from autoplan.models.spec import ModelSpec, as_spec, did_you_mean

__all__ = ["build_model", "example_inputs", "example_targets", "load_function", "load_user_model", "model_info"]

_MODELS: dict[type, type] = {GPTConfig: GPTModel, LlamaConfig: LlamaModel, MoEConfig: MoEModel}

# ---------------------------------------------------------------------------------------------
# Building


def load_function(spec: str | ModelSpec) -> typing.Callable:
    """Import `path/to/file.py` of a file spec and return its FUNCTION (one-line errors)."""
    spec = as_spec(spec)
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
            f"{spec.path!r} has no function {spec.function!r}{did_you_mean(spec.function, defined)}"
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
    spec = as_spec(spec)
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
    spec = as_spec(spec)
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
    spec = as_spec(spec_or_config)
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
    spec = as_spec(spec)
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
