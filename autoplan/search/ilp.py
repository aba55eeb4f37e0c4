"""Exact stage cutting as a mixed-integer program (PuLP + bundled CBC), with an optimality flag.

Same model as the DP in ``partition.py`` (see [Note: the stage model] in ``stage_model.py``):
per-stage block times (one row per stage for mixed GPU types), per-boundary cut time, static +
in-flight activation memory with boundary buffers, and legal cut positions. In addition, when the problem carries
``rank_of_stage`` and ``rank_capacity_bytes`` (interleaved schedules place several stages on one
GPU) the ILP enforces the exact per-rank memory sum *instead of* the per-stage ``capacity_bytes``,
which the DP can only approximate with a conservative per-stage share.

[Note: ILP formulation]
Binary ``y[k, i] = 1`` iff boundary ``b_k = i`` (k = 1..S-1; ``b_0 = 0`` and ``b_S = n`` are
constants), defined only for legal boundaries in the window where every stage stays non-empty.
Continuous ``u[k, j] = sum_{i <= j} y[k, i]`` (``= [b_k <= j]``) expresses the ordering
``b_k < b_{k+1}`` tightly as ``u[k+1, j] <= u[k, j-1]`` (the cumulative form of the chain-
partitioning "assignment" constraints in Tarnawski et al. 2020, NeurIPS, Sec. 5). Because each
stage has exactly one start and one end, every prefix-sum quantity is linear in ``y``:

    time_k = sum_i y[k+1, i] (P_k[i] + c[i]) - sum_i y[k, i] (P_k[i] - c[i])  <= T
    mem_k  = sum_i y[k+1, i] (St[i] + f_k (A[i] + ca[i])) + sum_i y[k, i] (-St[i] + f_k (ca[i] - A[i]))

with ``P_k, St, A`` prefix sums of time, static and activation bytes. Minimize ``T``. Times are
scaled to O(1) and each memory row by its capacity for CBC's absolute tolerances; the cutting read
back from the solution is re-evaluated exactly with ``stage_stats``.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pulp

from autoplan.search.partition import solve_dp
from autoplan.search.stage_model import CutProblem, Cuts, Prefix, make_cuts, violations

__all__ = ["solve_ilp"]


def solve_ilp(
    problem: CutProblem,
    time_limit_s: float = 30.0,
    *,
    warm_start: bool = True,
    threads: int | None = None,
) -> Cuts | None:
    """Solve the cutting exactly with CBC. Returns None when CBC proves the model infeasible.

    ``Cuts.optimal`` is True only when CBC proved optimality (relative gap 0) within
    ``time_limit_s``; otherwise the best cutting found is returned with ``optimal=False``. With
    ``warm_start`` the DP's cutting is offered as the incumbent whenever it satisfies the ILP's
    memory model, so a time-out still returns at least the DP's answer. Raises TimeoutError when
    the limit passes with no cutting found and infeasibility unproven.

    Proving optimality gets hard as S grows (many near-equal cuttings; e.g. n=130, S=64 does not
    finish in 60 s), so the search uses the DP and calls this for certificates at moderate S and
    for per-rank memory and mixed GPUs."""
    p = problem
    n, num_stages = p.num_blocks, p.num_stages
    per_rank = p.has_rank_memory
    if num_stages == 1:  # one cutting exists; evaluate it directly
        return None if violations(p, (0, n), per_rank=per_rank) else make_cuts(p, (0, n), optimal=True)

    pre = Prefix(p)
    c, ca, f = p.cut_time_s, p.cut_act_bytes, p.inflight
    legal = p.legal_boundaries()
    width = n - num_stages + 1
    # Positions boundary k (1..S-1) may take: legal and leaving room for non-empty stages.
    pos: list[list[int]] = [[0]]
    for k in range(1, num_stages):
        cand = [i for i in range(k, k + width) if legal[i]]
        if not cand:
            return None
        pos.append(cand)
    pos.append([n])

    prob = pulp.LpProblem("stage_cutting", pulp.LpMinimize)
    y: list[dict[int, pulp.LpVariable | float]] = [{0: 1.0}]
    for k in range(1, num_stages):
        y.append({i: _var(prob, f"y_{k}_{i}", cat=pulp.LpBinary) for i in pos[k]})
    y.append({n: 1.0})

    def lin(terms: list[tuple[float, pulp.LpVariable | float]]) -> pulp.LpAffineExpression:
        expr = pulp.LpAffineExpression()
        for coef, var in terms:
            if coef == 0.0:
                continue
            if isinstance(var, pulp.LpVariable):
                expr.addterm(var, coef)
            else:
                expr.constant += coef * var
        return expr

    # One start per boundary, and the cumulative ordering of [Note: ILP formulation].
    u: list[dict[int, pulp.LpVariable]] = [{}]
    for k in range(1, num_stages):
        prob += lin([(1.0, v) for v in y[k].values()]) == 1, f"one_{k}"
        lo, hi = pos[k][0], pos[k][-1]
        u_k: dict[int, pulp.LpVariable] = {}
        prev: pulp.LpVariable | None = None
        for j in range(lo, hi):  # u[k, j] = 0 below lo and = 1 from hi on
            u_k[j] = _var(prob, f"u_{k}_{j}", lowBound=0, upBound=1)
            terms = [(1.0, u_k[j]), (-1.0, y[k].get(j, 0.0))]
            if prev is not None:
                terms.append((-1.0, prev))
            prob += lin(terms) == 0, f"cum_{k}_{j}"
            prev = u_k[j]
        u.append(u_k)

    def u_at(k: int, j: int) -> pulp.LpVariable | float:
        if j < pos[k][0]:
            return 0.0
        if j >= pos[k][-1]:
            return 1.0
        return u[k][j]

    for k in range(1, num_stages - 1):
        for j in range(pos[k + 1][0], pos[k + 1][-1] + 1):  # b_{k+1} <= j  =>  b_k <= j - 1
            lhs, rhs = u_at(k + 1, j), u_at(k, j - 1)
            if isinstance(lhs, float) and isinstance(rhs, float):
                if lhs > rhs:
                    return None
                continue
            if isinstance(rhs, float) and rhs == 1.0:
                continue
            prob += lin([(1.0, lhs), (-1.0, rhs)]) <= 0, f"order_{k}_{j}"

    # Time rows, scaled so the optimum is O(1).
    time_scale = max(
        max(abs(float(pre.time_row(k)[n])) for k in range(num_stages)) + 2.0 * float(np.abs(c).max()), 1e-300
    )
    bottleneck = _var(prob, "T")
    prob += bottleneck
    for k in range(num_stages):
        t = pre.time_row(k)
        terms = [((t[i] + c[i]) / time_scale, v) for i, v in y[k + 1].items()]
        terms += [(-(t[i] - c[i]) / time_scale, v) for i, v in y[k].items()]
        prob += lin(terms) - bottleneck <= 0, f"time_{k}"

    # Memory: per-stage mem_k as (coefficient, variable) terms, then per stage or per rank rows.
    def mem_terms(k: int) -> list[tuple[float, pulp.LpVariable | float]]:
        st, act = pre.static, pre.act
        terms = [(st[i] + f[k] * (act[i] + ca[i]), v) for i, v in y[k + 1].items()]
        terms += [(-st[i] + f[k] * (ca[i] - act[i]), v) for i, v in y[k].items()]
        return terms

    if per_rank:
        assert p.rank_of_stage is not None and p.rank_capacity_bytes is not None
        groups = [
            ([k for k in range(num_stages) if p.rank_of_stage[k] == r], float(p.rank_capacity_bytes[r]))
            for r in range(p.rank_capacity_bytes.shape[0])
        ]
    else:
        groups = [([k], float(p.capacity_bytes[k])) for k in range(num_stages)]
    for g, (stages, cap) in enumerate(groups):
        if not stages or cap == math.inf:
            continue
        if cap == -math.inf:
            return None
        terms = [t for k in stages for t in mem_terms(k)]
        scale = max(abs(cap), max((abs(a) for a, _ in terms), default=0.0), 1.0)
        prob += lin([(a / scale, v) for a, v in terms]) <= cap / scale, f"mem_{g}"

    start = None
    if warm_start:
        start = solve_dp(p)
        if start is not None and not violations(p, start.boundaries, per_rank=per_rank):
            _set_start(start.boundaries, y, u, pos)
            bottleneck.setInitialValue(start.bottleneck_s / time_scale)
        else:
            start, warm_start = None, False

    with warnings.catch_warnings():
        # PuLP 3.x deprecates the bundled-CBC wrapper in favour of PuLP 4's; pyproject pins < 4.
        warnings.simplefilter("ignore", DeprecationWarning)
        solver = pulp.PULP_CBC_CMD(
            msg=False, timeLimit=time_limit_s, gapRel=0.0, gapAbs=1e-10, warmStart=warm_start, threads=threads
        )
    try:
        prob.solve(solver)
    except pulp.PulpSolverError:
        # CBC killed at its time limit sometimes leaves no solution file; that is a time-out, not an
        # error: keep the DP's incumbent when there is one, as a time-limited CBC run would.
        if start is not None:
            return make_cuts(p, start.boundaries, optimal=False)
        raise TimeoutError(f"CBC stopped without a cutting of {n} blocks into {num_stages} stages within "
                           f"{time_limit_s} s; feasibility unknown") from None
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        if prob.status == pulp.LpStatusInfeasible:
            return None
        raise TimeoutError(
            f"CBC found no cutting of {n} blocks into {num_stages} stages within {time_limit_s} s "
            f"(status {pulp.LpStatus[prob.status]}); feasibility unknown"
        )
    boundaries = [0]
    for k in range(1, num_stages):
        boundaries.append(max(y[k], key=lambda i, k=k: y[k][i].varValue or 0.0))
    boundaries.append(n)
    cuts = make_cuts(p, boundaries, optimal=prob.sol_status == pulp.LpSolutionOptimal)
    if start is not None and cuts.bottleneck_s > start.bottleneck_s * (1 + 1e-9):
        # CBC returned a cutting worse than the feasible start it was given and called it optimal
        # (seen with mixed GPUs and a zero-capacity stage: tests/test_partition.py's hypothesis
        # example); its proof cannot be trusted, so solve again without the start.
        return solve_ilp(problem, time_limit_s, warm_start=False, threads=threads)
    return cuts


def _set_start(
    boundaries: tuple[int, ...],
    y: list[dict[int, pulp.LpVariable | float]],
    u: list[dict[int, pulp.LpVariable]],
    pos: list[list[int]],
) -> None:
    for k in range(1, len(boundaries) - 1):
        for i, v in y[k].items():
            assert isinstance(v, pulp.LpVariable)
            v.setInitialValue(1.0 if i == boundaries[k] else 0.0)
        for j, v in u[k].items():
            v.setInitialValue(1.0 if j >= boundaries[k] else 0.0)


def _var(prob: pulp.LpProblem, name: str, **kwargs: object) -> pulp.LpVariable:
    """A variable attached to ``prob`` (PuLP >= 3.3 API), or a free one on older PuLP."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, **kwargs)
    return pulp.LpVariable(name, **kwargs)
