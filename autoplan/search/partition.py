"""Min-max cutting of a block chain into contiguous pipeline stages, and its dynamic program.

The problem ("chains-on-chains partitioning", Bokhari 1988, IEEE Trans. Computers 37(1)) is: cut
``n`` blocks into ``S`` contiguous non-empty stages minimizing the slowest stage, subject to each
stage fitting its GPU's memory. The dynamic program is the min-max recurrence used for pipeline
stage construction by Tarnawski et al. 2020 ("Efficient Algorithms for Device Placement of DNN
Graph Operators", NeurIPS, Sec. 4) and Alpa (Zheng et al., OSDI'22, Sec. 5.2, Eq. 3), here with
per-stage memory feasibility, per-boundary communication time and legal cut positions.

[Note: the stage model]
Stage ``k`` owns blocks ``[a, b)`` (``a = b_k``, ``b = b_{k+1}``). Boundary index ``i`` is the
boundary *before* block ``i``; ``0`` and ``n`` are the ends of the chain.

    time_k = sum_{j in [a,b)} block_time_s[k, j] + cut_time_s[a] + cut_time_s[b]
    mem_k  = sum static_bytes + inflight[k] * (sum act_bytes + cut_act_bytes[a] + cut_act_bytes[b])

Both are evaluated from prefix sums with one fixed expression (``_stage_time`` / ``_stage_mem``
below, and their matrix forms in ``solve_dp``), so the DP, ``stage_stats`` and ``brute_force``
compute bit-identical numbers and compare them exactly, without tolerances. The ILP (``ilp.py``)
solves the same model and is compared within a relative 1e-9.

[Note: DP tie-break]
Among cuttings with the same (exactly equal) bottleneck, ``solve_dp`` returns one minimizing the
sum of squared stage times (a second DP restricted to stages no slower than the bottleneck), so the
non-bottleneck stages are balanced too. Remaining ties go to the earliest start of each stage,
fixed from the last stage backwards (``numpy.argmin`` takes the first minimum). Results are
therefore deterministic for a given problem.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CutProblem",
    "Cuts",
    "DPSolver",
    "balanced_by",
    "climb_boundaries",
    "brute_force",
    "equal_layers",
    "make_cuts",
    "rank_mem_bytes",
    "solve_dp",
    "stage_stats",
    "violations",
]


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


class _Prefix:
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


def _stage_time(pre: _Prefix, p: CutProblem, k: int, a: int, b: int) -> float:
    t = pre.time_row(k)
    c = p.cut_time_s
    return float((t[b] - t[a]) + (c[a] + c[b]))


def _stage_mem(pre: _Prefix, p: CutProblem, k: int, a: int, b: int) -> float:
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
    pre = _Prefix(problem)
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


# [Note: cutting under shared cores]
# The DP minimizes the slowest stage, which is the step's bound when every rank has a device of its
# own. Ranks that share a machine's cores (`1x4xcpu` on 2 cores) are not bound that way: a rank that
# waits frees its core for the others, so the work gets done at the machine's pace, and the step
# grows with the spans where fewer ranks than cores can run: the ramp-up and the ramp-down, which
# are the first stage's forwards and backwards. The simulation with processor sharing
# (cost/sharing.py) sees this and the slowest-stage objective does not: on the 256k-vocabulary gpt
# over 4 ranks on 2 cores the DP's cutting simulated 7.75 s and parameter-balanced cuts (a light
# first stage) 7.77 s, and parameter-balanced ran faster (8.5 s against 9.2 s measured). So under
# sharing the DP's cutting is the start of a local search on the simulated step: move one boundary
# by a step, keep a move that shortens the step, halve the step when none does (a pattern search,
# Hooke and Jeeves 1961). The simulation is the objective, so the result is never worse than the
# DP's cutting under the model.


def climb_boundaries(problem: CutProblem, start: tuple[int, ...], step_time_s: Callable[[tuple[int, ...]], float],
                     *, max_evaluations: int = 400) -> tuple[tuple[int, ...], float]:
    """Pattern search from `start` on `step_time_s` over legal cuttings that fit in memory
    ([Note: cutting under shared cores]); returns the best cutting and its step time."""
    best = tuple(int(x) for x in start)
    best_s = step_time_s(best)
    step = max(1, problem.num_blocks // (2 * problem.num_stages))
    evaluations = 0
    while step >= 1 and evaluations < max_evaluations:
        improved = False
        for i in range(1, len(best) - 1):
            for delta in (-step, step):
                candidate = best[:i] + (best[i] + delta,) + best[i + 1:]
                if not candidate[i - 1] < candidate[i] < candidate[i + 1] or violations(problem, candidate):
                    continue
                seconds = step_time_s(candidate)
                evaluations += 1
                if seconds < best_s * (1 - 1e-9):
                    best, best_s, improved = candidate, seconds, True
        if not improved:
            step //= 2
    return best, best_s


def solve_dp(problem: CutProblem, *, refine: bool = True) -> Cuts | None:
    """Minimize the slowest stage's time with every stage within ``capacity_bytes``; None when no
    cutting is feasible. ``refine`` applies the tie-break in [Note: DP tie-break] (about twice the
    work); without it ties go to the earliest stage starts.

    Per stage k, all (start i, end j) pairs are evaluated at once as a matrix, restricted to the
    window where every other stage can still be non-empty: i in [k, n-S+k], j in [k+1, n-S+k+1].
    Cost O(S (n-S+1)^2) numpy work.
    """
    return DPSolver(problem).solve(refine=refine)


# [Note: DP band]
# A stage can hold only so many blocks before its memory exceeds every stage's capacity: with
# non-negative activation bytes, the memory of blocks [i, j) is at least the same expression with
# the smallest in-flight count, and the capacity at most the largest one, so any [i, j) longer
# than the longest span fitting that relaxed test is infeasible for every stage. When that span,
# `band`, is shorter than the window width, each window keeps only the `band` starts that can
# reach each end: layout [stage, e, end column s] with start row r = s - (band - 1) + e (rows
# with r < 0 masked), so `argmin` over e still picks the smallest start among equal values. The
# excluded entries are +inf in the full windows, so values, argmins and cuts are the same; the
# work falls from S * width^2 to S * band * width (gpt3-175b: band 20-40 of width up to 96).

# Elements of (stage, start, end) float arrays built at once: 32 MiB, so a chunk amortizes numpy's
# per-call overhead over many stages without the memory growing as S (n - S)^2 for long chains.
_CHUNK_ELEMENTS = 1 << 22


class DPSolver:
    """`solve_dp` for one problem, keeping the min-max pass so that asking for the unrefined and
    then the refined cutting (the search does: feasibility and a bound first, the tie-break only
    for plans it simulates) runs the first pass once."""

    def __init__(self, problem: CutProblem) -> None:
        p = self.problem = problem
        n, num_stages = p.num_blocks, p.num_stages
        pre = _Prefix(p)
        c, ca = p.cut_time_s, p.cut_act_bytes
        self.width = width = n - num_stages + 1  # start (and end) positions a stage can take
        # Full (n+1, n+1) matrices indexed [start i, end j]; stage k reads the (width, width)
        # window rows k.., columns k+1.., i.e. a view that moves one step down the diagonal per
        # stage (`_windows`).
        cut_pair = c[:, None] + c[None, :]
        self._static = pre.static[None, :] - pre.static[:, None]
        self._act = (pre.act[None, :] - pre.act[:, None]) + (ca[:, None] + ca[None, :])
        if pre.time.shape[0] == 1:
            self._time = (pre.time[0][None, :] - pre.time[0][:, None]) + cut_pair
            self._time_rows = None
        else:
            self._time = None
            self._time_rows = (pre.time, cut_pair)
        # i < j within a window is "row r <= column s" (window k: i = k + r, j = k + 1 + s); the
        # masks below mark what is not allowed.
        self._order_bad = np.tril(np.ones((width, width), dtype=bool), -1)  # start after end
        illegal_end = ~p.legal_boundaries()
        self._legal_end_bad = np.lib.stride_tricks.as_strided(
            illegal_end[1:], shape=(num_stages, width), strides=(illegal_end.strides[0],) * 2, writeable=False)
        self.band = self._band()
        if self.band < width:
            self._use_band()
        self._chunk = max(1, _CHUNK_ELEMENTS // (self.band * width))
        self._cached: list[np.ndarray] | None = None
        self._first: tuple[float, np.ndarray] | None = None

    def _band(self) -> int:
        """How many starts per end the windows need: the most blocks any stage can hold in memory,
        or the whole width. [Note: DP band]"""
        p = self.problem
        width = self.width
        if (self._time is None or (p.block_act_bytes < 0).any() or (p.cut_act_bytes < 0).any()
                or (p.inflight < 0).any()):
            return width
        # The same two operations as `_masked_time`, with the smallest in-flight count and the
        # largest capacity: a stage that fails this fails on every stage position.
        mem = np.multiply(p.inflight.min(), self._act)
        mem += self._static
        idx = np.arange(p.num_blocks + 1)
        length = idx[None, :] - idx[:, None]
        fits = (mem <= p.capacity_bytes.max()) & (length > 0)
        longest = int(length[fits].max()) if fits.any() else 1
        return max(1, min(width, longest))

    def _use_band(self) -> None:
        """Switch the windows to the banded layout of [Note: DP band]."""
        b, width = self.band, self.width

        def pad(full: np.ndarray) -> np.ndarray:
            return np.concatenate([np.zeros((b - 1, full.shape[1])), full])

        self._time, self._static, self._act = pad(self._time), pad(self._static), pad(self._act)
        e, s = np.arange(b)[:, None], np.arange(width)[None, :]
        self._order_bad = s + e < b - 1  # start before boundary 0

    def _windows(self, full: np.ndarray, k0: int, k1: int) -> np.ndarray:
        """(k1 - k0, width, width) view of windows k0..k1-1 of an (n+1, n+1) matrix."""
        s0, s1 = full.strides
        if self.band < self.width:  # padded matrices, [k, e, s] = full[k0 + k + e + s, k0 + k + 1 + s]
            return np.lib.stride_tricks.as_strided(
                full[k0:, k0 + 1:], shape=(k1 - k0, self.band, self.width), strides=(s0 + s1, s0, s0 + s1),
                writeable=False)
        return np.lib.stride_tricks.as_strided(
            full[k0:, k0 + 1:], shape=(k1 - k0, self.width, self.width), strides=(s0 + s1, s0, s1), writeable=False)

    def _masked_time(self, k0: int, k1: int) -> np.ndarray:
        """Stage time of windows k0..k1-1, +inf where the stage does not fit or cannot end there.
        Element by element the same arithmetic as the stage model's (`_stage_time`, `_stage_mem`)."""
        p = self.problem
        if self._time is not None:
            time = self._windows(self._time, k0, k1)
        else:
            rows, cut_pair = self._time_rows
            time = np.stack([
                (rows[k][None, k + 1:k + 1 + self.width] - rows[k][k:k + self.width, None])
                + cut_pair[k:k + self.width, k + 1:k + 1 + self.width]
                for k in range(k0, k1)])
        # In place, two arrays instead of six: a fresh process pays a page fault per new page, and
        # these are the search's largest arrays. (static + inflight * act, as `_stage_mem` adds.)
        out = np.multiply(p.inflight[k0:k1, None, None], self._windows(self._act, k0, k1))
        out += self._windows(self._static, k0, k1)
        bad = np.greater(out, p.capacity_bytes[k0:k1, None, None])
        bad |= self._order_bad
        bad |= self._legal_end_bad[k0:k1, None, :]
        np.copyto(out, time)
        np.copyto(out, np.inf, where=bad)
        return out

    def _chunks(self):
        """Yield (first stage, masked times of a run of stages); kept when small enough to reuse."""
        if self._cached is not None:
            yield from self._cached
            return
        num_stages = self.problem.num_stages
        keep = num_stages * self.band * self.width <= 2 * _CHUNK_ELEMENTS
        kept = []
        for k0 in range(0, num_stages, self._chunk):
            item = (k0, self._masked_time(k0, min(k0 + self._chunk, num_stages)))
            if keep:
                kept.append(item)
            yield item
        if keep:
            self._cached = kept

    def _run(self, combine: Callable[[np.ndarray, np.ndarray], np.ndarray],
             limit: float | None = None) -> tuple[float, np.ndarray]:
        """best_k[end] = min over start of combine(best_{k-1}[start], time_k(start, end)), over
        stages no slower than `limit` when given.

        Window k's end column s is boundary k+1+s, which is window k+1's start row s, so the
        vector carries over between stages without reindexing. Infeasible entries are +inf and
        both combines (max, sum of squares) keep +inf, so masking before combining is exact."""
        width = self.width
        cols_idx = np.arange(width)
        best = np.zeros(width)
        best[1:] = np.inf  # before stage 0 only boundary 0 (window row 0) is reachable
        arg = np.empty((self.problem.num_stages, width), dtype=np.int64)
        band = self.band < width
        if band:
            # Row e of the band is start row s - (band - 1) + e of end column s: a view of `best`
            # behind band - 1 leading infs, refreshed in place each stage.
            padded = np.full(self.band - 1 + width, np.inf)
            shifted = np.lib.stride_tricks.as_strided(padded, shape=(self.band, width),
                                                      strides=(padded.strides[0],) * 2, writeable=False)
        for k0, masked in self._chunks():
            if limit is not None:
                masked = np.where(masked <= limit, masked, np.inf)
            for j in range(masked.shape[0]):
                if band:
                    padded[self.band - 1:] = best
                    prev = shifted
                else:
                    prev = best[:, None]
                cand = combine(prev, masked[j])
                a = arg[k0 + j]
                np.argmin(cand, axis=0, out=a)
                best = cand[a, cols_idx]
        return float(best[width - 1]), arg

    def bottleneck(self) -> tuple[float, np.ndarray]:
        if self._first is None:
            self._first = self._run(np.maximum)
        return self._first

    def solve(self, *, refine: bool = True) -> Cuts | None:
        """The optimal cutting (see `solve_dp`), or None when none fits."""
        p = self.problem
        n, num_stages = p.num_blocks, p.num_stages
        bottleneck, arg = self.bottleneck()
        if not np.isfinite(bottleneck):
            return None
        if refine:
            # Second pass: among stages no slower than the optimum, minimize the sum of squares.
            _, arg = self._run(lambda prev, t: prev + t * t, limit=bottleneck)
        boundaries = [n]
        s = self.width - 1  # column of boundary n in the last window
        for k in range(num_stages - 1, -1, -1):
            r = int(arg[k][s])  # start row in window k: boundary k + r
            if self.band < self.width:
                r += s - (self.band - 1)  # the band's row e is start row s - (band - 1) + e
            boundaries.append(k + r)
            s = r  # boundary k + r is column r of window k-1
        boundaries.reverse()
        cuts = make_cuts(p, boundaries, optimal=True)
        assert cuts.bottleneck_s == bottleneck, (cuts.bottleneck_s, bottleneck)
        return cuts


def brute_force(problem: CutProblem, *, per_rank: bool = False) -> Cuts | None:
    """Enumerate every legal cutting (small n only, for tests). Same tie-break as ``solve_dp`` up
    to exact ties: minimum bottleneck, then minimum sum of squared stage times. ``per_rank``
    uses the ILP's per-rank memory model instead of per-stage capacity."""
    p = problem
    n, num_stages = p.num_blocks, p.num_stages
    legal = [i for i in range(1, n) if p.legal_cut[i - 1]]
    best: tuple[float, float] | None = None
    best_b: tuple[int, ...] | None = None
    for inner in itertools.combinations(legal, num_stages - 1):
        b = (0, *inner, n)
        times, mems = stage_stats(p, b)
        if per_rank:
            assert p.rank_capacity_bytes is not None
            if (rank_mem_bytes(p, mems) > p.rank_capacity_bytes).any():
                continue
        elif (mems > p.capacity_bytes).any():
            continue
        sumsq = 0.0
        for t in times.tolist():
            sumsq = sumsq + t * t
        key = (float(times.max()), sumsq)
        if best is None or key < best:
            best, best_b = key, b
    return None if best_b is None else make_cuts(p, best_b, optimal=True)


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
