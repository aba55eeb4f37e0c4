"""Model sources: every way a user names a model, as one object that rebuilds it anywhere.

A `ModelSource` is what the planner and the runtime ask about a model (DESIGN.md, "Second wave:
model sources"). It is made from a spec string, and the spec is what a plan records, so
`autoplan run plan.json` rebuilds the very model `suggest` planned, on every rank:

    gpt2-small, llama:num_layers=4,...     the built-in zoo (`ZooSource`)
    path/to/model.py:build                 a user's file (`FileSource`); build() returns
                                           (module, example_inputs) or (module, example_inputs, loss_fn)
    hf:PATH, hf:MODEL_TYPE:key=value,...   a Hugging Face model from its config (`autoplan.graph.hf`)
    an nn.Module passed to the API         `ModuleSource` (the API's caller gives the inputs)

A source answers: build the module (on meta: nothing allocated), its example inputs at any batch
size and sequence length (shapes on meta, values elsewhere), a training batch for step k (a pure
function of seed and step, so resumed runs see the same data), a target for the loss, and the loss.

[Note: the default loss]
`loss_fn(output, target)` receives what the model's forward returns (a tensor, a tuple, a dict or
a transformers `ModelOutput`). Without a user loss, `default_loss` takes the logits (the `logits`
entry, else the first tensor) and computes the mean cross entropy against integer class targets of
shape `logits.shape[:-1]` (causal LM, masked LM, token and sequence classification alike; the
targets are synthetic, so no next-token shift is needed), or the mean squared error against a
float target of the output's shape when the last dimension is 1.
"""

from __future__ import annotations

import contextlib
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoplan.graph import zoo

__all__ = [
    "FileSource", "InputTemplate", "ModelSource", "ModuleSource", "OutputTemplate", "SourceError", "ZooSource",
    "as_source", "default_loss", "default_target", "first_tensor", "parameters_on_meta", "parse_source",
    "tied_parameter_names", "token_batch", "trace_with_target",
]


class SourceError(ValueError):
    """A model source that cannot be built or fed as asked (one-line message naming the fix)."""


# ---- the loss ----------------------------------------------------------------------------------


def first_tensor(output: Any) -> Tensor:
    """The logits of a model output: `output.logits` / `output["logits"]` when present, else the
    first tensor found in order (a tensor, tuple, list, dict or ModelOutput)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping):
        if isinstance(output.get("logits"), Tensor):
            return output["logits"]
        values = list(output.values())
    elif hasattr(output, "logits") and isinstance(output.logits, Tensor):
        return output.logits
    elif isinstance(output, (tuple, list)):
        values = list(output)
    else:
        raise SourceError(f"the model returned a {type(output).__name__}; the default loss needs a tensor "
                          "(or a tuple / dict / ModelOutput holding one); pass a loss_fn")
    for value in values:
        if value is None:
            continue
        try:
            return first_tensor(value)
        except SourceError:
            continue
    raise SourceError("the model's output holds no tensor; pass a loss_fn")


def default_loss(output: Any, target: Tensor) -> Tensor:
    """[Note: the default loss]: cross entropy on the logits for integer targets, else MSE."""
    logits = first_tensor(output)
    if target.dtype.is_floating_point:
        return F.mse_loss(logits.float(), target.float())
    return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten())


def default_target(output_shape: Sequence[int], output_dtype: torch.dtype, batch_rows: int | None = None, *,
                   device: torch.device | str = "meta", generator: torch.Generator | None = None) -> Tensor:
    """A target for `default_loss` given the logits' shape: class ids in [0, classes) of shape
    `shape[:-1]`, or (last dim 1, or a non-float output) a float tensor of the output's shape."""
    shape = list(output_shape)
    if batch_rows is not None and shape:
        shape[0] = batch_rows
    device = torch.device(device)
    classes = shape[-1] if shape else 1
    if output_dtype.is_floating_point and len(shape) >= 2 and classes > 1:
        if device.type == "meta":
            return torch.empty(shape[:-1], dtype=torch.int64, device=device)
        return torch.randint(0, classes, shape[:-1], generator=generator).to(device)
    if device.type == "meta":
        return torch.empty(shape, dtype=torch.float32, device=device)
    return torch.randn(shape, generator=generator).to(device)


