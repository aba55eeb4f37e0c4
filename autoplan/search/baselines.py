"""Baseline cuttings the planner is compared with: balanced by a per-block weight (DeepSpeed's
"parameters") and equal block counts (DeepSpeed's "uniform", Megatron-LM's layout).

Apart from the DP (partition.py) because they are not the planner's answer, only what benchmarks
and `evaluate_cuts` score against it.
"""

from __future__ import annotations

import itertools

import numpy as np

from autoplan.search.partition import solve_dp
from autoplan.search.stage_model import CutProblem

__all__ = ["balanced_by", "equal_layers"]


def balanced_by(weights: np.ndarray, num_stages: int) -> tuple[int, ...]:
    """Baseline: contiguous cuts minimizing the largest per-stage sum of ``weights`` (DeepSpeed's
    ``partition_method="parameters"`` with ``ds_utils.partition_balanced``, which balances each
    stage to about total/S of the weight). Returns boundaries b_0..b_S."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1:
        raise ValueError(f"weights must be 1-D, got shape {w.shape}")
    n = w.shape[0]
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} weights into {num_stages} non-empty stages")
    problem = CutProblem(
        block_time_s=w,
        cut_time_s=np.zeros(n + 1),
        block_static_bytes=np.zeros(n),
        block_act_bytes=np.zeros(n),
        inflight=np.zeros(num_stages),
        capacity_bytes=np.full(num_stages, np.inf),
    )
    cuts = solve_dp(problem)
    assert cuts is not None
    return cuts.boundaries


def equal_layers(num_blocks: int, num_stages: int, first_last_extra: bool = True) -> tuple[int, ...]:
    """Baseline: equal block counts per stage (DeepSpeed ``partition_method="uniform"``; the
    remainder goes one each to the first stages). With ``first_last_extra`` the first and last
    blocks (embedding, head) are extra: the n-2 middle blocks are split evenly and the embedding
    joins stage 0, the head the last stage (Megatron-LM's layout). Falls back to splitting all
    blocks when there are fewer middle blocks than stages."""
    if not 1 <= num_stages <= num_blocks:
        raise ValueError(f"cannot cut {num_blocks} blocks into {num_stages} non-empty stages")
    extra = first_last_extra and num_stages > 1 and num_blocks - 2 >= num_stages
    num_items = num_blocks - 2 if extra else num_blocks
    chunk, residual = divmod(num_items, num_stages)
    sizes = [chunk + (1 if k < residual else 0) for k in range(num_stages)]
    if extra:
        sizes[0] += 1
        sizes[-1] += 1
    return (0, *itertools.accumulate(sizes))
