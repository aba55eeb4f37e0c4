"""Stage cutting: the DP, the ILP and brute force agree; legality, memory and baselines."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoplan.search.baselines import balanced_by, equal_layers
from autoplan.search.ilp import solve_ilp
from autoplan.search.partition import brute_force, solve_dp
from autoplan.search.stage_model import CutProblem, rank_mem_bytes, stage_stats, violations

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def close(a: float, b: float, rel: float = 1e-9) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)


@st.composite
def problems(draw: st.DrawFn, *, max_blocks: int = 9, max_stages: int = 4) -> CutProblem:
    """Random small instances: 1-D or 2-D times, cut times, integer memory that is sometimes
    infeasible (integers keep memory comparisons exact for CBC too), random legal cuts."""
    n = draw(st.integers(1, max_blocks))
    num_stages = draw(st.integers(1, min(n, max_stages)))
    time_val = st.floats(0.0, 10.0, allow_nan=False, allow_subnormal=False)
    mixed = draw(st.booleans())
    shape = (num_stages, n) if mixed else (n,)
    times = np.array(draw(st.lists(time_val, min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))))
    cut_inner = draw(st.lists(st.floats(0.0, 1.0, allow_subnormal=False), min_size=n - 1, max_size=n - 1))
    ints = st.integers(0, 6)
    static = draw(st.lists(ints, min_size=n, max_size=n))
    act = draw(st.lists(ints, min_size=n, max_size=n))
    cut_act = draw(st.lists(st.integers(0, 2), min_size=n + 1, max_size=n + 1))
    inflight = draw(st.lists(st.integers(1, 4), min_size=num_stages, max_size=num_stages))
    capacity = draw(st.lists(st.integers(0, 150), min_size=num_stages, max_size=num_stages))
    legal = draw(st.lists(st.booleans(), min_size=n - 1, max_size=n - 1))
    return CutProblem(
        block_time_s=times.reshape(shape),
        cut_time_s=np.array([0.0, *cut_inner, 0.0]),
        block_static_bytes=np.array(static, dtype=float),
        block_act_bytes=np.array(act, dtype=float),
        inflight=np.array(inflight, dtype=float),
        capacity_bytes=np.array(capacity, dtype=float),
        cut_act_bytes=np.array(cut_act, dtype=float),
        legal_cut=np.array(legal, dtype=bool) if draw(st.booleans()) else None,
    )


def sum_sq(times: tuple[float, ...]) -> float:
    out = 0.0
    for t in times:
        out = out + t * t
    return out


@settings(SETTINGS, max_examples=150)
@given(problems())
def test_dp_equals_brute_force_and_ilp(problem: CutProblem) -> None:
    dp, brute, ilp = solve_dp(problem), brute_force(problem), solve_ilp(problem, time_limit_s=20)
    assert (dp is None) == (brute is None) == (ilp is None)
    if dp is None:
        return
    assert dp.bottleneck_s == brute.bottleneck_s  # same arithmetic: exact
    assert close(sum_sq(dp.stage_time_s), sum_sq(brute.stage_time_s), 1e-12)  # tie-break agrees
    assert ilp.optimal and dp.optimal
    assert close(dp.bottleneck_s, ilp.bottleneck_s)
    for cuts in (dp, ilp):
        assert violations(problem, cuts.boundaries) == []
        times, mems = stage_stats(problem, cuts.boundaries)
        assert cuts.stage_time_s == tuple(times) and cuts.stage_mem_bytes == tuple(mems)
        assert cuts.bottleneck_s == max(cuts.stage_time_s)
        assert [b - a for a, b in cuts.stage_ranges()] == list(np.diff(cuts.boundaries))


@SETTINGS
@given(problems(max_blocks=12, max_stages=6), st.data())
def test_illegal_cuts_never_used(problem: CutProblem, data: st.DataObject) -> None:
    n = problem.num_blocks
    legal = np.array(data.draw(st.lists(st.booleans(), min_size=n - 1, max_size=n - 1)), dtype=bool)
    p = CutProblem(
        block_time_s=problem.block_time_s,
        cut_time_s=problem.cut_time_s,
        block_static_bytes=problem.block_static_bytes,
        block_act_bytes=problem.block_act_bytes,
        inflight=problem.inflight,
        capacity_bytes=np.full(problem.num_stages, np.inf),
        legal_cut=legal,
    )
    dp = solve_dp(p)
    if legal.sum() < problem.num_stages - 1:
        assert dp is None and solve_ilp(p) is None
        return
    assert dp is not None
    assert all(legal[b - 1] for b in dp.boundaries[1:-1])
    ilp = solve_ilp(p)
    assert ilp is not None and all(legal[b - 1] for b in ilp.boundaries[1:-1])
    assert close(dp.bottleneck_s, ilp.bottleneck_s)


def test_all_cuts_illegal_but_one_stage() -> None:
    p = CutProblem(
        np.ones(4),
        np.zeros(5),
        np.zeros(4),
        np.zeros(4),
        np.ones(1),
        np.full(1, np.inf),
        legal_cut=np.zeros(3, bool),
    )
    assert solve_dp(p).boundaries == (0, 4)
    q = CutProblem(
        np.ones(4),
        np.zeros(5),
        np.zeros(4),
        np.zeros(4),
        np.ones(2),
        np.full(2, np.inf),
        legal_cut=np.zeros(3, bool),
    )
    assert solve_dp(q) is None and brute_force(q) is None and solve_ilp(q) is None


def heavy_ends(num_layers: int = 16, num_stages: int = 4) -> tuple[CutProblem, np.ndarray]:
    """A GPT-like chain: a cheap embedding with many parameters, equal layers, a head that is both
    parameter-heavy and slow (vocabulary projection + loss)."""
    n = num_layers + 2
    time_s = np.r_[0.1, np.ones(num_layers), 3.0]
    params = np.r_[50.0, np.full(num_layers, 12.0), 50.0]
    problem = CutProblem(
        block_time_s=time_s,
        cut_time_s=np.r_[0.0, np.full(n - 1, 0.05), 0.0],
        block_static_bytes=16.0 * params,
        block_act_bytes=np.r_[1.0, np.full(num_layers, 4.0), 6.0],
        inflight=np.arange(num_stages, 0, -1, dtype=float),
        capacity_bytes=np.full(num_stages, 1e6),
    )
    return problem, params


def test_dp_beats_baselines_with_heavy_ends() -> None:
    problem, params = heavy_ends()
    dp = solve_dp(problem)
    uniform = max(stage_stats(problem, equal_layers(problem.num_blocks, problem.num_stages))[0])
    by_params = max(stage_stats(problem, balanced_by(params, problem.num_stages))[0])
    by_time = max(stage_stats(problem, balanced_by(problem.block_time_s, problem.num_stages))[0])
    assert dp.bottleneck_s < uniform and dp.bottleneck_s < by_params
    assert dp.bottleneck_s <= by_time  # balancing compute alone ignores cut time
    assert dp.boundaries == (0, 5, 10, 15, 18)  # the head's stage gets 2 layers, the others 4-5


def test_equal_layers_and_balanced_by() -> None:
    assert equal_layers(18, 4) == (0, 5, 9, 13, 18)  # 16 layers: 4 each, embedding + head extra
    assert equal_layers(18, 4, first_last_extra=False) == (0, 5, 10, 14, 18)
    assert equal_layers(4, 4) == (0, 1, 2, 3, 4)  # too few middle blocks: plain uniform
    assert equal_layers(5, 1) == (0, 5)
    assert balanced_by(np.array([1.0, 1, 1, 1, 4]), 2) == (0, 4, 5)
    assert balanced_by(np.ones(6), 3) == (0, 2, 4, 6)
    with pytest.raises(ValueError, match="3 blocks into 4"):
        equal_layers(3, 4)


def test_tie_break_balances_non_bottleneck_stages() -> None:
    p = CutProblem(
        np.array([4.0, 1, 1, 1, 1]), np.zeros(6), np.zeros(5), np.zeros(5), np.ones(3), np.full(3, np.inf)
    )
    assert solve_dp(p).boundaries == (0, 1, 3, 5)  # [4] [1 1] [1 1], not [4] [1] [1 1 1]
    assert solve_dp(p, refine=False).bottleneck_s == 4.0
    assert solve_dp(p) == solve_dp(p)


def test_mixed_gpu_rows_are_per_stage() -> None:
    # Stage 1 runs on a GPU twice as fast: it should take about two thirds of the work.
    times = np.vstack([np.ones(12), np.full(12, 0.5)])
    p = CutProblem(times, np.zeros(13), np.zeros(12), np.zeros(12), np.ones(2), np.full(2, np.inf))
    dp, ilp = solve_dp(p), solve_ilp(p)
    assert dp.boundaries == (0, 4, 12) and dp.bottleneck_s == 4.0
    assert ilp.bottleneck_s == 4.0 and ilp.optimal


def interleaved(capacity_per_rank: float) -> CutProblem:
    """pp=2 ranks, 2 virtual stages each (stage k on rank k % 2); 8 blocks, layer 0 memory-heavy.
    The per-stage capacity is the conservative half share the DP would get."""
    n, pp, v = 8, 2, 2
    return CutProblem(
        block_time_s=np.array([1.0, 1, 1, 1, 1, 1, 1, 1]),
        cut_time_s=np.zeros(n + 1),
        block_static_bytes=np.array([30.0, 2, 2, 2, 2, 2, 2, 2]),
        block_act_bytes=np.ones(n),
        inflight=np.array([4.0, 3, 2, 1]),
        capacity_bytes=np.full(pp * v, capacity_per_rank / v),
        rank_of_stage=np.arange(pp * v) % pp,
        rank_capacity_bytes=np.full(pp, capacity_per_rank),
    )


def test_ilp_enforces_per_rank_sum() -> None:
    p = interleaved(capacity_per_rank=50.0)
    dp = solve_dp(p)  # the half share (25 B) cannot hold block 0 (30 B): infeasible for the DP
    assert dp is None
    ilp = solve_ilp(p)
    assert ilp is not None and ilp.optimal
    used = rank_mem_bytes(p, np.array(ilp.stage_mem_bytes))
    assert (used <= p.rank_capacity_bytes).all()
    assert violations(p, ilp.boundaries, per_rank=True) == []
    brute = brute_force(p, per_rank=True)
    assert close(ilp.bottleneck_s, brute.bottleneck_s) and ilp.bottleneck_s == 2.0
    # Tighter ranks: rank 0 holds block 0 (30 + 4) and stage 2 must stay small.
    tight = solve_ilp(interleaved(capacity_per_rank=40.0))
    tight_brute = brute_force(interleaved(capacity_per_rank=40.0), per_rank=True)
    assert (tight is None) == (tight_brute is None)
    if tight is not None:
        assert close(tight.bottleneck_s, tight_brute.bottleneck_s)


@SETTINGS
@given(
    problems(max_blocks=8, max_stages=4),
    st.integers(1, 3),
    st.lists(st.integers(0, 120), min_size=3, max_size=3),
)
def test_ilp_per_rank_matches_brute_force(problem: CutProblem, pp: int, rank_cap: list[int]) -> None:
    ranks = np.arange(problem.num_stages) % pp
    p = CutProblem(
        block_time_s=problem.block_time_s,
        cut_time_s=problem.cut_time_s,
        block_static_bytes=problem.block_static_bytes,
        block_act_bytes=problem.block_act_bytes,
        inflight=problem.inflight,
        capacity_bytes=problem.capacity_bytes,
        cut_act_bytes=problem.cut_act_bytes,
        legal_cut=problem.legal_cut,
        rank_of_stage=ranks,
        rank_capacity_bytes=np.array(rank_cap[:pp], dtype=float),
    )
    ilp, brute = solve_ilp(p), brute_force(p, per_rank=True)
    assert (ilp is None) == (brute is None)
    if ilp is not None:
        assert ilp.optimal and close(ilp.bottleneck_s, brute.bottleneck_s)
        assert violations(p, ilp.boundaries, per_rank=True) == []


def test_dp_at_search_scale_matches_ilp() -> None:
    rng = np.random.default_rng(7)
    n, num_stages = 40, 8
    p = CutProblem(
        block_time_s=rng.uniform(0.5, 1.5, size=(num_stages, n)),
        cut_time_s=np.r_[0.0, rng.uniform(0, 0.2, n - 1), 0.0],
        block_static_bytes=rng.integers(1, 10, n).astype(float),
        block_act_bytes=rng.integers(1, 5, n).astype(float),
        inflight=np.arange(num_stages, 0, -1, dtype=float),
        capacity_bytes=np.full(num_stages, 120.0),
        legal_cut=rng.random(n - 1) < 0.8,
    )
    dp, ilp = solve_dp(p), solve_ilp(p, warm_start=False)
    assert ilp.optimal and close(dp.bottleneck_s, ilp.bottleneck_s)
    big = CutProblem(
        block_time_s=rng.uniform(0.5, 1.5, 130),
        cut_time_s=np.zeros(131),
        block_static_bytes=np.ones(130),
        block_act_bytes=np.ones(130),
        inflight=np.arange(64, 0, -1, dtype=float),
        capacity_bytes=np.full(64, 200.0),
    )
    cuts = solve_dp(big)
    assert cuts is not None and len(cuts.boundaries) == 65 and violations(big, cuts.boundaries) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"inflight": np.ones(5)}, "4 blocks into 5"),
        ({"cut_time_s": np.zeros(4)}, r"cut_time_s has shape \(4,\), expected \(5,\)"),
        ({"block_time_s": np.ones((3, 4))}, "3 rows but inflight has 2"),
        ({"legal_cut": np.ones(2, bool)}, r"legal_cut has shape \(2,\), expected \(3,\)"),
        (
            {"capacity_bytes": np.array([1.0, np.nan])},
            "capacity_bytes has non-finite values at indices \\[1\\]",
        ),
        ({"rank_of_stage": np.array([0, 1])}, "given together"),
        ({"rank_of_stage": np.array([0, 2]), "rank_capacity_bytes": np.ones(2)}, r"outside 0\.\.1"),
    ],
)
def test_validation_errors(kwargs: dict, match: str) -> None:
    base = {
        "block_time_s": np.ones(4),
        "cut_time_s": np.zeros(5),
        "block_static_bytes": np.zeros(4),
        "block_act_bytes": np.zeros(4),
        "inflight": np.ones(2),
        "capacity_bytes": np.ones(2),
    }
    with pytest.raises(ValueError, match=match):
        CutProblem(**(base | kwargs))


def test_stage_stats_rejects_bad_boundaries() -> None:
    p, _ = heavy_ends()
    with pytest.raises(ValueError, match="strictly increasing"):
        stage_stats(p, (0, 5, 5, 10, 18))
    assert violations(p, (0, 5, 10, 18)) != []


def test_ilp_time_limit_keeps_dp_incumbent_or_raises() -> None:
    rng = np.random.default_rng(3)
    n, num_stages = 60, 24
    p = CutProblem(
        block_time_s=rng.uniform(0.5, 1.5, n),
        cut_time_s=np.r_[0.0, rng.uniform(0, 0.1, n - 1), 0.0],
        block_static_bytes=np.ones(n),
        block_act_bytes=np.ones(n),
        inflight=np.arange(num_stages, 0, -1, dtype=float),
        capacity_bytes=np.full(num_stages, 300.0),
    )
    dp = solve_dp(p)
    ilp = solve_ilp(p, time_limit_s=0.5)
    assert ilp is not None and ilp.bottleneck_s <= dp.bottleneck_s
    if not ilp.optimal:  # the usual case at this size: no certificate within 0.5 s
        assert ilp.bottleneck_s == dp.bottleneck_s
    try:
        cold = solve_ilp(p, time_limit_s=0.5, warm_start=False)
    except TimeoutError as e:
        assert "feasibility unknown" in str(e)
    else:
        assert cold is not None and cold.bottleneck_s >= dp.bottleneck_s * (1 - 1e-9)


def test_climb_never_worsens_the_start_and_follows_its_objective():
    import numpy as np

    from autoplan.search.climb import climb_boundaries
    from autoplan.search.partition import solve_dp
    from autoplan.search.stage_model import CutProblem, stage_stats, violations

    n, stages = 40, 4
    legal = np.ones(n - 1, dtype=bool)
    legal[9] = False  # boundary 10 may not be cut
    problem = CutProblem(block_time_s=np.ones(n), cut_time_s=np.zeros(n + 1), block_static_bytes=np.ones(n),
                         block_act_bytes=np.zeros(n), inflight=np.ones(stages), capacity_bytes=np.full(stages, 16.0),
                         legal_cut=legal)
    start = solve_dp(problem).boundaries

    def slowest(b):
        return float(stage_stats(problem, b)[0].max())

    # On the DP's own objective the DP's optimum cannot be improved.
    assert climb_boundaries(problem, start, slowest)[1] == slowest(start)

    # An objective that also charges the first stage three times (a ramp that leaves cores idle) moves
    # the first boundary left, within the legal cuts and the memory capacity.
    def ramp(b):
        times = stage_stats(problem, b)[0]
        return float(times.max() + 3 * times[0])

    best, seconds = climb_boundaries(problem, start, ramp)
    assert seconds < ramp(start) and seconds == ramp(best)
    assert best[1] < start[1] and not violations(problem, best)
