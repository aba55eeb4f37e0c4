"""The stage-cutting problem and what a cutting costs under it: `CutProblem`, `Cuts`, and the
prefix-sum arithmetic every solver shares (`stage_stats`, `violations`, `make_cuts`).

Apart from the solvers (the DP in partition.py, the ILP in ilp.py, the baselines in baselines.py,
the pattern search in climb.py) because they all read one model and must compute the same numbers
from it; this module holds that model and nothing that searches.

[Note: the stage model]
Stage ``k`` owns blocks ``[a, b)`` (``a = b_k``, ``b = b_{k+1}``). Boundary index ``i`` is the
boundary *before* block ``i``; ``0`` and ``n`` are the ends of the chain.

    time_k = sum_{j in [a,b)} block_time_s[k, j] + cut_time_s[a] + cut_time_s[b]
    mem_k  = sum static_bytes + inflight[k] * (sum act_bytes + cut_act_bytes[a] + cut_act_bytes[b])

Both are evaluated from prefix sums with one fixed expression (``_stage_time`` / ``_stage_mem``
below, and their matrix forms in partition.py's ``DPSolver``), so the DP, ``stage_stats`` and
``brute_force`` compute bit-identical numbers and compare them exactly, without tolerances. The ILP
(``ilp.py``) solves the same model and is compared within a relative 1e-9.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

__all__ = ["CutProblem", "Cuts", "make_cuts", "rank_mem_bytes", "stage_stats", "violations"]


def _as_float(name: str, value: object, shape: tuple[int, ...], *, allow_inf: bool = False) -> np.ndarray:
    arr = np.array(value, dtype=np.float64)  # copy: the problem must not alias caller arrays
    if arr.shape != shape:
        raise ValueError(f"{name} has shape {arr.shape}, expected {shape}")
    bad = np.isnan(arr) if allow_inf else ~np.isfinite(arr)
    if bad.any():
        raise ValueError(f"{name} has non-finite values at indices {np.argwhere(bad).ravel().tolist()}")
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class CutProblem:
    """One instance of stage cutting; plain numpy data, no torch. See [Note: the stage model].

    Optional fields are normalized in ``__post_init__``: ``cut_act_bytes`` becomes zeros and
    ``legal_cut`` all True, so after construction they are always arrays.
    """

    block_time_s: np.ndarray
    """(n,) or (S, n): seconds of block j when placed on stage k (2-D for mixed GPU types)."""
    cut_time_s: np.ndarray
    """(n+1,): seconds a stage pays per boundary it has at index i (boundary before block i; P2P
    send/recv). Index 0 and n are the chain ends and are 0 by convention."""
    block_static_bytes: np.ndarray
    """(n,): weights + gradients + optimizer state bytes of block j on its GPU."""
    block_act_bytes: np.ndarray
    """(n,): activation bytes block j saves per micro-batch in flight."""
    inflight: np.ndarray
    """(S,): micro-batches in flight on stage k (from the schedule, e.g. 1F1B gives p - k)."""
    capacity_bytes: np.ndarray
    """(S,): bytes available to stage k (after fixed allowances); +inf means unconstrained. With
    interleaving the caller passes a conservative per-stage share here (the DP's model)."""
    cut_act_bytes: np.ndarray | None = None
    """(n+1,): boundary buffer bytes a stage holds per in-flight micro-batch per boundary."""
    legal_cut: np.ndarray | None = None
    """(n-1,) bool: whether a cut after block i (boundary i+1) may be used."""
    rank_of_stage: np.ndarray | None = None
    """(S,) int: the GPU rank stage k lives on (interleaving: k % pp). Given together with
    ``rank_capacity_bytes``, the ILP replaces the per-stage capacity by the exact per-rank sum."""
    rank_capacity_bytes: np.ndarray | None = None
    """(R,): bytes available per rank, for the ILP's per-rank memory constraint."""

    def __post_init__(self) -> None:
        bt = np.array(self.block_time_s, dtype=np.float64)
        if bt.ndim not in (1, 2) or bt.shape[-1] == 0:
            raise ValueError(f"block_time_s must have shape (n,) or (S, n) with n >= 1, got {bt.shape}")
        n = bt.shape[-1]
        inflight = np.array(self.inflight, dtype=np.float64)
        if inflight.ndim != 1 or inflight.shape[0] == 0:
            raise ValueError(f"inflight must have shape (S,) with S >= 1, got {inflight.shape}")
        num_stages = inflight.shape[0]
        if num_stages > n:
            raise ValueError(f"cannot cut {n} blocks into {num_stages} non-empty stages (S > n)")
        if bt.ndim == 2 and bt.shape[0] != num_stages:
            raise ValueError(f"block_time_s has {bt.shape[0]} rows but inflight has {num_stages} stages")
        put = object.__setattr__
        put(self, "block_time_s", _as_float("block_time_s", bt, bt.shape))
        put(self, "cut_time_s", _as_float("cut_time_s", self.cut_time_s, (n + 1,)))
        put(self, "block_static_bytes", _as_float("block_static_bytes", self.block_static_bytes, (n,)))
        put(self, "block_act_bytes", _as_float("block_act_bytes", self.block_act_bytes, (n,)))
        put(self, "inflight", _as_float("inflight", inflight, (num_stages,)))
        put(
            self,
            "capacity_bytes",
            _as_float("capacity_bytes", self.capacity_bytes, (num_stages,), allow_inf=True),
        )
        cab = np.zeros(n + 1) if self.cut_act_bytes is None else self.cut_act_bytes
        put(self, "cut_act_bytes", _as_float("cut_act_bytes", cab, (n + 1,)))
        legal = np.ones(n - 1, dtype=bool) if self.legal_cut is None else np.array(self.legal_cut, dtype=bool)
        if legal.shape != (n - 1,):
            raise ValueError(f"legal_cut has shape {legal.shape}, expected ({n - 1},)")
        legal.setflags(write=False)
        put(self, "legal_cut", legal)
        if (self.rank_of_stage is None) != (self.rank_capacity_bytes is None):
            raise ValueError("rank_of_stage and rank_capacity_bytes must be given together")
        if self.rank_of_stage is not None:
            cap = np.array(self.rank_capacity_bytes, dtype=np.float64)
            if cap.ndim != 1 or cap.shape[0] == 0:
                raise ValueError(f"rank_capacity_bytes must have shape (R,), got {cap.shape}")
            put(self, "rank_capacity_bytes", _as_float("rank_capacity_bytes", cap, cap.shape, allow_inf=True))
            ranks = np.array(self.rank_of_stage)
            if ranks.shape != (num_stages,) or not np.issubdtype(ranks.dtype, np.integer):
                raise ValueError(
                    f"rank_of_stage must be ({num_stages},) ints, got {ranks.shape} {ranks.dtype}"
                )
            if ranks.min() < 0 or ranks.max() >= cap.shape[0]:
                raise ValueError(
                    f"rank_of_stage values {sorted(set(ranks.tolist()))} outside 0..{cap.shape[0] - 1}"
                )
            ranks = ranks.astype(np.int64)
            ranks.setflags(write=False)
            put(self, "rank_of_stage", ranks)

    @property
    def num_blocks(self) -> int:
        return int(self.block_time_s.shape[-1])

    @property
    def num_stages(self) -> int:
        return int(self.inflight.shape[0])

    @property
    def has_rank_memory(self) -> bool:
        return self.rank_of_stage is not None

    def legal_boundaries(self) -> np.ndarray:
        """(n+1,) bool: boundary i may be a stage boundary (the chain ends always may)."""
        out = np.ones(self.num_blocks + 1, dtype=bool)
        out[1:-1] = self.legal_cut
        return out


@dataclass(frozen=True)
class Cuts:
    """A cutting and what it costs under the problem's model."""

    boundaries: tuple[int, ...]
    """b_0 = 0 < b_1 < ... < b_S = n; stage k owns blocks [b_k, b_{k+1})."""
    stage_time_s: tuple[float, ...]
    stage_mem_bytes: tuple[float, ...]
    bottleneck_s: float
    """The slowest stage's time."""
    optimal: bool
    """Proven optimal for the solver's model (DP: always; ILP: CBC reported Optimal)."""

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1

    def stage_ranges(self) -> list[tuple[int, int]]:
        return list(itertools.pairwise(self.boundaries))


class Prefix:
    """Prefix sums shared by every evaluation, so all code paths round identically."""

    def __init__(self, p: CutProblem) -> None:
        def cum(x: np.ndarray) -> np.ndarray:
            out = np.zeros(x.shape[:-1] + (x.shape[-1] + 1,))
            np.cumsum(x, axis=-1, out=out[..., 1:])
            return out

        self.time = np.atleast_2d(cum(p.block_time_s))  # (1 or S, n+1)
        self.static = cum(p.block_static_bytes)
        self.act = cum(p.block_act_bytes)

    def time_row(self, k: int) -> np.ndarray:
        return self.time[k if self.time.shape[0] > 1 else 0]


def _stage_time(pre: Prefix, p: CutProblem, k: int, a: int, b: int) -> float:
    t = pre.time_row(k)
    c = p.cut_time_s
    return float((t[b] - t[a]) + (c[a] + c[b]))


def _stage_mem(pre: Prefix, p: CutProblem, k: int, a: int, b: int) -> float:
    ca = p.cut_act_bytes
    act = (pre.act[b] - pre.act[a]) + (ca[a] + ca[b])
    return float((pre.static[b] - pre.static[a]) + p.inflight[k] * act)


def _check_boundaries(p: CutProblem, boundaries: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    b = tuple(int(x) for x in boundaries)
    n, num_stages = p.num_blocks, p.num_stages
    if len(b) != num_stages + 1 or b[0] != 0 or b[-1] != n:
        raise ValueError(f"boundaries {b} must be {num_stages + 1} values from 0 to {n}")
    if any(x >= y for x, y in itertools.pairwise(b)):
        raise ValueError(f"boundaries {b} must be strictly increasing (stages are non-empty)")
    return b


def stage_stats(
    problem: CutProblem, boundaries: tuple[int, ...] | list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(time_s, mem_bytes) per stage of a cutting, under [Note: the stage model]."""
    b = _check_boundaries(problem, boundaries)
    pre = Prefix(problem)
    # `_stage_time` and `_stage_mem` for every stage at once: the same element-wise operations in
    # the same order, so the same numbers.
    a, e = np.array(b[:-1]), np.array(b[1:])
    t = pre.time[0] if pre.time.shape[0] == 1 else pre.time
    c, ca = problem.cut_time_s, problem.cut_act_bytes
    if t.ndim == 1:
        times = (t[e] - t[a]) + (c[a] + c[e])
    else:
        k = np.arange(problem.num_stages)
        times = (t[k, e] - t[k, a]) + (c[a] + c[e])
    act = (pre.act[e] - pre.act[a]) + (ca[a] + ca[e])
    mems = (pre.static[e] - pre.static[a]) + problem.inflight * act
    return times, mems


def rank_mem_bytes(problem: CutProblem, stage_mem: np.ndarray) -> np.ndarray:
    """(R,) bytes per rank: the sum of the memory of the stages placed on it."""
    if problem.rank_of_stage is None or problem.rank_capacity_bytes is None:
        raise ValueError("problem has no rank_of_stage / rank_capacity_bytes")
    return np.bincount(
        problem.rank_of_stage, weights=stage_mem, minlength=problem.rank_capacity_bytes.shape[0]
    )


def violations(
    problem: CutProblem, boundaries: tuple[int, ...] | list[int], *, per_rank: bool = False
) -> list[str]:
    """Why a cutting is not allowed (empty when it is). Pure; ``per_rank`` selects the ILP's memory
    model (per-rank sums) instead of the DP's (per-stage capacity)."""
    try:
        b = _check_boundaries(problem, boundaries)
    except ValueError as e:
        return [str(e)]
    out = [f"cut at boundary {i} is illegal" for i in b[1:-1] if not problem.legal_cut[i - 1]]
    _, mems = stage_stats(problem, b)
    if per_rank:
        used = rank_mem_bytes(problem, mems)
        cap = problem.rank_capacity_bytes
        assert cap is not None
        out += [
            f"rank {r}: {used[r]:.6g} B > capacity {cap[r]:.6g} B"
            for r in range(cap.shape[0])
            if used[r] > cap[r]
        ]
    else:
        cap = problem.capacity_bytes
        out += [
            f"stage {k}: {mems[k]:.6g} B > capacity {cap[k]:.6g} B"
            for k in range(len(mems))
            if mems[k] > cap[k]
        ]
    return out


def make_cuts(problem: CutProblem, boundaries: tuple[int, ...] | list[int], *, optimal: bool) -> Cuts:
    """Package a cutting with its stage times and memory (shared by the DP, the ILP, baselines)."""
    times, mems = stage_stats(problem, boundaries)
    return Cuts(
        boundaries=tuple(int(x) for x in boundaries),
        stage_time_s=tuple(times.tolist()),
        stage_mem_bytes=tuple(mems.tolist()),
        bottleneck_s=float(times.max()),
        optimal=optimal,
    )
