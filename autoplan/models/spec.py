"""The model spec grammar: one string that names a built-in model (a family or preset, with
fields overridden) or a user's `file.py:function` (the models package's docstring).

Apart from building so that a spec is checked without importing the model modules.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass
from pathlib import Path

from autoplan._files import path_kind
from autoplan.models.bounds import ModelSpecError
from autoplan.models.config import GPTConfig, LlamaConfig, ModelConfig, MoEConfig
from autoplan.models.presets import PRESETS

__all__ = ["ModelSpec", "parse_model_spec", "did_you_mean"]

_FAMILIES: dict[str, type] = {"gpt": GPTConfig, "llama": LlamaConfig, "moe": MoEConfig}
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


def did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _normalised(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def _hub_id_message(name: str, presets: list[str]) -> str:
    """`--model meta-llama/Meta-Llama-3-8B`: the preset of that architecture if one matches (its
    normalised name inside the id's, the longest such; else difflib on the id's last part), and
    how to plan the hub model itself: autoplan downloads nothing, `hf:` takes a local config."""
    tail = name.rstrip("/").rsplit("/", 1)[-1]
    inside = [p for p in presets if _normalised(p) in _normalised(tail)]
    prefixed = [p for p in presets if _normalised(p).startswith(_normalised(tail))]  # gpt2 -> gpt2-small
    close = ((max(inside, key=len),) if inside else prefixed[:1] if prefixed
             else tuple(difflib.get_close_matches(tail.lower(), presets, n=1)))
    guess = f"; did you mean the preset {close[0]!r}?" if close else ";"
    return (f"unknown model {name!r}{guess} A Hugging Face hub id is not downloaded: for that model give its "
            f"config, hf:path/to/config.json (or the directory holding it), or hf:MODEL_TYPE:key=value,...; "
            f"`autoplan list models` lists the presets")


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
    # Names are case-insensitive, as GPU names are (issue 44: `LLAMA3-8B` was refused).
    name = next((k for k in known if k.lower() == name.lower()), name)
    if name not in known:
        if "/" in name:  # a Hugging Face hub id (org/model), or a path: neither is a preset
            raise ModelSpecError(_hub_id_message(name, list(PRESETS)))
        raise ModelSpecError(f"unknown model {name!r}{did_you_mean(name.lower(), known)} known: {', '.join(known)}")
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
                    f"unknown key {key!r} for {family}{did_you_mean(key, valid)}; valid keys: {', '.join(valid)}"
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
    if path_kind(path) != "file":  # never Path.is_file(): it raises on a name too long to be a file
        raise ModelSpecError(f"model file {path!r} does not exist (spec {text!r}); check the path")
    return ModelSpec(
        text=text,
        family="file",
        config=None,
        path=path,
        function=function,
        name=f"{Path(path).stem}:{function}",
    )


def as_spec(spec: str | ModelSpec | ModelConfig) -> ModelSpec:
    if isinstance(spec, ModelSpec):
        return spec
    if isinstance(spec, GPTConfig | LlamaConfig):
        family = _family_of(spec)
        return ModelSpec(text=family, family=family, config=spec, path=None, function=None, name=family)
    return parse_model_spec(spec)

