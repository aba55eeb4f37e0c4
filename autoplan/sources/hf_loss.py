"""The training loss of a transformers model: sources/base.py's default loss, plus the routers'
load-balancing loss a mixture-of-experts model returns, weighed as transformers weighs it.

Apart from sources/hf.py (which builds and feeds the model) because it is what transformers computes
from the model's output, not how the model is made; it reads only the config.

[Note: HF auxiliary losses]
A transformers MoE model built with `output_router_logits=true` (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, ...) returns `aux_loss`, its routers' load-balancing loss over every layer's router logits
(`load_balancing_loss_func`, Switch Transformer, Fedus et al. 2021, eqs. 4-6), and adds
`router_aux_loss_coef * aux_loss` to its loss when given labels (JetMoE names the coefficient
`aux_loss_coef`). autoplan gives the model no labels, so the source's loss adds it the same way:
the training loss is transformers' own. The output holds `aux_loss` before `logits`; the logits are
taken by name (base.py's `first_tensor`). The traced graph computes `aux_loss` in the model's last
block from every layer's router logits, which the pipeline carries over the cuts to the last stage
like any other value; with ep the routers run on a rank's own tokens before any exchange. Each
micro-batch's aux loss counts that micro-batch's tokens, as one process accumulating gradients over
the same micro-batches counts them. With `output_router_logits=false` (transformers' default) the
model computes no aux loss, and none is added.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from autoplan.sources.base import SourceError, default_loss

__all__ = ["hf_loss"]

_AUX_LOSS_COEFS = ("router_aux_loss_coef", "aux_loss_coef")
"""The config fields transformers' MoE causal LMs weigh `aux_loss` with, in order."""


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def hf_loss(config: Any, name: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """loss(output, target) of the model of `config` ([Note: HF auxiliary losses]); `name` names the
    model in the error for an aux loss without a coefficient."""
    coef = next((getattr(config, f) for f in _AUX_LOSS_COEFS if _is_number(getattr(config, f, None))), None)

    def loss_with_aux(output: Any, target: torch.Tensor) -> torch.Tensor:  # a function: fx names it in the graph
        loss = default_loss(output, target)
        aux = output.get("aux_loss") if isinstance(output, Mapping) else None
        if not isinstance(aux, torch.Tensor):
            return loss
        if coef is None:
            raise SourceError(f"{name} returns an aux_loss but its config has none of {', '.join(_AUX_LOSS_COEFS)} "
                              "to weigh it with; set output_router_logits=false or set the coefficient")
        return loss + coef * aux.float()

    return loss_with_aux
