"""A user's own model as a source: a file's `path/to/model.py:function` (`FileSource`), or an
nn.Module handed to the Python API with its example inputs (`ModuleSource`).

Together because both learn their inputs the same way: from the example inputs the user gives.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from autoplan import models
from autoplan.sources.base import (
    InputTemplate,
    ModelSource,
    SourceError,
    default_loss,
    parameters_on_meta,
    tied_parameter_names,
)

__all__ = ["FileSource", "ModuleSource"]



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

    def __init__(self, spec: models.ModelSpec):
        self.model_spec = spec
        self.spec = spec.text
        self.name = spec.name
        self.path = spec.path
        self._loaded: tuple[nn.Module, tuple, Callable | None] | None = None
        self._buffers: dict[str, Tensor] | None = None

    def _load(self) -> tuple[nn.Module, tuple, Callable | None]:
        if self._loaded is None:
            self._loaded = models.load_user_model(self.model_spec, device="meta", with_loss=True)
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
                    module = models.load_function(self.model_spec)()[0]
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

