"""Model sources: every way a user names a model, as one object that rebuilds it anywhere.

A `ModelSource` is what the planner and the runtime ask about a model (docs/architecture.md, "Model
sources"). It is made from a spec string, and the spec is what a plan records, so
`autoplan run plan.json` rebuilds the very model `suggest` planned, on every rank:

    gpt2-small, llama:num_layers=4,...     the built-in zoo (`ZooSource`)
    path/to/model.py:build                 a user's file (`FileSource`); build() returns
                                           (module, example_inputs) or (module, example_inputs, loss_fn)
    hf:PATH, hf:MODEL_TYPE:key=value,...   a Hugging Face model from its config (`autoplan.sources.hf`)
    an nn.Module passed to the API         `ModuleSource` (the API's caller gives the inputs)
    a transformers model object            `HFModelSource`: planned as its hf: spec, with its own weights

A source answers: build the module (on meta: nothing allocated), its example inputs at any batch
size and sequence length (shapes on meta, values elsewhere), a training batch for step k (a pure
function of seed and step, so resumed runs see the same data), a target for the loss, and the loss.

The package sits above both `autoplan.graph` (analysis of any model) and `autoplan.models` (the
built-in definitions) and below the planner and the runtime, so all of them use sources and no
import runs in a circle (pyproject.toml's import contract):

    base.py      ModelSource, SourceError, the default loss ([Note: the default loss]), input templates
    builtin.py   ZooSource
    user.py      FileSource, ModuleSource
    hf.py        HFSource (transformers, imported only for `hf:` specs)
    hf_object.py HFModelSource, a transformers model object as its hf: spec ([Note: transformers objects as hf: sources])
    hf_loss.py   a transformers model's loss (with a MoE router's aux loss)
    tracing.py   trace_with_target: a source's model traced with its loss
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from autoplan import models
from autoplan.sources.base import (
    InputTemplate,
    ModelSource,
    SourceError,
    default_loss,
    default_target,
    first_tensor,
    parameters_on_meta,
    tied_parameter_names,
    token_batch,
)
from autoplan.sources.builtin import ZooSource
from autoplan.sources.tracing import OutputTemplate, trace_with_target
from autoplan.sources.user import FileSource, ModuleSource

__all__ = [
    "FileSource", "InputTemplate", "ModelSource", "ModuleSource", "OutputTemplate", "SourceError", "ZooSource",
    "as_source", "default_loss", "default_target", "first_tensor", "parameters_on_meta", "parse_source",
    "tied_parameter_names", "token_batch", "trace_with_target",
]


def as_source(model: str | nn.Module | ModelSource, example_inputs: Sequence[Any] | None = None,
              loss_fn: Callable[..., Tensor] | None = None) -> ModelSource:
    """The source of what a user passed: a spec string, a source, a transformers model object (as its
    hf: spec: `_transformers_source`), or an nn.Module with its example inputs (and loss)."""
    if isinstance(model, (str, ModelSource)):
        return parse_source(model)
    if isinstance(model, nn.Module):
        hf_source = _transformers_source(model, example_inputs, loss_fn)
        if hf_source is not None:
            return hf_source
        if example_inputs is None:
            raise SourceError("an nn.Module needs example_inputs, e.g. example_inputs=(torch.randint(0, V, (1, 128)),)")
        return ModuleSource(model, example_inputs, loss_fn)
    raise SourceError(f"model must be a spec string or an nn.Module, got {type(model).__name__}")


def _transformers_source(model: nn.Module, example_inputs: Sequence[Any] | None,
                         loss_fn: Callable[..., Tensor] | None) -> ModelSource | None:
    """A transformers model object as its hf: spec's source, when its config rebuilds it (the same
    parameter and buffer names and shapes); else None ([Note: transformers objects as hf: sources])."""
    from autoplan.sources.hf_object import HFModelSource, is_transformers_model

    if not is_transformers_model(model):
        return None
    from autoplan.graph.profile import model_fingerprint

    try:
        source = HFModelSource(model, example_inputs, loss_fn)
        rebuilt = source.build("meta")
    except SourceError:
        if example_inputs is None:
            raise
        return None  # a config the hf: path refuses: the object as given (a ModuleSource)
    if model_fingerprint(rebuilt) == model_fingerprint(model):
        return source
    if example_inputs is None:
        ours = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
        theirs = {n: tuple(t.shape) for n, t in [*rebuilt.named_parameters(), *rebuilt.named_buffers()]}
        name = next((n for n in [*ours, *theirs] if ours.get(n) != theirs.get(n)), type(model).__name__)
        raise SourceError(f"{type(model).__name__} is not the model its config builds ({name!r}: "
                          f"{ours.get(name, 'absent')} here, {theirs.get(name, 'absent')} from the config); "
                          "pass example_inputs to plan it as it is")
    return None


def parse_source(spec: str | ModelSource) -> ModelSource:
    """The source a spec string names (module docstring); a source is returned as it is."""
    if isinstance(spec, ModelSource):
        return spec
    if isinstance(spec, str) and spec.strip().startswith("hf:"):
        from autoplan.sources import hf

        return hf.HFSource.from_spec(spec.strip())
    parsed = models.parse_model_spec(spec)
    return FileSource(parsed) if parsed.family == "file" else ZooSource(parsed)

