"""Hugging Face models as a model source: `hf:PATH` or `hf:MODEL_TYPE:key=value,...`.

    hf:path/to/model            a directory holding config.json (or the config.json itself)
    hf:llama:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,vocab_size=256
                                `transformers.AutoConfig.for_model(MODEL_TYPE)` with those fields

The form decides which (`HFSource.from_spec`): a known model type before the first ':' is a config of
that type and is never looked up as a path; fields are those the config class takes (`_takes_field`).

The model is built from its config with the `AutoModelFor...` class its config names
(`architectures`) or, without one, the first head its model type supports among seq2seq LM,
masked LM, causal LM, image classification and sequence classification. Nothing is downloaded and
no weights are read: planning builds on meta, and the runtime materializes each pipeline stage with
`HFSource.init_weights` ([Note: HF weights by name]). `use_cache` is off (a training step keeps no
KV cache, and torch.export cannot return a cache object).

Inputs are what the forward needs and nothing more: the main input (`input_ids` (b, s) below the
vocabulary, or `pixel_values` (b, channels, image_size, image_size) for vision models), plus
`decoder_input_ids` (b, s) for encoder-decoder models; optional arguments in between are passed as
None. The loss is sources/base.py's default loss on the output's logits, plus the routers'
load-balancing loss where a mixture-of-experts model returns one ([Note: HF auxiliary losses],
hf_loss.py).

[Note: HF weights by name]
A stage's parameters get values that depend only on (seed, parameter name), so a stage materialized
alone equals the same parameters of a full model (models/init.py, [Note: name-keyed init], the same
generator): matrices and higher (embeddings, projections, stacked experts) ~ N(0,
`initializer_range`), biases 0, other 1-D parameters (norm scales) 1. These are not transformers'
own per-module initializations (which need the module classes a stage's graph no longer has), only
deterministic values of the same scale. Buffers that transformers computes in `__init__` (rotary
`inv_freq`, BERT's `position_ids`) are copied from a reference build whose parameters are on meta
and whose buffers are real (`base.parameters_on_meta`), so they hold what transformers computed.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import hashlib
import inspect
import json
import re
import sys
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoplan._files import path_kind, read_json
from autoplan.sources.base import (
    InputTemplate,
    ModelSource,
    SourceError,
    parameters_on_meta,
    to_empty_keeping_ties,
)
from autoplan.sources.hf_context import context_parallel_refusal, use_context_attention
from autoplan.sources.hf_loss import hf_loss

__all__ = ["DEFAULT_SEQ_LEN", "HFSource"]

DEFAULT_SEQ_LEN = 512
"""Sequence length of a model without a position limit (T5's relative positions): the length T5
was pre-trained at (Raffel et al. 2020, Sec. 3.1.2)."""

_HEADS = (  # (AutoModel class name, the mapping of model types it supports), in order of preference
    ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
)


def _transformers():
    try:
        import transformers
    except ImportError:
        raise SourceError("hf: models need transformers; pip install transformers") from None
    return transformers


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' warnings about tiny test configs (token ids beyond a small vocabulary) off."""
    logging = _transformers().logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _reason(exc: BaseException) -> str:
    """One line saying why: the underlying error's first line (validators wrap the real one)."""
    cause = exc.__cause__ or exc
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[-1] if lines else ''}"


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _clip(text: str, limit: int = 80) -> str:
    """`text` short enough for a one-line error."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _declared_fields(config: Any) -> set[str]:
    """The fields a config declares: its values (`to_dict()`), its class's dataclass fields and
    annotations, and the aliases of `attribute_map`."""
    names = {*config.to_dict(), *getattr(config, "attribute_map", {})}
    for klass in type(config).__mro__:
        names.update(getattr(klass, "__dataclass_fields__", {}))
        names.update(vars(klass).get("__annotations__", {}))
    return {name for name in names if not name.startswith("_")}


def _modeling_reads(config: Any) -> set[str]:
    """The config fields the model's own code reads (`config.NAME`, `getattr(config, "NAME"...)`):
    a config class keeps any keyword it is given, and some fields that the model reads it never
    declares (Qwen3-MoE's `head_dim`, read with a fallback to hidden_size / num_attention_heads)."""
    try:
        return _names_read_in(HFSource._pick_class(config).__module__)
    except SourceError:
        return set()


@functools.cache
def _names_read_in(module_name: str) -> frozenset[str]:
    try:
        source = inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return frozenset()
    return frozenset({*re.findall(r"\bconfig\.([A-Za-z]\w*)", source),
                      *re.findall(r"getattr\(\s*(?:self\.)?config\s*,\s*[\"']([A-Za-z]\w*)[\"']", source)})


def _takes_field(default: Any, key: str, value: Any) -> bool:
    """Whether a config of `default`'s type takes `key`: a field it declares, one the model's code
    reads, or one the class consumes into others when built with it (transformers 5 folds
    `rope_theta` into `rope_parameters` and keeps no `rope_theta` attribute). Not `__init__`'s
    signature: config classes take **kwargs, so a signature names few of the fields they take."""
    if callable(getattr(default, key, None)):
        return False  # a method, not a field
    if key in _declared_fields(default) or key in _modeling_reads(default):
        return True
    try:
        built = _transformers().AutoConfig.for_model(default.model_type, **{key: value})
    except Exception:
        return True  # the class looked at the value and refused it: the build reports why
    return not hasattr(built, key)


def _parse_value(key: str, raw: str, default: Any) -> Any:
    """`raw` as the type of the config field's default value."""
    text = raw.strip()
    try:
        if isinstance(default, bool):
            lowered = text.lower()
            if lowered in ("true", "1", "yes"):
                return True
            if lowered in ("false", "0", "no"):
                return False
            raise ValueError
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, str):
            return text
        value = json.loads(text)  # None, lists, dicts: JSON (numbers and true/false/null alike)
        if default is not None and not isinstance(value, type(default)):
            raise ValueError
        return value
    except ValueError:
        if default is None:
            return text  # an unset field: a string it is
        kind = type(default).__name__
        raise SourceError(f"hf: {key}={raw!r} is not a valid {kind} (its default is {default!r}); "
                          f"write e.g. {key}={json.dumps(default) if not isinstance(default, str) else default}") from None


