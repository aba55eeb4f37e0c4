"""Which positions of the sequence this process computes (context parallelism's contract with a model).

Under context parallelism (runtime/parallel/context.py) each rank of a cp group holds a share of every
sequence: 2 * cp chunks, rank i holding chunks i and 2 * cp - 1 - i, so that causal attention costs
each rank the same (the load balancing of Llama 3, arXiv:2407.21783 Sec. 3.3.2, and torchtitan's
context parallelism). Token-wise layers need nothing; what depends on a token's place in the
sequence must be told it. A model source can feed positions through an input (`position_ids`,
sources/base.py `ModelSource.context_parallel_refusal`: transformers models, model files); a model
can instead read `sequence_positions()` (the zoo's rotary embedding does) and say so with a class
attribute `positions_from_context = True`. Models told neither way are not offered context
parallelism. Attention itself is handled by the runtime, which routes
`scaled_dot_product_attention` through the cp group.

This is torch's `context_parallel(buffers=..., buffer_seq_dims=...)` contract (the caller names the
position tables to shard) turned around: the model asks, so a stage needs no list of buffers.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["POSITIONS_ATTRIBUTE", "SPLIT_NOTE_METHOD", "SPLIT_REFUSAL_METHOD", "holding_positions", "positions_refusal_of",
           "sequence_positions", "sequence_split_note", "sequence_split_refusal", "sum_over_sequence"]

POSITIONS_ATTRIBUTE = "positions_from_context"
"""Class attribute by which a model says its position-dependent code reads `sequence_positions()`."""

SPLIT_REFUSAL_METHOD = "sequence_split_refusal"
"""A method of a module whose computation spans its sequence beyond attention (a router's capacity and
load-balancing loss): `module.sequence_split_refusal()` says why its sequences cannot be split over
a cp group (one line naming the fix), or None when they can (it sums what it counts over the
sequence with `sum_over_sequence`, or counts over its rank's tokens as Megatron-LM does)."""

SPLIT_NOTE_METHOD = "sequence_split_note"
"""A method of such a module whose result under cp differs from one process's by design: a capacity
counted over the tokens a rank holds (models/moe.py [Note: capacity under context parallelism]).
`module.sequence_split_note()` says what differs and how to avoid it (one line), or None when
nothing does."""


def sequence_split_refusal(model: torch.nn.Module, has_experts: bool) -> str | None:
    """Why `model`'s modules keep its sequences whole, or None: each module's own verdict
    (`SPLIT_REFUSAL_METHOD`); a model with experts (`has_experts`, graph/experts.py) whose modules
    give none routes and balances over whole sequences as far as anyone knows."""
    verdicts = [getattr(m, SPLIT_REFUSAL_METHOD)() for m in model.modules() if hasattr(m, SPLIT_REFUSAL_METHOD)]
    if has_experts and not verdicts:
        return "its experts take a capacity and a balance loss per whole sequence"
    return next((v for v in verdicts if v is not None), None)


def sequence_split_note(model: torch.nn.Module) -> str | None:
    """What splitting `model`'s sequences over a cp group changes in what it computes (the first of
    its modules' `SPLIT_NOTE_METHOD` lines), or None when a cp run computes what one process does.
    Said on a cp plan (`context_parallel_support`'s note) and by `autoplan run` before its ranks start."""
    notes = (getattr(m, SPLIT_NOTE_METHOD)() for m in model.modules() if hasattr(m, SPLIT_NOTE_METHOD))
    return next((n for n in notes if n is not None), None)


def positions_refusal_of(model: torch.nn.Module) -> str | None:
    """Why `model` alone (no model source to feed it positions) cannot be told its tokens' positions,
    or None when it reads `sequence_positions()`."""
    if getattr(type(model), POSITIONS_ATTRIBUTE, False):
        return None
    return (f"{type(model).__name__} cannot be told its tokens' positions: give its forward a position_ids "
            "argument (int64, batch x sequence) used for its position embeddings, or read autoplan's "
            "sequence_positions()")


# Process-wide, not thread-local: on CUDA the autograd engine runs backward passes, and the
# forwards that recomputation replays inside them, on its own device threads, which must see
# the positions the step set (each rank is its own process).
_state = types.SimpleNamespace()


def sequence_positions() -> torch.Tensor | None:
    """The positions (int64, in the order the local tokens are held) of the tokens this process
    holds of each sequence, or None when it holds whole sequences."""
    return getattr(_state, "positions", None)


def sum_over_sequence(value: torch.Tensor) -> torch.Tensor:
    """`value`, a count over this process's tokens of each sequence, summed over the processes that
    hold the rest of it (the cp group; not differentiated): a copy of `value` when it holds whole
    sequences. Megatron-LM sums a router's tokens per expert over its tp x cp group before the
    load-balancing loss the same way (megatron/core/transformer/moe/router.py, TopKRouter). An
    operator of its own (`autoplan::sum_over_sequence`), so a graph that traces through its caller
    without a cp group keeps the call and sums at run time. A DTensor (a value computed under tp) is
    summed as its local tensor, in its layout: the sum over the cp group is elementwise and linear,
    so every placement keeps its meaning."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        summed = torch.ops.autoplan.sum_over_sequence(value.to_local().detach())
        return DTensor.from_local(summed, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())
    return torch.ops.autoplan.sum_over_sequence(value.detach())


@torch.library.custom_op("autoplan::sum_over_sequence", mutates_args=())
def _sum_over_sequence(value: torch.Tensor) -> torch.Tensor:
    total = value.clone()
    group = getattr(_state, "group", None)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(total, group=group)
    return total


@_sum_over_sequence.register_fake
def _(value: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(value)


@contextlib.contextmanager
def holding_positions(positions: torch.Tensor | None, group: Any = None) -> Iterator[None]:
    """Code inside this block computes on the tokens at `positions` of each sequence; `group` (a
    process group) holds the rest of each sequence."""
    previous = sequence_positions(), getattr(_state, "group", None)
    _state.positions, _state.group = positions, group
    try:
        yield
    finally:
        _state.positions, _state.group = previous
