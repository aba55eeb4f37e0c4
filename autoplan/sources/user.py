"""A user's own model as a source: a file's `path/to/model.py:function` (`FileSource`), or an
nn.Module handed to the Python API with its example inputs (`ModuleSource`).

Together because both learn their inputs the same way: from the example inputs the user gives.

[Note: the vocabulary token ids are drawn from]
An integer example input on meta (a file's `build()` runs under `torch.device("meta")`) has lost
its values, so its range comes from the model: it is the vocabulary of the embedding table the
input indexes, found by running the forward once on meta and following every integer tensor
derived from each input (views, slices, shifts) to the lookups it reaches (`embedding`, `table[ids]`). Not the
smallest `nn.Embedding` of the model: that is often a position table (OPT's and BART's learned
positions), and ids drawn below it would leave most of the vocabulary untrained. A forward that
stops on meta (a value it needs, `.item()`) keeps the lookups made before it stopped (the token
lookup comes first); an input that reached no embedding falls back to the smallest table.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from autoplan import models
from autoplan.sources.base import (
    InputTemplate,
    ModelSource,
    SourceError,
    default_loss,
    parameters_on_meta,
    to_empty_keeping_ties,
)

__all__ = ["FileSource", "ModuleSource", "templates_from_examples"]


class _IdsToEmbeddings(TorchFunctionMode):
    """Follows integer tensors derived from the inputs to the row lookups they index (`_lookup`):
    `vocab[k]` is the smallest table input `k` reaches ([Note: the vocabulary token ids are drawn from])."""

    def __init__(self, inputs: dict[int, Tensor]):
        super().__init__()
        self._origin: dict[int, tuple[Tensor, frozenset[int]]] = {id(t): (t, frozenset((k,))) for k, t in inputs.items()}
        self.vocab: dict[int, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        origin = frozenset().union(*(self._origin[id(x)][1] for x in pytree.tree_leaves((args, kwargs))
                                     if isinstance(x, Tensor) and id(x) in self._origin))
        out = func(*args, **kwargs)
        if origin:
            table, ids = _lookup(func, args, kwargs)
            if (isinstance(table, Tensor) and table.dim() and isinstance(ids, Tensor) and id(ids) in self._origin
                    and ids.dtype != torch.bool):  # (a boolean index is a mask, not ids)
                for k in self._origin[id(ids)][1]:
                    self.vocab[k] = min(self.vocab.get(k, table.shape[0]), table.shape[0])
            for t in pytree.tree_leaves(out):  # ids stay integers; what floats carry is no longer an id
                if isinstance(t, Tensor) and not t.dtype.is_floating_point:
                    self._origin[id(t)] = (t, origin)
        return out


def _lookup(func: Callable, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """(table, ids) of a row lookup: `F.embedding(ids, weight)`, `torch.embedding(weight, ids)` or
    `table[ids]` (a model file's own lookup); (None, None) for any other call."""
    if func is F.embedding:
        named = dict(zip(("input", "weight"), args)) | kwargs
        return named.get("weight"), named.get("input")
    if func is torch.embedding:
        named = dict(zip(("weight", "input"), args)) | kwargs
        return named.get("weight"), named.get("input")
    if func is Tensor.__getitem__ and len(args) == 2:
        return args
    return None, None


def _vocabularies(module: nn.Module, examples: Sequence[Any]) -> dict[int, int]:
    """Input index -> the vocabulary of the table that input indexes, for the integer inputs on
    meta that reach one ([Note: the vocabulary token ids are drawn from])."""
    inputs = {k: t for k, t in enumerate(examples) if isinstance(t, Tensor) and t.device.type == "meta"
              and not t.dtype.is_floating_point and t.dtype != torch.bool}
    if not inputs:
        return {}
    mode = _IdsToEmbeddings(inputs)
    try:
        with torch.no_grad(), mode:
            module(*examples)
    except Exception:  # a value meta lacks (transformers' BART asks `.item()` of its padding mask after
        pass           # the token lookup): the lookups before it stand; inputs without one fall back
    return mode.vocab


def templates_from_examples(examples: Sequence[Any], module: nn.Module) -> tuple[InputTemplate, ...]:
    """Templates from a user's example inputs: dim 0 is the batch; dim 1 of the first integer input
    of two or more dimensions (token ids; else of the first 3-D float input, (batch, sequence,
    features)) is the sequence, and so is dim 1 of every other input of that length (masks,
    positions, embeddings); integer inputs keep their value range, or, on meta, are drawn below the
    vocabulary of the embedding they index ([Note: the vocabulary token ids are drawn from]).
    Images (4-D) have no sequence. An integer input that the forward takes as `position_ids` holds
    positions (`InputTemplate.positions`): `arange` along the sequence, which context parallelism
    cuts to a rank's tokens (runtime/parallel/context.py), as transformers models take them."""
    vocabularies = _vocabularies(module, examples)
    try:
        names = [p for p in inspect.signature(module.forward).parameters if p != "self"]
    except (TypeError, ValueError):
        names = []
    vocab = _smallest_vocabulary(module)
    tensors = [t for t in examples if isinstance(t, Tensor)]
    batch = next((t.shape[0] for t in tensors if t.dim() > 0), None)
    ids = next((t for t in tensors if not t.dtype.is_floating_point and t.dim() >= 2), None)
    if ids is None:  # no token ids: a (batch, sequence, features) float input carries the sequence
        ids = next((t for t in tensors if t.dtype.is_floating_point and t.dim() == 3), None)
    seq = ids.shape[1] if ids is not None else None
    out = []
    for k, value in enumerate(examples):
        if not isinstance(value, Tensor):
            out.append(InputTemplate(None, None, constant=value))
            continue
        batch_dim = 0 if value.dim() > 0 and value.shape[0] == batch else None
        seq_dim = 1 if seq is not None and value.dim() >= 2 and value.shape[1] == seq else None
        low, high = 0, 2
        if not value.dtype.is_floating_point and value.dtype != torch.bool:
            if value.device.type != "meta" and value.numel():
                low, high = int(value.min()), int(value.max()) + 1
            elif (table := vocabularies.get(k, vocab)) is not None:
                high = table
        positions = (k < len(names) and names[k] == "position_ids" and seq_dim is not None
                     and not value.dtype.is_floating_point and value.dtype != torch.bool)
        out.append(InputTemplate(tuple(value.shape), value.dtype, low, high, batch_dim, seq_dim, positions=positions))
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
        self._templates: tuple[InputTemplate, ...] | None = None

    def _load(self) -> tuple[nn.Module, tuple, Callable | None]:
        if self._loaded is None:
            self._loaded = models.load_user_model(self.model_spec, device="meta", with_loss=True)
        return self._loaded

    def build(self, device: torch.device | str = "meta") -> nn.Module:
        module = self._load()[0]
        if torch.device(device).type != "meta":
            self.input_templates()  # read while the module is on meta (the vocabularies run it there)
            # Initialized by name as the runtime initializes its stages, ties kept as the model had them.
            self.init_weights(module, seed=0, aliases=to_empty_keeping_ties(module, device))
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
        if self._templates is None:  # (`batch` asks every step; the vocabularies take a forward on meta)
            module, examples, _ = self._load()
            self._templates = templates_from_examples(examples, module)
        return self._templates

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
        self._templates: tuple[InputTemplate, ...] | None = None

    def build(self, device: torch.device | str = "meta") -> nn.Module:
        return self.module

    def input_templates(self) -> tuple[InputTemplate, ...]:
        if self._templates is None:
            self._templates = templates_from_examples(self.examples, self.module)
        return self._templates

    @property
    def loss_fn(self) -> Callable[..., Tensor]:
        return self._loss or default_loss