# Size fields of transformers configs, by the zoo field whose bounds they share (models.UPPER_BOUNDS,
# models.LOWER_BOUNDS): each model family names them its own way (GPT-2 n_layer / n_embd, T5 d_model / d_ff,
# BART encoder_layers). transformers checks none of them for sign: `hf:llama:num_hidden_layers=-1`
# was planned as a model of "1 blocks".
_SIZE_FIELDS = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "decoder_layers",
                   "encoder_layers", "depths"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "hidden_sizes", "embedding_size", "d_kv"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads", "num_key_value_heads", "encoder_attention_heads",
                  "decoder_attention_heads"),
    "ffn_hidden_size": ("intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim",
                        "moe_intermediate_size"),
    "vocab_size": ("vocab_size",),
    "max_seq_len": ("max_position_embeddings", "n_positions"),
    "head_size": ("head_dim",),
}


def _check_sizes(config: Any, where: str) -> None:
    """SourceError unless every size field the config sets (an int, or a list of ints) is at least 1
    (vocab_size at least 2) and at most the zoo's bound for it (larger than any published model)."""
    aliases = getattr(config, "attribute_map", {})
    # An alias (GPT-2's num_hidden_layers is n_layer) is checked by the name the config uses.
    _check_size_values({f: getattr(config, f, None) for fields in _SIZE_FIELDS.values() for f in fields
                        if f not in aliases}, where)


def _check_size_values(values: Mapping[str, Any], where: str) -> None:
    """`_check_sizes` on field values before a config is made of them: transformers' own checks
    divide by the head count (a ZeroDivisionError for 0 heads) and name no fix."""
    from autoplan.models.bounds import LOWER_BOUNDS, UPPER_BOUNDS

    for bound_name, fields in _SIZE_FIELDS.items():
        low, reason = LOWER_BOUNDS.get(bound_name, (1, "a size counts something"))
        high = UPPER_BOUNDS[bound_name]
        for field in fields:
            value = values.get(field)
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if not isinstance(item, int) or isinstance(item, bool):
                    continue  # unset (None), or not a size in this family
                if item < low:
                    raise SourceError(f"{where}: {field}={item} must be at least {low} ({reason}); "
                                      f"set {field} to {low} or more")
                if item > high:
                    raise SourceError(f"{where}: {field}={item} must be at most {high:,} (larger than any "
                                      f"published model); set a smaller {field}")