# ---- input templates ---------------------------------------------------------------------------


@dataclass(frozen=True)
class InputTemplate:
    """How to make one model input at any batch size and sequence length.

    `batch_dim` / `seq_dim` are the dimensions that follow the batch and the sequence (None when
    the input has none); integer inputs are drawn in [low, high) (token ids below the vocabulary),
    float inputs from a standard normal; a non-tensor is passed as it is."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    low: int = 0
    high: int = 2
    batch_dim: int | None = 0
    seq_dim: int | None = None
    constant: Any = None

    def make(self, batch_size: int, seq_len: int | None, *, device: torch.device | str = "meta",
             generator: torch.Generator | None = None) -> Any:
        if self.shape is None:
            return self.constant
        shape = list(self.shape)
        if self.batch_dim is not None:
            shape[self.batch_dim] = batch_size
        if self.seq_dim is not None and seq_len is not None:
            shape[self.seq_dim] = seq_len
        device = torch.device(device)
        if device.type == "meta":
            return torch.empty(shape, dtype=self.dtype, device=device)
        if self.dtype == torch.bool:
            return torch.ones(shape, dtype=torch.bool, device=device)
        if self.dtype.is_floating_point:
            return torch.randn(shape, generator=generator).to(device=device, dtype=self.dtype)
        return torch.randint(self.low, self.high, shape, generator=generator).to(device=device, dtype=self.dtype)


def token_batch(seed: int, step: int, batch: int, seq_len: int, vocab: int) -> tuple[Tensor, Tensor]:
    """(ids, targets) of a token model's training step `step`: random ids, each target a fixed map
    of its id, so the loss can fall on fresh data every step."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))
    ids = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    return ids, (ids * 7 + 3) % vocab


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on meta and their buffers real (as `__init__` computes
    them): the values a stage built on meta lacks after `to_empty` (rotary tables, causal masks)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def tied_parameter_names(model: nn.Module) -> dict[str, str]:
    """Every name of a shared parameter -> its first name in the model (e.g. output.weight ->
    tok_embeddings.weight); names of unshared parameters are absent."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
            aliases.setdefault(first[id(p)], first[id(p)])
        else:
            first[id(p)] = name
    return aliases


def _step_generator(seed: int, step: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step * 7919 + salt) % (2**63))


# ---- the sources ---------------------------------------------------------------------------------


class ModelSource(ABC):
    """A model and how to feed it; see the module docstring."""

    spec: str
    """What a plan records (`plan.model`); `parse_source(spec)` rebuilds this source."""
    name: str
    """Display name."""

    @abstractmethod
    def build(self, device: torch.device | str = "meta") -> nn.Module:
        """The module: on meta (parameters without storage), or materialized on `device`."""

    @abstractmethod
    def input_templates(self) -> tuple[InputTemplate, ...]:
        """One template per forward argument."""

    @property
    def loss_fn(self) -> Callable[..., Tensor]:
        """loss(output, target); [Note: the default loss] unless the source names its own."""
        return default_loss

    @property
    def default_seq_len(self) -> int | None:
        """The model's own sequence length: what `--seq-len` defaults to (None: no sequence; a plan
        then counts samples, at sequence length 1)."""
        seq = [t for t in self.input_templates() if t.seq_dim is not None]
        return seq[0].shape[seq[0].seq_dim] if seq else None

    @property
    def max_seq_len(self) -> int | None:
        """The longest sequence the model takes (position table), when it has one."""
        return None

    @property
    def info(self) -> dict[str, int | None]:
        """Shape facts for the profile (num_heads, hidden_size, vocab_size, ...), when known."""
        return {}

    def file_digest(self) -> str | None:
        """sha256 of the file the model comes from, when it comes from one."""
        return None

    def check_seq_len(self, seq_len: int | None) -> None:
        """Refuse (one line) a sequence length the model cannot take."""
        if seq_len is None:
            return
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise SourceError(f"sequence length {seq_len!r} must be a positive integer")
        if not any(t.seq_dim is not None for t in self.input_templates()) and seq_len != 1:
            raise SourceError(f"{self.name} takes no sequence (its inputs have no sequence dimension); "
                              f"drop --seq-len")
        if self.max_seq_len is not None and seq_len > self.max_seq_len:
            raise SourceError(f"--seq-len {seq_len} exceeds {self.name}'s longest sequence {self.max_seq_len}; "
                              f"use a shorter one (or raise the model's position limit)")

    def example_inputs(self, batch_size: int, seq_len: int | None = None, *,
                       device: torch.device | str = "meta", seed: int = 0) -> tuple:
        """Inputs of `batch_size` rows at `seq_len` (the model's own when None): shapes on meta,
        deterministic values elsewhere."""
        self.check_seq_len(seq_len)
        gen = _step_generator(seed, 0, salt=17)
        return tuple(t.make(batch_size, seq_len, device=device, generator=gen) for t in self.input_templates())

    def batch(self, seed: int, step: int, batch_size: int, seq_len: int | None, output_shape: Sequence[int],
              output_dtype: torch.dtype) -> tuple[tuple, Tensor]:
        """(inputs, target) of training step `step`: a pure function of (seed, step) and the shapes,
        so a resumed run sees exactly the batches a straight one would. So that the loss can fall,
        a class target of the shape of an integer input is a fixed map of it (token ids -> next
        ids); other targets are the same every step."""
        gen = _step_generator(seed, step)
        inputs = tuple(t.make(batch_size, seq_len, device="cpu", generator=gen) for t in self.input_templates())
        shape = [batch_size, *output_shape[1:]]  # the output was traced at this sequence length
        target = self.target(shape, output_dtype, batch_size, device="cpu", generator=_step_generator(seed, 0, 99))
        if not target.dtype.is_floating_point:
            ids = next((x for x in inputs if isinstance(x, Tensor) and not x.is_floating_point()
                        and x.shape == target.shape), None)
            if ids is not None:
                target = (ids.long() * 7 + 3) % shape[-1]
        return inputs, target

    def static_target(self, batch_size: int, seq_len: int | None) -> Tensor | None:
        """A target on meta known without running the model (so a cached profile needs no fake
        forward), or None when it follows the output's shape."""
        return None

    def target(self, output_shape: Sequence[int], output_dtype: torch.dtype, batch_size: int, *,
               device: torch.device | str = "meta", generator: torch.Generator | None = None) -> Tensor:
        """A target for `loss_fn` given the output's shape at `batch_size` rows."""
        return default_target(output_shape, output_dtype, batch_size, device=device, generator=generator)

    def reference_buffers(self) -> dict[str, Tensor]:
        """Every buffer of the model by name as its constructor computes it (none by default: the
        zoo recomputes its own)."""
        return {}

    @torch.no_grad()
    def init_weights(self, module: nn.Module, seed: int, aliases: Mapping[str, str] | None = None) -> None:
        """Initialize a materialized stage: parameters by name (zoo.py's [Note: name-keyed init]:
        the values the full model would get), buffers copied from `reference_buffers`."""
        zoo.init_weights(module, seed=seed, aliases=aliases)
        buffers = [(n, b) for n, b in module.named_buffers(remove_duplicate=False) if b.device.type != "meta"]
        reference = self.reference_buffers() if buffers else {}
        for name, buffer in buffers:
            value = reference.get(name)
            if value is not None and value.shape == buffer.shape:
                buffer.copy_(value.to(buffer.dtype))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


class ZooSource(ModelSource):
    """A built-in gpt / llama model (autoplan.graph.zoo), fed token ids below its vocabulary."""

    def __init__(self, spec: zoo.ModelSpec):
        self.model_spec = spec
        self.spec = spec.text
        self.name = spec.name

    def build(self, device: torch.device | str = "meta") -> nn.Module:
        try:
            return zoo.build_model(self.model_spec, device=device)
        except RuntimeError as exc:  # e.g. "Storage size calculation overflowed" for absurd sizes
            raise SourceError(f"cannot build {self.name}: {str(exc).strip().splitlines()[0]}; check its sizes") from None

    def input_templates(self) -> tuple[InputTemplate, ...]:
        config = self.model_spec.config
        return (InputTemplate((1, config.max_seq_len), torch.int64, 0, config.vocab_size, 0, 1),)

    @property
    def loss_fn(self) -> Callable[..., Tensor]:
        return zoo.lm_loss

    @property
    def default_seq_len(self) -> int:
        return self.model_spec.config.max_seq_len

    @property
    def max_seq_len(self) -> int:
        return self.model_spec.config.max_seq_len

    @property
    def info(self) -> dict[str, int | None]:
        return {k: v for k, v in zoo.model_info(self.model_spec).items() if isinstance(v, int)}

    def static_target(self, batch_size: int, seq_len: int | None) -> Tensor:
        return torch.empty((batch_size, seq_len or self.default_seq_len), dtype=torch.int64, device="meta")

    def check_seq_len(self, seq_len: int | None) -> None:
        if seq_len is not None and seq_len > self.max_seq_len:
            raise SourceError(f"seq_len {seq_len} exceeds max_seq_len {self.max_seq_len}; raise it, e.g. "
                              f"'{self.spec.split(':')[0]}:max_seq_len={seq_len}'")
        super().check_seq_len(seq_len)

    def batch(self, seed: int, step: int, batch_size: int, seq_len: int | None, output_shape: Sequence[int],
              output_dtype: torch.dtype) -> tuple[tuple, Tensor]:
        ids, targets = token_batch(seed, step, batch_size, seq_len or self.default_seq_len,
                                   self.model_spec.config.vocab_size)
        return (ids,), targets


def _templates_from_examples(examples: Sequence[Any], vocab: int | None) -> tuple[InputTemplate, ...]:
    """Templates from a user's example inputs: dim 0 is the batch; dim 1 of the first integer input
    of two or more dimensions (token ids; else of the first 3-D float input, (batch, sequence,
    features)) is the sequence, and so is dim 1 of every other input of that length (masks,
    positions, embeddings); integer inputs keep their value range (or stay below the vocabulary when
    the examples are on meta). Images (4-D) have no sequence."""
    tensors = [t for t in examples if isinstance(t, Tensor)]
    batch = next((t.shape[0] for t in tensors if t.dim() > 0), None)
    ids = next((t for t in tensors if not t.dtype.is_floating_point and t.dim() >= 2), None)
    if ids is None:  # no token ids: a (batch, sequence, features) float input carries the sequence
        ids = next((t for t in tensors if t.dtype.is_floating_point and t.dim() == 3), None)
    seq = ids.shape[1] if ids is not None else None
    out = []
    for value in examples:
        if not isinstance(value, Tensor):
            out.append(InputTemplate(None, None, constant=value))
            continue
        batch_dim = 0 if value.dim() > 0 and value.shape[0] == batch else None
        seq_dim = 1 if seq is not None and value.dim() >= 2 and value.shape[1] == seq else None
        low, high = 0, 2
        if not value.dtype.is_floating_point and value.dtype != torch.bool:
            if value.device.type != "meta" and value.numel():
                low, high = int(value.min()), int(value.max()) + 1
            elif vocab is not None:
                high = vocab
        out.append(InputTemplate(tuple(value.shape), value.dtype, low, high, batch_dim, seq_dim))
    return tuple(out)


def _smallest_vocabulary(module: nn.Module) -> int | None:
    sizes = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
    return min(sizes) if sizes else None


class FileSource(ModelSource):
    """A user's `file.py:function`; the function returns (module, example_inputs) or
    (module, example_inputs, loss_fn) and is called under `torch.device("meta")` for planning."""

    def __init__(self, spec: zoo.ModelSpec):
        self.model_spec = spec
        self.spec = spec.text
        self.name = spec.name
        self.path = spec.path
        self._loaded: tuple[nn.Module, tuple, Callable | None] | None = None
        self._buffers: dict[str, Tensor] | None = None

    def _load(self) -> tuple[nn.Module, tuple, Callable | None]:
        if self._loaded is None:
            self._loaded = zoo.load_user_model(self.model_spec, device="meta", with_loss=True)
        return self._loaded

    def build(self, device: torch.device | str = "meta") -> nn.Module:
        module = self._load()[0]
        if torch.device(device).type != "meta":
            module.to_empty(device=device)
            self.init_weights(module, seed=0, aliases=tied_parameter_names(module))
        return module

    def reference_buffers(self) -> dict[str, Tensor]:
        """The function's model built once more with its parameters on meta: its buffers' values."""
        if self._buffers is None:
            try:
                with parameters_on_meta():
                    module = zoo.load_function(self.model_spec)()[0]
            except Exception as exc:
                raise SourceError(f"{self.name}() raised {type(exc).__name__}: {exc}") from exc
            self._buffers = {n: b.detach() for n, b in module.named_buffers(remove_duplicate=False)}
        return self._buffers

    def input_templates(self) -> tuple[InputTemplate, ...]:
        module, examples, _ = self._load()
        return _templates_from_examples(examples, _smallest_vocabulary(module))

    @property
    def loss_fn(self) -> Callable[..., Tensor]:
        return self._load()[2] or default_loss

    @property
    def max_seq_len(self) -> int | None:
        return None

    def file_digest(self) -> str:
        return hashlib.sha256(Path(self.path).read_bytes()).hexdigest()


class ModuleSource(ModelSource):
    """An nn.Module handed to the Python API with its example inputs (and loss)."""

    def __init__(self, module: nn.Module, example_inputs: Sequence[Any], loss_fn: Callable | None = None):
        self.module = module
        self.examples = tuple(example_inputs)
        self._loss = loss_fn
        self.spec = type(module).__name__
        self.name = self.spec

    def build(self, device: torch.device | str = "meta") -> nn.Module:
        return self.module

    def input_templates(self) -> tuple[InputTemplate, ...]:
        return _templates_from_examples(self.examples, _smallest_vocabulary(self.module))

    @property
    def loss_fn(self) -> Callable[..., Tensor]:
        return self._loss or default_loss


def as_source(model: str | nn.Module | ModelSource, example_inputs: Sequence[Any] | None = None,
              loss_fn: Callable[..., Tensor] | None = None) -> ModelSource:
    """The source of what a user passed: a spec string, a source, or an nn.Module with its example
    inputs (and loss)."""
    if isinstance(model, (str, ModelSource)):
        return parse_source(model)
    if isinstance(model, nn.Module):
        if example_inputs is None:
            raise SourceError("an nn.Module needs example_inputs, e.g. example_inputs=(torch.randint(0, V, (1, 128)),)")
        return ModuleSource(model, example_inputs, loss_fn)
    raise SourceError(f"model must be a spec string or an nn.Module, got {type(model).__name__}")


def parse_source(spec: str | ModelSource) -> ModelSource:
    """The source a spec string names (module docstring); a source is returned as it is."""
    if isinstance(spec, ModelSource):
        return spec
    if isinstance(spec, str) and spec.strip().startswith("hf:"):
        from autoplan.graph import hf

        return hf.HFSource.from_spec(spec.strip())
    parsed = zoo.parse_model_spec(spec)
    return FileSource(parsed) if parsed.family == "file" else ZooSource(parsed)


# ---- tracing a source with its loss ------------------------------------------------------------


@dataclass(frozen=True)
class OutputTemplate:
    """Shape (at the traced batch) and dtype of the tensor the loss's target follows (the logits)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def trace_with_target(module: nn.Module, inputs: Sequence[Any], loss_fn: Callable[..., Tensor], *,
                      target_maker: Callable[[OutputTemplate, int], Tensor], example_target: Tensor | None = None,
                      leaf_modules: Sequence[str] = (), tracer: str = "auto"):
    """Trace `module` on `inputs` and append `loss_fn(output, target)`; returns (traced, graph inputs,
    output template). Without `example_target` the target is made by `target_maker(template,
    batch rows)` from the output's shape, found by one fake-tensor forward of the traced graph;
    with one, the template is None."""
    from autoplan.graph.profile import fake_output
    from autoplan.graph.trace import append_loss, trace_model

    traced = trace_model(module, inputs, leaf_modules=leaf_modules, tracer=tracer)
    template = None  # with a target given, no forward is needed (a cached profile runs none)
    if example_target is None:
        logits = first_tensor(fake_output(traced, inputs))
        template = OutputTemplate(tuple(int(d) for d in logits.shape), logits.dtype)
        rows = next((t.shape[0] for t in inputs if isinstance(t, Tensor) and t.dim() > 0), 1)
        example_target = target_maker(template, rows)
    traced = append_loss(traced, loss_fn)
    return traced, [*inputs, example_target], template
