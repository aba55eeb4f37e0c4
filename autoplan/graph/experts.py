"""Which modules of a model are stacks of experts (mixture-of-experts layers), from their shapes.

A grouped-experts module holds `num_experts` experts as stacked parameters whose first dimension
is the expert, and takes tokens grouped by expert: input (num_experts, tokens, ...) -> output of
the same leading shape (torchtitan's `GroupedExperts`, the zoo's `GroupedExperts`). That is all
expert parallelism needs (runtime/experts.py): a rank keeps a slice of the experts along that
dimension and exchanges the token groups with an all-to-all. The module says it is one by an
integer attribute `num_experts` that every one of its own parameters has as its first dimension;
no class name is looked up, so a user's model opts in by the same two facts.
"""

from __future__ import annotations

from torch import nn

__all__ = ["expert_modules", "is_grouped_experts"]


def is_grouped_experts(module: nn.Module) -> bool:
    """Whether `module` is a stack of experts as the module docstring describes."""
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 2:
        return False
    params = list(module.parameters(recurse=False))
    return bool(params) and all(p.dim() >= 2 and p.shape[0] == count for p in params)


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every grouped-experts module of `model` by its path (none inside another)."""
    return {name: m for name, m in model.named_modules() if is_grouped_experts(m)}
