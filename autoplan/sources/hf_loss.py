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

Where the model's aux loss is transformers' `load_balancing_loss_func` (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, ...: the function its modeling module defines), the source computes the same loss
itself from the `router_logits` the model returns (`balance_loss`), so that context parallelism splits
it exactly: the share of picks per expert is a mean over the batch's tokens, which a rank holding part
of each sequence sums over its cp group (graph/positions.py `sum_over_sequence`, as Megatron-LM's
router sums tokens per expert over tp x cp); the mean router probability stays the rank's, and the
mean of the ranks' losses is the whole batch's. Without cp it is transformers' number (tests compare
them). A model whose aux loss is another function keeps its own, and is not offered cp
(hf_context.py).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from autoplan.graph.positions import sum_over_sequence
from autoplan.sources.base import SourceError, default_loss

__all__ = ["balance_loss", "computes_balance_loss", "hf_loss", "recomputes_balance_loss"]

_EXPERT_COUNTS = ("num_local_experts", "num_experts")
"""The config fields transformers' MoE configs name their routed experts with, in order."""

_AUX_LOSS_COEFS = ("router_aux_loss_coef", "aux_loss_coef")
"""The config fields transformers' MoE causal LMs weigh `aux_loss` with, in order."""


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _routing(config: Any) -> tuple[int, int] | None:
    """(routed experts, experts per token) of a transformers MoE config, or None."""
    experts = next((getattr(config, f) for f in _EXPERT_COUNTS if isinstance(getattr(config, f, None), int)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    return (experts, top_k) if isinstance(experts, int) and isinstance(top_k, int) else None


def computes_balance_loss(model_class: type) -> bool:
    """Whether the model's modeling code has a router loss (`load_balancing_loss_func`: transformers'
    MoE models return `aux_loss` from it with output_router_logits=true; those without it return
    router logits and no loss)."""
    return callable(getattr(sys.modules.get(model_class.__module__), "load_balancing_loss_func", None))


def recomputes_balance_loss(config: Any, model_class: type) -> bool:
    """Whether the model's aux loss is transformers' Switch loss (`load_balancing_loss_func` in its
    modeling module) over routing the config states, which `balance_loss` computes again: the
    module's function is called on random router logits and must give `balance_loss`'s number."""
    routing = _routing(config)
    return routing is not None and _same_as_balance_loss(model_class.__module__, *routing)


@functools.cache
def _same_as_balance_loss(module_name: str, num_experts: int, top_k: int) -> bool:
    function = getattr(sys.modules.get(module_name), "load_balancing_loss_func", None)
    if not callable(function) or not 0 < top_k <= num_experts:
        return False
    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(16, num_experts, generator=generator, dtype=torch.float32, device="cpu")
                   for _ in range(2))
    try:
        theirs = function(logits, num_experts, top_k)
        return isinstance(theirs, torch.Tensor) and torch.allclose(
            theirs.float(), balance_loss(logits, num_experts, top_k), rtol=1e-5, atol=1e-7)
    except Exception:  # another signature: not the Switch loss this module computes again
        return False


def balance_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (Fedus et al. 2021, eqs. 4-6) over every layer's
    router logits (rows: tokens): num_experts x sum_e f_e P_e, f_e the share of top-k picks routed to
    expert e and P_e its mean router probability, both over all layers' rows, as transformers'
    `load_balancing_loss_func` computes it; f_e summed over the cp group ([Note: HF auxiliary losses])."""
    picks = router_logits[0].new_zeros(num_experts, dtype=torch.float32)
    probs = router_logits[0].new_zeros(num_experts, dtype=torch.float32)
    rows = 0
    for logits in router_logits:
        weights = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        picks = picks + torch.zeros_like(picks).scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
        probs = probs + weights.sum(dim=0)
        rows += weights.shape[0]
    # f_e over the whole sequence: the picks and rows of the ranks holding its other chunks.
    counted = sum_over_sequence(torch.cat([picks, picks.new_full((1,), float(rows))]))
    share = counted[:-1] / counted[-1:]
    return num_experts * (share * probs / rows).sum()


def hf_loss(config: Any, name: str, model_class: type | None = None) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """loss(output, target) of the model of `config` ([Note: HF auxiliary losses]); `name` names the
    model in the error for an aux loss without a coefficient. With `model_class` whose aux loss is
    transformers' Switch loss, that loss is computed from the router logits (`balance_loss`)."""
    coef = next((getattr(config, f) for f in _AUX_LOSS_COEFS if _is_number(getattr(config, f, None))), None)
    routing = _routing(config) if model_class is not None and recomputes_balance_loss(config, model_class) else None

    def loss_with_aux(output: Any, target: torch.Tensor) -> torch.Tensor:  # a function: fx names it in the graph
        loss = default_loss(output, target)
        aux = output.get("aux_loss") if isinstance(output, Mapping) else None
        if not isinstance(aux, torch.Tensor):
            return loss
        if coef is None:
            raise SourceError(f"{name} returns an aux_loss but its config has none of {', '.join(_AUX_LOSS_COEFS)} "
                              "to weigh it with; set output_router_logits=false or set the coefficient")
        logits = output.get("router_logits")
        if routing is not None and isinstance(logits, (tuple, list)) and logits:
            aux = balance_loss(logits, *routing)
        return loss + coef * aux.float()

    return loss_with_aux
