"""A transformers model object handed to the Python API, as the source its `hf:` spec would be.

    autoplan.suggest(LlamaForCausalLM(config), "1x2xcpu", global_batch=8, cp=2)
    pm = autoplan.partition(model, plan)          # the object's own weights, each rank its slices

[Note: transformers objects as hf: sources]
A `PreTrainedModel` carries its config, so it is planned from it as `hf:MODEL_TYPE:...` is
(hf.py `HFSource`): built again on meta from the config with the object's own class
(`_from_config`), fed `input_ids` and, where context parallelism is offered, `position_ids`
(hf_context.py), with transformers' loss (hf_loss.py). Every dimension and check of the spec follows:
cp with transformers' attention interface, ep and expert tp over its experts, the routers' loss.
A plain `ModuleSource` (user.py) knew none of that: it was refused cp ("cannot be told its
tokens' positions") though the forward takes `position_ids`, and it traced the object's own
attention, whose mask transformers writes out from the local length (wrong for a rank's chunks).

What differs from the spec is only where the weights come from: a stage is initialized by copying
the object's parameters by name (each tp rank writing its slice of the full value, as for the
seeded values of a spec, runtime/parallel/split.py `materialize_stages`), and its buffers are the object's.
An object on meta (planning only) gets the spec's seeded values.

Example inputs the caller gives keep their meaning, as for any nn.Module: they are the forward's
arguments (user.py `templates_from_examples`), and cp is offered where they feed `position_ids`
and no attention mask (the cp attention is causal and takes no mask); without example inputs the
source makes the spec's inputs. An object whose structure its config does not rebuild (a module
replaced after construction: an adapter, a resized layer the config does not record) is not this
source: `as_source` keeps it a `ModuleSource`, comparing the two builds' fingerprints.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from autoplan.sources.base import InputTemplate, ModelSource
from autoplan.sources.hf import HFSource

__all__ = ["HFModelSource", "is_transformers_model"]


def is_transformers_model(model: Any) -> bool:
    """Whether `model` is a transformers `PreTrainedModel` (transformers is imported only if the
    caller's model already imported it)."""
    import sys

    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, nn.Module):
        return False
    try:
        return isinstance(model, transformers.PreTrainedModel)
    except Exception:  # a broken transformers install: not a model of it as far as we can tell
        return False


class HFModelSource(HFSource):
    """A transformers model object ([Note: transformers objects as hf: sources])."""

    def __init__(self, model: nn.Module, example_inputs: Sequence[Any] | None = None,
                 loss_fn: Callable[..., Tensor] | None = None):
        name = type(model).__name__
        super().__init__(f"hf:{name}", copy.deepcopy(model.config), model_class=type(model))
        # What a plan records: the class, as for any module object (an object is not rebuilt from a plan file).
        self.spec = self.name = name
        self.module = model
        self.examples = None if example_inputs is None else tuple(example_inputs)
        self._loss = loss_fn
        self._example_templates: tuple[InputTemplate, ...] | None = None
        if self.examples is not None and self._cp_refusal is None:
            self._cp_refusal = self._examples_refusal()

    def _examples_refusal(self) -> str | None:
        """Why the caller's example inputs keep cp off, or None (they feed positions and no mask)."""
        names = [p for p in inspect.signature(self._model_class.forward).parameters if p != "self"]
        given = dict(zip(names, self.examples))
        fix = (f"pass {self.name} without example_inputs (autoplan then feeds input_ids and position_ids, as for an "
               "hf: spec)")
        if not any(t.positions for t in self.input_templates()):
            return f"its example inputs give no position_ids; {fix}, or give them"
        if given.get("attention_mask") is not None:
            return (f"its example inputs give an attention_mask, which context parallelism's causal attention does "
                    f"not take; pass None there, or {fix}")
        return None

    def input_templates(self) -> tuple[InputTemplate, ...]:
        if self.examples is None:
            return super().input_templates()
        if self._example_templates is None:
            from autoplan.sources.user import templates_from_examples

            self._example_templates = templates_from_examples(self.examples, self.module)
        return self._example_templates

    @property
    def default_seq_len(self) -> int | None:
        if self.examples is None:
            return super().default_seq_len
        return ModelSource.default_seq_len.fget(self)  # the caller's inputs' length

    @property
    def loss_fn(self) -> Callable[..., Tensor]:
        return self._loss or super().loss_fn

    def build(self, device: torch.device | str = "meta") -> nn.Module:
        """The spec's build, in the object's train / eval mode module by module (an object put in
        eval mode runs without dropout, as it would by itself)."""
        model = super().build(device)
        modes = {name: m.training for name, m in self.module.named_modules()}
        for name, m in model.named_modules():
            m.training = modes.get(name, m.training)
        return model

    def _weights_on_meta(self) -> bool:
        return any(p.device.type == "meta" for p in self.module.parameters())

    def reference_buffers(self) -> dict[str, Tensor]:
        """The object's buffers (rotary tables as the object holds them); transformers' own for an
        object on meta."""
        buffers = dict(self.module.named_buffers(remove_duplicate=False))
        if any(b.device.type == "meta" for b in buffers.values()):
            return super().reference_buffers()
        return {n: b.detach() for n, b in buffers.items()}

    @torch.no_grad()
    def init_weights(self, module: nn.Module, seed: int, aliases: Mapping[str, str] | None = None) -> None:
        """The object's parameters copied by name (a tp shard takes its slice); seeded as the spec's
        when the object is on meta."""
        if self._weights_on_meta():
            super().init_weights(module, seed, aliases)
            return
        values = dict(self.module.named_parameters(remove_duplicate=False))
        seen: set[int] = set()
        for name, param in module.named_parameters(remove_duplicate=False):
            if id(param) in seen or param.device.type == "meta":
                continue
            seen.add(id(param))
            value = values.get((aliases or {}).get(name, name), values.get(name))
            if value is None or tuple(value.shape) != tuple(param.shape):
                from autoplan.sources.base import SourceError

                raise SourceError(f"{self.name}: parameter '{name}' of the model rebuilt from its config is not the "
                                  "object's; pass the model with example_inputs built as its config says")
            param.copy_(value.detach())
        reference = self.reference_buffers()
        for name, buffer in module.named_buffers(remove_duplicate=False):
            value = reference.get(name)
            if buffer.device.type != "meta" and value is not None and value.shape == buffer.shape:
                buffer.copy_(value.to(buffer.dtype))
