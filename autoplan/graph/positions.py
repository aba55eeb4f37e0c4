"""Which positions of the sequence this process computes (context parallelism's contract with a model).

Under context parallelism (runtime/context.py) each rank of a cp group holds a share of every
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

import torch

__all__ = ["POSITIONS_ATTRIBUTE", "holding_positions", "positions_refusal_of", "sequence_positions"]

POSITIONS_ATTRIBUTE = "positions_from_context"
"""Class attribute by which a model says its position-dependent code reads `sequence_positions()`."""

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


@contextlib.contextmanager
def holding_positions(positions: torch.Tensor | None) -> Iterator[None]:
    """Code inside this block computes on the tokens at `positions` of each sequence."""
    previous = sequence_positions()
    _state.positions = positions
    try:
        yield
    finally:
        _state.positions = previous
