"""Min-max cutting of a block chain into contiguous pipeline stages, and its dynamic program.

The problem ("chains-on-chains partitioning", Bokhari 1988, IEEE Trans. Computers 37(1)) is: cut
``n`` blocks into ``S`` contiguous non-empty stages minimizing the slowest stage, subject to each
stage fitting its GPU's memory. The dynamic program is the min-max recurrence used for pipeline
stage construction by Tarnawski et al. 2020 ("Efficient Algorithms for Device Placement of DNN
Graph Operators", NeurIPS, Sec. 4) and Alpa (Zheng et al., OSDI'22, Sec. 5.2, Eq. 3), here with
per-stage memory feasibility, per-boundary communication time and legal cut positions.

The problem and its stage model (`CutProblem`, `Cuts`, [Note: the stage model]) are in
stage_model.py; this module holds the DP that solves it exactly, and `brute_force` for tests.

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

import numpy as np

from autoplan.search.stage_model import CutProblem, Cuts, Prefix, make_cuts, rank_mem_bytes, stage_stats

__all__ = ["DPSolver", "brute_force", "solve_dp"]


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
        pre = Prefix(p)
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
