"""What every model source is (`ModelSource`) and what sources share: the default loss and target,
input templates, the training batch of a step, and the error a source raises.

Apart from the sources themselves (builtin.py, user.py, hf.py) so that each of them, and the
runtime, imports this without importing the others.

[Note: the default loss]
`loss_fn(output, target)` receives what the model's forward returns (a tensor, a tuple, a dict or
a transformers `ModelOutput`). Without a user loss, `default_loss` takes the logits (the `logits`
entry, else the first tensor that is not a scalar) and computes the mean cross entropy against
integer class targets of shape `logits.shape[:-1]` (causal LM, masked LM, token and sequence classification alike; the
targets are synthetic, so no next-token shift is needed), or the mean squared error against a
float target of the output's shape when the last dimension is 1.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoplan import models
from autoplan.graph.positions import positions_refusal_of

__all__ = [
    "InputTemplate", "ModelSource", "SourceError", "default_loss", "default_target", "first_tensor",
    "parameters_on_meta", "tied_parameter_names", "to_empty_keeping_ties", "token_batch",
]


class SourceError(ValueError):
    """A model source that cannot be built or fed as asked (one-line message naming the fix)."""


# ---- the loss ----------------------------------------------------------------------------------


def first_tensor(output: Any) -> Tensor:
    """The logits of a model output: `output.logits` / `output["logits"]` when present, else the
    first tensor found in order (a tensor, tuple, list, dict or ModelOutput) that is not a scalar
    (a scalar is a loss, such as a router's `aux_loss`, never logits), else the first scalar."""
    found = _first_tensor(output, scalars=False)
    return found if found is not None else _first_tensor(output, scalars=True)


def _first_tensor(output: Any, *, scalars: bool) -> Tensor | None:
    if isinstance(output, Tensor):
        return output if scalars or output.dim() > 0 else None
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
            found = _first_tensor(value, scalars=scalars)
        except SourceError:
            continue
        if found is not None:
            return found
    if not scalars:
        return None
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
    float inputs from a standard normal; a non-tensor is passed as it is. `positions`: the input
    holds each token's position in its sequence (`arange` along `seq_dim`), the `position_ids` by
    which context parallelism tells a model where its tokens are (runtime/parallel/context.py)."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    low: int = 0
    high: int = 2
    batch_dim: int | None = 0
    seq_dim: int | None = None
    constant: Any = None
    positions: bool = False

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
        if self.positions:
            view = [1] * len(shape)
            view[self.seq_dim] = shape[self.seq_dim]
            return torch.arange(shape[self.seq_dim], device=device).to(self.dtype).view(view).expand(shape).clone()
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


def to_empty_keeping_ties(module: nn.Module, device: torch.device | str) -> dict[str, str]:
    """`module.to_empty(device=device)` with the parameters it shared shared again (`to_empty` gives
    each name its own tensor, so a tied head would train apart from its embedding); returns
    `tied_parameter_names` as it was before, for `init_weights`' aliases. The ties are read from
    the module itself, so any model keeps the ones it had, with or without a `tie_weights()`."""
    aliases = tied_parameter_names(module)
    module.to_empty(device=device)
    for name, first in aliases.items():
        if name != first:
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, module.get_parameter(first))
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

    def context_parallel_refusal(self, model: nn.Module) -> str | None:
        """Why context parallelism cannot split this source's sequences (one line naming the fix), or
        None when it can: the model must be told its tokens' positions, by an input the source feeds
        them through (an `InputTemplate` with `positions`: a forward argument named `position_ids`)
        or by reading `sequence_positions()` (graph/positions.py). Its attention must be
        `scaled_dot_product_attention`, which the runtime routes through the cp group; the profile
        checks that on the graph (graph/profile_extra.py)."""
        if any(t.positions for t in self.input_templates()):
            return None
        return positions_refusal_of(model)

    def routes_tokens_alone(self, model: nn.Module) -> bool:
        """Whether this source's experts (if any) route each token by itself, with nothing counted
        over a sequence or a batch: then context parallelism may split the sequences they see
        (graph/positions.py `sequence_split_refusal`). False unless the source knows: a model's own
        experts may count a capacity or a balance loss over whole sequences, and say so themselves
        (`SPLIT_REFUSAL_METHOD`), as the zoo's do."""
        return False

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
        """Initialize a materialized stage: parameters by name (models/init.py's [Note: name-keyed init]:
        the values the full model would get), buffers copied from `reference_buffers`."""
        models.init_weights(module, seed=seed, aliases=aliases)
        buffers = [(n, b) for n, b in module.named_buffers(remove_duplicate=False) if b.device.type != "meta"]
        reference = self.reference_buffers() if buffers else {}
        for name, buffer in buffers:
            value = reference.get(name)
            if value is not None and value.shape == buffer.shape:
                buffer.copy_(value.to(buffer.dtype))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

