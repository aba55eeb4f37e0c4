"""Activation recomputation, run as the plan says (`plan.recompute`).

- `full` (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"; Korthikanti et al.
  2022, Sec. 5): every transformer block of a stage (kind `layer`, `attention` or `mlp`) keeps only
  its inputs; its forward runs again inside the backward. The stage's graph is cut into one
  GraphModule per block (`extract_submodule` over the stage's own graph, so the pieces share the
  stage's modules and parameters) and each recomputed piece runs under torch's non-reentrant
  `torch.utils.checkpoint.checkpoint` (RNG state preserved, so dropout recomputes identically).
- `selective` (Korthikanti et al. 2022, Sec. 5): only the attention core is recomputed. Within the
  transformer blocks, calls of `F.scaled_dot_product_attention` are intercepted with a
  `TorchFunctionMode` and run under `checkpoint`: q, k and v are kept, the kernel's output and
  log-sum-exp are dropped and recomputed. With a fused (flash) kernel that saves little, which is
  what the cost model counts ([profile.py] `attention_core_saved_bytes = 0`); the s x s matrix of
  the unfused path is never kept in either case.

Numerics are unchanged (same ops, same order; recomputation reproduces the forward exactly), which
the tests check against a run without recomputation, together with the bytes saved for backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from autoplan.graph.profile import block_kind
from autoplan.graph.trace import TracedModel, extract_submodule
from autoplan.runtime.execution.executor import Stage

if TYPE_CHECKING:
    from autoplan.plan import Plan
    from autoplan.runtime.parallel.mesh import ParallelLayout
    from autoplan.runtime.parallel.split import StageBuild

__all__ = ["RECOMPUTED_KINDS", "RecomputeRunner", "apply_recompute", "recompute_runner"]

RECOMPUTED_KINDS = frozenset({"layer", "attention", "mlp"})
"""Block kinds recomputed by `full` and `selective`, as in the cost model (cost/time.py, cost/memory.py)."""


@dataclass(frozen=True)
class _Piece:
    block: int
    module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    recomputed: bool


class _CheckpointAttentionCore(TorchFunctionMode):
    """Runs every `scaled_dot_product_attention` under non-reentrant checkpoint."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # The kernel itself, not the name: context parallelism rebinds F.scaled_dot_product_attention
        # for the step (runtime/parallel/context.py) and calls the kernel from there.
        if func is torch._C._nn.scaled_dot_product_attention and torch.is_grad_enabled():
            # The mode is off inside its own handler, so the checkpointed call (and its replay in
            # the backward, which runs outside the mode) calls the kernel directly.
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


class RecomputeRunner:
    """Calls a stage's blocks in order, checkpointing the ones the plan recomputes.

    Takes and returns what the stage's GraphModule does (inputs in `stage inputs` order, a tuple of
    its outputs)."""

    def __init__(self, pieces: Sequence[_Piece], inputs: Sequence[str], outputs: Sequence[str], mode: str):
        self.pieces = tuple(pieces)
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.mode = mode

    def _run_piece(self, piece: _Piece, args: list[Any]) -> tuple[Any, ...]:
        if not piece.recomputed:
            return piece.module(*args)
        if self.mode == "full":
            return checkpoint(piece.module, *args, use_reentrant=False)
        with _CheckpointAttentionCore():
            return piece.module(*args)

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        env: dict[str, Any] = dict(zip(self.inputs, args))
        for piece in self.pieces:
            out = self._run_piece(piece, [env[n] for n in piece.inputs])
            env.update(zip(piece.outputs, out))
        return tuple(env[n] for n in self.outputs)

    @property
    def recomputed_blocks(self) -> list[int]:
        return [p.block for p in self.pieces if p.recomputed]


def apply_recompute(build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
    """The recompute step: this rank's executor stages (`build.stages`), each run by its
    `recompute_runner` where the plan recomputes, else as its module whole. After the steps that
    replace parameters (tensor parallel, experts, precision): the pieces refer to the stage's modules."""
    build.stages = {i: Stage(build.specs[i], module, runner=recompute_runner(
        build.traced, module, build.specs[i].first_block, build.specs[i].end_block, build.specs[i].inputs,
        build.specs[i].outputs, plan.recompute)) for i, module in build.modules.items()}


def recompute_runner(traced: TracedModel, stage_module: fx.GraphModule, first_block: int, end_block: int,
                     inputs: Sequence[str], outputs: Sequence[str], mode: str) -> RecomputeRunner | None:
    """A runner for a stage built by `extract_submodule(traced, first_block, end_block - 1)`, or None
    when `mode` is "none" or the stage has no block to recompute (it then runs as a whole).

    Build it after the stage's parameters are materialized (and tensor-parallel sharded): the pieces
    refer to the stage's modules, not copies (`_share_owners`)."""
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"unknown recompute mode {mode!r}; use none, selective or full")
    if mode == "none":
        return None
    # The stage's graph keeps the traced graph's node names, so the traced block of every node
    # carries over; cutting it per block reuses extract_submodule with the stage as the root, and
    # each piece is classified as the profile classified its block.
    view = dataclasses.replace(traced, gm=stage_module)
    pieces = []
    for block in range(first_block, end_block):
        module, piece_inputs, piece_outputs = extract_submodule(view, block, block)
        _share_owners(module, stage_module)
        pieces.append(_Piece(block, module, tuple(piece_inputs), tuple(piece_outputs),
                             block_kind(traced, block, module) in RECOMPUTED_KINDS))
    if not any(piece.recomputed for piece in pieces):
        return None
    return RecomputeRunner(pieces, inputs, outputs, mode)


def _share_owners(piece: fx.GraphModule, stage_module: nn.Module) -> None:
    """Make the piece read its parameters and buffers through the stage's own modules.

    fx gives a GraphModule new empty parent modules for every `get_attr` target (a graph traced by
    torch.export reads its parameters that way) holding the tensors themselves, so a later
    replacement of a stage's parameter would not reach the piece: FSDP swaps gathered and sharded
    parameters on their owner modules at every unit's forward (fsdp.py). Sharing the stage's top-level
    children instead resolves every target at call time, as the stage module itself does."""
    for node in piece.graph.nodes:
        if node.op != "get_attr" or "." not in str(node.target):
            continue
        top = str(node.target).split(".", 1)[0]
        owner = getattr(stage_module, top, None)
        if isinstance(owner, nn.Module) and getattr(piece, top, None) is not owner:
            setattr(piece, top, owner)