def _param_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode())  # models/init.py's [Note: name-keyed init]


class HFSource(ModelSource):
    """A transformers model built from its config (module docstring)."""

    def __init__(self, spec: str, config: Any, *, path: Path | None = None, model_class: type | None = None):
        self.spec = spec
        self.path = path
        self._config = config
        body = spec[len("hf:"):]
        self.name = (path.parent.name if path.name == "config.json" else path.name) if path is not None else body
        _check_sizes(config, f"hf: the {config.model_type} config" + (f" {str(path)!r}" if path is not None else ""))
        self._model_class = model_class or self._pick_class(config)
        self._cp_refusal = context_parallel_refusal(config, self._model_class)
        self._reference: nn.Module | None = None

    # ---- specs ------------------------------------------------------------------------------

    @classmethod
    def from_spec(cls, text: str) -> HFSource:
        """`hf:MODEL_TYPE[:key=value,...]` or `hf:PATH` (a directory with config.json, or the file).

        The spec's form decides, before any filesystem call: a known model type before the first
        ':' names a config of that type (a directory of the same name is `hf:./NAME`); anything else
        is a path. A long `hf:deepseek_v3:...` spec was once stat()ed as a path and ended in
        `OSError: File name too long` (issue 31). Values take the type of the config field's
        default (bool, int, float, str; JSON for lists, dicts and unset fields)."""
        transformers = _transformers()
        text = text.strip()
        if not text.startswith("hf:") or not text[3:].strip():
            raise SourceError(f"'{text}' is not an hf: spec; write hf:PATH or hf:MODEL_TYPE:key=value,...")
        body = text[3:].strip()
        head, _, overrides = body.partition(":")
        head = head.strip()
        if head not in transformers.CONFIG_MAPPING:
            if "/" in head or "\\" in head or head.endswith(".json") or path_kind(Path(body).expanduser()):
                return cls._from_path(text, Path(body).expanduser())
            types = sorted(transformers.CONFIG_MAPPING.keys())
            raise SourceError(f"hf: '{_clip(head)}' is neither a model type nor an existing path"
                              f"{_did_you_mean(head, types)}; write hf:MODEL_TYPE:key=value,... "
                              f"(e.g. hf:llama:num_hidden_layers=2) or hf:path/to/model")
        with _quiet():
            default = transformers.AutoConfig.for_model(head)
            fields = cls._parse_overrides(head, overrides, default)
            _check_size_values(fields, f"hf: the {head} config")
            try:
                config = transformers.AutoConfig.for_model(head, **fields)
            except Exception as exc:  # ValueError, or huggingface_hub's strict-dataclass validation error
                raise SourceError(f"hf: the {head} config refuses {overrides.strip()!r}: {_reason(exc)}") from None
        return cls(f"hf:{head}" + (f":{overrides.strip()}" if overrides.strip() else ""), config)

    @staticmethod
    def _parse_overrides(model_type: str, text: str, default: Any) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            key, eq, raw = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise SourceError(f"hf: '{item}' in the {model_type} spec is not key=value; "
                                  f"write e.g. hf:{model_type}:num_hidden_layers=2")
            value = _parse_value(key, raw, getattr(default, key, None))
            if not _takes_field(default, key, value):
                known = sorted(_declared_fields(default) | _modeling_reads(default))
                raise SourceError(f"hf: {model_type} configs have no field '{key}'{_did_you_mean(key, known)}; "
                                  f"see transformers' {type(default).__name__}")
            fields[key] = value
        return fields

    @classmethod
    def _from_path(cls, spec: str, path: Path) -> HFSource:
        transformers = _transformers()
        file = path / "config.json" if path_kind(path) == "dir" else path
        if path_kind(path) is None:
            # Most often a hub id (hf:meta-llama/Meta-Llama-3-8B): autoplan downloads nothing (issue 44:
            # this said "holds no config.json" of a path that does not exist).
            raise SourceError(f"hf: {_clip(str(path))!r} does not exist; hf: takes a local config.json or its directory "
                              "(a Hugging Face hub id is not downloaded: download the model's config.json and point "
                              "hf: at it), or hf:MODEL_TYPE:key=value,...")
        if path_kind(file) != "file":
            raise SourceError(f"hf: {_clip(str(path))!r} holds no config.json; point hf: at a model directory or its config.json")
        data = read_json(file, "hf: config", SourceError, "point hf: at a model directory or its config.json")
        model_type = data.pop("model_type", None) if isinstance(data, dict) else None
        if model_type not in transformers.CONFIG_MAPPING:
            types = sorted(transformers.CONFIG_MAPPING.keys())
            raise SourceError(f"hf: {str(file)!r} names model_type {model_type!r}, which transformers does not know"
                              f"{_did_you_mean(str(model_type), types)}; set a known model_type")
        _check_size_values(data, f"hf: the {model_type} config {str(file)!r}")
        with _quiet():
            try:
                config = transformers.AutoConfig.for_model(model_type, **data)
            except Exception as exc:
                raise SourceError(f"hf: {str(file)!r} is not a valid {model_type} config: {_reason(exc)}") from None
        return cls(spec, config, path=file)

    def file_digest(self) -> str | None:
        return hashlib.sha256(self.path.read_bytes()).hexdigest() if self.path is not None else None

    # ---- the model --------------------------------------------------------------------------

    @staticmethod
    def _pick_class(config: Any) -> type:
        transformers = _transformers()
        for name in getattr(config, "architectures", None) or ():
            cls = getattr(transformers, name, None)
            if isinstance(cls, type) and issubclass(cls, nn.Module):
                return cls
        from transformers.models.auto import modeling_auto

        for _, mapping_name in _HEADS:
            names = getattr(modeling_auto, mapping_name)
            class_name = names.get(config.model_type)
            if class_name is not None and getattr(transformers, class_name, None) is not None:
                return getattr(transformers, class_name)
        heads = ", ".join(auto for auto, _ in _HEADS)
        raise SourceError(f"hf: transformers has none of {heads} for model type '{config.model_type}'; "
                          f"name one in the config's architectures")

    @property
    def config(self) -> Any:
        """The model's config (a copy: use_cache off)."""
        config = copy.deepcopy(self._config)
        if hasattr(config, "use_cache"):
            config.use_cache = False
        if self._cp_refusal is None:  # [Note: transformers under context parallelism]
            use_context_attention(config)
        return config

    def context_parallel_refusal(self, model: nn.Module) -> str | None:
        """[Note: transformers under context parallelism] (hf_context.py)."""
        return self._cp_refusal

    def routes_tokens_alone(self, model: nn.Module) -> bool:
        """transformers' mixture-of-experts blocks route each token to its top-k experts with no
        capacity (every token reaches them: the routed-experts contract of graph/experts.py); what
        they count over the batch is the routers' load-balancing loss, which the source computes over
        the cp group (hf_loss.py `balance_loss`) or `context_parallel_refusal` refuses
        ([Note: transformers under context parallelism])."""
        return True

    def build(self, device: torch.device | str = "meta") -> nn.Module:
        """The model on meta, or materialized on `device` by `init_weights` (seed 0)."""
        with _quiet(), torch.device("meta"):
            try:
                model = self._model_class._from_config(self.config)
            except Exception as exc:  # transformers checks sizes (heads dividing the hidden size) here
                raise SourceError(f"cannot build {self.name}: {_reason(exc)}; check its sizes") from None
        model.train()
        if torch.device(device).type != "meta":
            aliases = to_empty_keeping_ties(model, device)  # `to_empty` unties shared parameters
            self.init_weights(model, seed=0, aliases=aliases)
        return model

    def reference_buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer of the model as transformers computes it (parameters left on meta)."""
        if self._reference is None:
            with _quiet(), parameters_on_meta():
                self._reference = self._model_class._from_config(self.config)
        return dict(self._reference.named_buffers(remove_duplicate=False))

    @torch.no_grad()
    def init_weights(self, module: nn.Module, seed: int, aliases: Mapping[str, str] | None = None) -> None:
        """[Note: HF weights by name]: parameters from (seed, name), buffers as transformers computes them."""
        std = float(getattr(self._config, "initializer_range", 0.02) or 0.02)
        seen: set[int] = set()
        for name, param in module.named_parameters(remove_duplicate=False):
            if id(param) in seen or param.device.type == "meta":
                continue
            seen.add(id(param))
            name = (aliases or {}).get(name, name)
            if param.dim() >= 2:
                gen = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
                param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)
        buffers = [(n, b) for n, b in module.named_buffers(remove_duplicate=False) if b.device.type != "meta"]
        if buffers:
            reference = self.reference_buffers()
            for name, buffer in buffers:
                value = reference.get(name)
                if value is None:
                    # Not the model's: a tensor the traced graph made from a literal of the forward
                    # (export lifts Falcon's `x[..., [-2], :]` index as `lifted_tensor_0`); the stage
                    # holds it with its traced value, which is the value.
                    continue
                if value.shape != buffer.shape:
                    raise SourceError(f"{self.name}: buffer '{name}' has shape {tuple(buffer.shape)} but "
                                      f"{tuple(value.shape)} in the model transformers builds; cannot initialize it")
                buffer.copy_(value.to(buffer.dtype))

    # ---- inputs, loss, facts ----------------------------------------------------------------

    @property
    def loss_fn(self):
        """The default loss, plus the router's load-balancing loss where the model returns one
        ([Note: HF auxiliary losses], hf_loss.py)."""
        return hf_loss(self._config, self.name, self._model_class)

    def _int(self, *names: str) -> int | None:
        for name in names:
            value = getattr(self._config, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    @property
    def is_vision(self) -> bool:
        return getattr(self._model_class, "main_input_name", "input_ids") == "pixel_values"

    def input_templates(self) -> tuple[InputTemplate, ...]:
        main = getattr(self._model_class, "main_input_name", "input_ids")
        if main == "pixel_values":
            size = getattr(self._config, "image_size", 224)
            height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
            channels = self._int("num_channels") or 3
            wanted = {main: InputTemplate((1, channels, height, width), torch.float32, 0, 2, 0, None)}
        elif main == "input_ids":
            vocab = self._int("vocab_size")
            if vocab is None:
                raise SourceError(f"{self.name}: its config has no vocab_size; set one")
            ids = InputTemplate((1, self.default_seq_len), torch.int64, 0, vocab, 0, 1)
            wanted = {main: ids}
            if getattr(self._config, "is_encoder_decoder", False):
                wanted["decoder_input_ids"] = ids
            if self._cp_refusal is None:  # the positions context parallelism cuts with the ids
                wanted["position_ids"] = InputTemplate((1, self.default_seq_len), torch.int64, batch_dim=0, seq_dim=1,
                                                       positions=True)
        else:
            raise SourceError(f"{self.name}: {self._model_class.__name__} takes '{main}' first, which autoplan "
                              "cannot make inputs for; wrap the model in a file.py:function source")
        # Positional, in the forward's order; unneeded arguments in between are None.
        names = [p for p in inspect.signature(self._model_class.forward).parameters if p != "self"]
        missing = [n for n in wanted if n not in names]
        if missing:
            raise SourceError(f"{self.name}: {self._model_class.__name__}.forward takes no {missing[0]}")
        last = max(names.index(n) for n in wanted)
        return tuple(wanted.get(n, InputTemplate(None, None, constant=None)) for n in names[:last + 1])

    @property
    def max_seq_len(self) -> int | None:
        """The position table's length (None: relative positions, or no sequence)."""
        if self.is_vision:
            return None
        return self._int("max_position_embeddings", "n_positions", "max_sequence_length")

    @property
    def default_seq_len(self) -> int | None:
        """The position limit, or `DEFAULT_SEQ_LEN` for a model without one (T5); None for vision."""
        if self.is_vision:
            return None
        return self.max_seq_len or DEFAULT_SEQ_LEN

    def check_seq_len(self, seq_len: int | None) -> None:
        """An image model takes no sequence: None, or 1 (what a plan records as the sequence
        length of a model without one, a job being counted in samples of one "token")."""
        if self.is_vision and seq_len == 1:
            return
        super().check_seq_len(seq_len)

    @property
    def info(self) -> dict[str, int | None]:
        """Shape facts from the config; an encoder-decoder's num_layers counts both stacks."""
        heads = self._int("num_attention_heads", "n_head", "num_heads")
        layers = self._int("num_hidden_layers", "n_layer", "num_layers")
        if layers is not None and getattr(self._config, "is_encoder_decoder", False):
            layers += self._int("num_decoder_layers", "decoder_layers") or layers
        return {
            "num_heads": heads,
            "num_kv_heads": self._int("num_key_value_heads") or heads,
            "hidden_size": self._int("hidden_size", "n_embd", "d_model"),
            "vocab_size": None if self.is_vision else self._int("vocab_size"),
            "num_layers": layers,
        }
