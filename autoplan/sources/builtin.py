"""The built-in models (autoplan.models) as a model source: `gpt2-small`, `llama:num_layers=4,...`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from autoplan import models
from autoplan.sources.base import InputTemplate, ModelSource, SourceError, token_batch

__all__ = ["ZooSource"]



class ZooSource(ModelSource):
    """A built-in gpt / llama model (autoplan.models), fed token ids below its vocabulary."""

    def __init__(self, spec: models.ModelSpec):
        self.model_spec = spec
        self.spec = spec.text
        self.name = spec.name

    def build(self, device: torch.device | str = "meta") -> nn.Module:
        try:
            return models.build_model(self.model_spec, device=device)
        except RuntimeError as exc:  # e.g. "Storage size calculation overflowed" for absurd sizes
            raise SourceError(f"cannot build {self.name}: {str(exc).strip().splitlines()[0]}; check its sizes") from None

    def input_templates(self) -> tuple[InputTemplate, ...]:
        config = self.model_spec.config
        return (InputTemplate((1, config.max_seq_len), torch.int64, 0, config.vocab_size, 0, 1),)

    @property
    def loss_fn(self) -> Callable[..., Tensor]:
        return models.lm_loss

    @property
    def default_seq_len(self) -> int:
        return self.model_spec.config.max_seq_len

    @property
    def max_seq_len(self) -> int:
        return self.model_spec.config.max_seq_len

    @property
    def info(self) -> dict[str, int | None]:
        return {k: v for k, v in models.model_info(self.model_spec).items() if isinstance(v, int)}

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

