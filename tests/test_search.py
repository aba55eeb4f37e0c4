"""The search: plans are valid, pins hold, impossible requests are one-line errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

import autoplan
from autoplan.api import suggest_with_stats
from autoplan.cluster import parse_cluster
from autoplan.plan import Plan, PlanError, validate
from autoplan.search.context import SearchContext
from autoplan.search.evaluate import evaluate
from autoplan.search.ilp import solve_ilp
from autoplan.search.partition import solve_dp
from autoplan.search.space import PlanningError
from autoplan.search.stage_model import CutProblem

SMALL = "gpt:num_layers=8,hidden_size=512,num_heads=8,vocab_size=4096,max_seq_len=512"


@pytest.fixture(scope="module")
def small_result():
    return suggest_with_stats(SMALL, "2x4xA100-80GB", global_batch=32, seq_len=512, top=8)


def test_every_plan_is_valid_and_ranked(small_result):
    result, profiled = small_result
    assert result.plans and result.configs_evaluated >= len(result.plans)
    times = [p.predicted.step_time_s for p in result.plans]
    assert times == sorted(times)
    for plan in result.plans:
        assert validate(plan) == []
        assert plan.fits
        assert plan.tp * plan.pp * plan.dp == 8
        assert plan.micro_batch_size * plan.num_microbatches * plan.dp == 32
        assert plan.boundaries[-1] == profiled.profile.num_blocks
        assert 0 < plan.predicted.mfu < 1 and plan.predicted.hfu >= plan.predicted.mfu


def test_plan_json_round_trip(small_result, tmp_path):
    plan = small_result[0].plans[0]
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    assert plan.predicted.step_time_s > 0 and plan.num_microbatches >= 1


def test_validate_catches_inconsistent_plans(small_result):
    plan = small_result[0].plans[0]
    assert any("tp*pp*dp" in p for p in validate(dataclasses.replace(plan, dp=plan.dp * 2)))
    stages = list(plan.stages)
    if len(stages) > 1:
        stages[1] = dataclasses.replace(stages[1], first_block=stages[1].first_block + 1)
        assert any("in order" in p for p in validate(dataclasses.replace(plan, stages=tuple(stages))))
    big = dataclasses.replace(plan.stages[0].memory, activations_bytes=1e15)
    bad = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], memory=big), *plan.stages[1:]))
    assert any("yet the plan says it fits" in p for p in validate(bad))


def test_plan_of_another_schema_version_is_refused(small_result, tmp_path):
    data = small_result[0].plans[0].to_dict()
    data["schema_version"] = 99
    (tmp_path / "old.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="schema version 99"):
        Plan.load(tmp_path / "old.json")


def test_pins_are_respected():
    plans = autoplan.suggest(SMALL, "2x4xA100-80GB", global_batch=32, seq_len=512, tp=2, pp=2,
                             schedule="interleaved-1f1b", top=3)
    assert all(p.tp == 2 and p.pp == 2 and p.dp == 2 and p.schedule == "interleaved-1f1b" for p in plans)
    assert all(p.virtual_stages >= 2 for p in plans)


def test_fully_pinned_plan_is_reported_even_when_it_does_not_fit():
    plans = autoplan.suggest("llama3-8b", "1x8xA10G", global_batch=8, seq_len=4096, tp=1, pp=1, dp=8,
                             micro_batch_size=1, schedule="1f1b", recompute="none", zero=0)
    assert len(plans) == 1 and not plans[0].fits
    assert plans[0].predicted.bound.startswith("memory")
    assert plans[0].predicted.peak_memory_bytes > 23e9


@pytest.mark.parametrize(("pins", "message"), [
    ({"tp": 3}, "must divide the 4 GPUs of a node"),
    ({"tp": 8}, "must divide the 4 GPUs"),
    ({"pp": 100}, "more than the model's"),
    ({"tp": 2, "pp": 2, "dp": 1}, r"tp\*pp\*dp = 2\*2\*1 = 4"),
    ({"tp": 2, "pp": 2, "dp": 4}, "multiply to 16, which does not divide"),
    ({"dp": 3}, "does not divide the cluster"),
    ({"micro_batch_size": 5}, "not divisible"),
    ({"schedule": "pipedream"}, "unknown schedule"),
    ({"virtual_stages": 2, "schedule": "1f1b"}, "needs --schedule interleaved-1f1b"),
    ({"zero": 4}, "must be 0, 1, 2 or 3"),
    ({"zero": 3, "schedule": "zb-h1"}, "zb-h1 cannot run with --zero 3"),
    ({"dp_replicate": 2, "schedule": "zb-h1"}, "zb-h1 cannot run with --dp-replicate 2"),
    ({"dp_replicate": 2, "zero": 1}, "needs --zero 2 or 3, not --zero 1"),
    ({"dp_replicate": 3, "dp": 4}, "must divide --dp 4"),
    ({"dp_replicate": 0}, "must be a positive integer"),
    ({"recompute": "most"}, "unknown recompute"),
])
def test_impossible_pins_are_one_line_errors(pins, message):
    with pytest.raises(PlanningError, match=message) as info:
        autoplan.suggest(SMALL, "2x4xA100-80GB", global_batch=32, seq_len=512, **pins)
    assert "\n" not in str(info.value)


def test_tp_must_divide_heads():
    with pytest.raises(PlanningError, match="attention heads"):
        autoplan.suggest("gpt:num_layers=4,hidden_size=96,num_heads=6,vocab_size=128,max_seq_len=64",
                         "1x4xA100-80GB", global_batch=8, seq_len=64, tp=4)


def test_model_too_large_says_how_many_gpus():
    with pytest.raises(PlanningError, match=r"needs at least \d+ GPUs"):
        autoplan.suggest("llama3-70b", "1x8xA100-80GB", global_batch=8, seq_len=2048)


def test_mixed_gpu_cluster_puts_slower_stages_on_fewer_blocks(tmp_path):
    (tmp_path / "mixed.yaml").write_text(
        "groups:\n  - {nodes: 1, gpus_per_node: 4, gpu: H100-SXM-80GB}\n  - {nodes: 1, gpus_per_node: 4, gpu: A100-SXM4-80GB}\n")
    plans = autoplan.suggest("gpt:num_layers=16,hidden_size=1024,num_heads=16,vocab_size=4096,max_seq_len=512",
                             str(tmp_path / "mixed.yaml"), global_batch=32, seq_len=512, tp=4, pp=2,
                             schedule="1f1b", rank_order="tp-dp-pp")
    stages = plans[0].stages
    # pp rank 0 is the H100 node, rank 1 the A100 node: the faster GPUs take more layers.
    assert stages[0].end_block - stages[0].first_block > stages[1].end_block - stages[1].first_block


def test_dp_cuts_equal_ilp_on_the_search_problem(small_result):
    """The cutting the search uses is optimal: the ILP (CBC) certifies it on the real problem."""
    _, profiled = small_result
    profile = profiled.profile
    cluster = parse_cluster("2x4xA100-80GB")
    ctx = SearchContext(profile, cluster, small_result[0].plans[0].job, SMALL)
    from autoplan.cost.config import ParallelConfig

    cfg = ParallelConfig(tp=1, pp=4, dp=2, micro_batch_size=2, num_microbatches=8, schedule="1f1b")
    times = ctx.block_times(cluster.gpu, cfg).total_s
    import numpy as np

    problem = CutProblem(block_time_s=times, cut_time_s=ctx.link_times(cfg), block_static_bytes=ctx.static_bytes(cfg),
                         block_act_bytes=ctx.act_bytes(cfg), inflight=np.array([4.0, 3, 2, 1]),
                         capacity_bytes=np.full(4, 70e9))
    dp, ilp = solve_dp(problem), solve_ilp(problem)
    assert ilp.optimal and dp.bottleneck_s == pytest.approx(ilp.bottleneck_s, rel=1e-9)
    assert evaluate(ctx, cfg) is not None


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_inflight_closed_forms_match_the_simulator(name):
    from autoplan.schedule import make_schedule, simulate
    from autoplan.search.inflight import schedule_inflight

    for p in range(1, 7):
        for m in range(1, 13):
            simulated = simulate(make_schedule(name, p, m), lambda a: 1.0).peak_inflight
            assert schedule_inflight(name, p, m, 1) == simulated, (p, m)


def test_interleaved_inflight_scan_matches_the_simulator():
    from autoplan.schedule import make_schedule, simulate
    from autoplan.search.inflight import schedule_inflight

    for p in range(2, 6):
        for v in (2, 3, 4):
            for m in range(p, 4 * p + 1, p):
                simulated = simulate(make_schedule("interleaved-1f1b", p, m, v), lambda a: 1.0).peak_inflight
                assert schedule_inflight("interleaved-1f1b", p, m, v) == simulated, (p, m, v)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_pre_cut_bound_never_exceeds_a_simulated_step(schedule):
    """The bound prunes the search, so it must hold for every cutting: brute force small chains."""
    import itertools
    import random

    from autoplan.cost.config import ParallelConfig
    from autoplan.schedule import ActionKind, make_schedule, simulate
    from autoplan.search.space import pre_cut_bound

    rng = random.Random(0)
    for _ in range(40):
        p, m = rng.randint(2, 4), rng.randint(1, 6)
        n = rng.randint(p, 6)
        fwd = [rng.uniform(0.1, 1.0) for _ in range(n)]
        bwd = [f * rng.uniform(1.5, 3.0) for f in fwd]
        share = min(f / (f + b) for f, b in zip(fwd, bwd))
        cfg = ParallelConfig(tp=1, pp=p, dp=1, micro_batch_size=1, num_microbatches=m, schedule=schedule)
        bound = pre_cut_bound(cfg, sum(fwd) + sum(bwd), share)
        for cuts in itertools.combinations(range(1, n), p - 1):
            edges = (0, *cuts, n)
            f_s = [sum(fwd[a:b]) for a, b in zip(edges, edges[1:])]
            b_s = [sum(bwd[a:b]) for a, b in zip(edges, edges[1:])]

            def duration(action, f_s=f_s, b_s=b_s):
                if action.kind == ActionKind.F:
                    return f_s[action.stage]
                return b_s[action.stage] / (2 if schedule == "zb-h1" else 1)

            step = simulate(make_schedule(schedule, p, m), duration).makespan_s
            assert bound <= step * (1 + 1e-9), (p, m, cuts)


def test_cpu_ranks_sharing_cores_slow_down_timed_blocks(monkeypatch):
    import dataclasses as dc

    from autoplan.cost.sharing import simulate_shared_cores
    from autoplan.cost.time import cpu_sharing
    from autoplan.schedule import make_schedule, simulate

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    profile = autoplan.profile("gpt:num_layers=2,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16",
                               batch_size=1, seq_len=16)
    timed = profile.with_blocks([dc.replace(b, fwd_time_s=1e-3, bwd_time_s=2e-3) for b in profile.blocks])
    timed = dc.replace(timed, extra={**timed.extra, "threads": 1})
    four, two = parse_cluster("1x4xcpu"), parse_cluster("1x2xcpu")
    assert cpu_sharing(timed, four.gpu, four) == (1.0, 2.0)  # 4 single-threaded ranks on 2 cores
    assert cpu_sharing(timed, two.gpu, two) is None
    assert cpu_sharing(profile, four.gpu, four) is None  # analytic profiles already share the peak

    # 4 ranks always busy on 2 cores (GPipe with many micro-batches) run about twice as slow; a single
    # rank alone is not slowed at all.
    schedule = make_schedule("gpipe", 4, 32)
    alone = simulate(schedule, lambda a: 1.0).makespan_s
    shared = simulate_shared_cores(schedule, lambda a: 1.0, None, None, threads_per_rank=1.0, cores=2.0).makespan_s
    assert 1.5 * alone < shared < 2.05 * alone
    single = make_schedule("1f1b", 1, 4)
    assert simulate_shared_cores(single, lambda a: 1.0, None, None, 1.0, 2.0).makespan_s == simulate(
        single, lambda a: 1.0).makespan_s


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"])
def test_simulated_step_lower_bound_never_exceeds_the_simulation(schedule):
    """The search skips simulating a configuration when this bound reaches the cutoff, so it must
    never exceed what the simulator returns (random stage times, transfers and tails)."""
    import random

    from autoplan.cost.config import ParallelConfig
    from autoplan.schedule import ActionKind, make_schedule, simulate
    from autoplan.search.bounds import simulated_step_lower_bound

    rng = random.Random(1)
    for _ in range(60):
        p = rng.randint(1, 4)
        v = rng.randint(2, 3) if schedule == "interleaved-1f1b" and p > 1 else 1
        m = p * rng.randint(1, 4) if v > 1 else rng.randint(1, 6)
        name = schedule if v > 1 or schedule != "interleaved-1f1b" else "1f1b"
        cfg = ParallelConfig(tp=1, pp=p, dp=1, micro_batch_size=1, num_microbatches=m, schedule=name,
                             virtual_stages=v)
        s = cfg.num_stages
        durations = {ActionKind.F: [rng.uniform(0.1, 1.0) for _ in range(s)],
                     ActionKind.B: [rng.uniform(0.1, 2.0) for _ in range(s)]}
        if name == "zb-h1":
            durations[ActionKind.W] = [rng.uniform(0.1, 1.0) for _ in range(s)]
        delays_f = [rng.uniform(0.0, 0.2) if p > 1 else 0.0 for _ in range(s - 1)]
        delays_b = [rng.uniform(0.0, 0.2) if p > 1 else 0.0 for _ in range(s - 1)]
        tails = [rng.uniform(0.0, 1.0) for _ in range(p)]

        def comm(src, dst, kind, delays_f=delays_f, delays_b=delays_b):
            return delays_f[dst - 1] if kind == ActionKind.F else delays_b[dst]

        step = simulate(make_schedule(name, p, m, v), durations, comm, tails).makespan_s
        bound = simulated_step_lower_bound(cfg, durations, delays_f, delays_b, tails)
        assert bound <= step * (1 + 1e-12), (name, p, m, v)


def test_simulated_step_lower_bound_is_exact_for_equal_1f1b_stages():
    from autoplan.cost.config import ParallelConfig
    from autoplan.schedule import ActionKind
    from autoplan.search.bounds import simulated_step_lower_bound

    p, m = 4, 8
    cfg = ParallelConfig(tp=1, pp=p, dp=1, micro_batch_size=1, num_microbatches=m, schedule="1f1b")
    durations = {ActionKind.F: [1.0] * p, ActionKind.B: [2.0] * p}
    bound = simulated_step_lower_bound(cfg, durations, [0.0] * (p - 1), [0.0] * (p - 1), [0.0] * p)
    assert bound == (m + p - 1) * 3.0  # Narayanan et al. 2021, Sec. 2.2.1


def test_search_results_do_not_depend_on_the_pruning(monkeypatch):
    """Skipping simulations by the bound, and reusing cuts and simulations across configurations,
    give exactly the plans an unpruned search finds."""
    import autoplan.search.assemble as evaluate_mod

    pruned, _ = suggest_with_stats(SMALL, "2x4xA100-80GB", global_batch=32, seq_len=512, top=4)
    monkeypatch.setattr(evaluate_mod, "simulated_step_lower_bound", lambda *args: 0.0)
    unpruned, _ = suggest_with_stats(SMALL, "2x4xA100-80GB", global_batch=32, seq_len=512, top=4)
    assert [p.to_dict() for p in pruned.plans] == [p.to_dict() for p in unpruned.plans]


def test_timed_blocks_scale_as_a_fixed_part_plus_a_part_per_sample():
    import dataclasses as dc

    from autoplan.cost.config import ParallelConfig
    from autoplan.cost.time import block_times

    profile = autoplan.profile("gpt:num_layers=2,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16",
                               batch_size=1, seq_len=16)
    # A block whose forward is 1 ms fixed + 1 ms per sample and whose backward is all fixed (a dense
    # embedding gradient), timed at batch 1.
    timed = profile.with_blocks([dc.replace(b, fwd_time_s=2e-3, fwd_time_fixed_s=1e-3, bwd_time_s=5e-3,
                                            bwd_time_fixed_s=5e-3) for b in profile.blocks])
    cluster = parse_cluster("1x1xcpu")
    for mb in (1, 4):
        cfg = ParallelConfig(tp=1, pp=1, dp=1, micro_batch_size=mb, num_microbatches=1, schedule="1f1b")
        t = block_times(timed, cluster.gpu, cluster, cfg, "fp32")
        assert t.fwd_s[0] == pytest.approx(1e-3 + mb * 1e-3) and t.bwd_s[0] == pytest.approx(5e-3)
    linear = profile.with_blocks([dc.replace(b, fwd_time_s=2e-3, bwd_time_s=5e-3) for b in profile.blocks])
    cfg = ParallelConfig(tp=1, pp=1, dp=1, micro_batch_size=4, num_microbatches=1, schedule="1f1b")
    assert block_times(linear, cluster.gpu, cluster, cfg, "fp32").bwd_s[0] == pytest.approx(20e-3)


def test_a_tied_head_on_another_rank_adds_its_gradient_sum_to_the_step():
    from autoplan.cluster import allreduce_time_s

    spec = "gpt:num_layers=4,hidden_size=256,num_heads=4,vocab_size=32000,max_seq_len=128"
    pins = dict(tp=1, dp=1, micro_batch_size=1, schedule="1f1b", recompute="none", zero=0)
    two = autoplan.suggest(spec, "1x2xA100-80GB", global_batch=8, seq_len=128, pp=2, **pins)[0]
    # fp32 gradients (the masters' `main_grad`, runtime/parallel/precision.py) of the 32000 x 256 table, summed
    # between the first and the last rank.
    expected = allreduce_time_s(two.cluster_obj(), [0, 1], 32000 * 256 * 4)
    assert two.predicted.breakdown["tied_grad_sync_s"] == pytest.approx(expected) and expected > 0
    one = autoplan.suggest(spec, "1x1xA100-80GB", global_batch=8, seq_len=128, pp=1, **pins)[0]
    assert one.predicted.breakdown["tied_grad_sync_s"] == 0.0  # both copies on one rank: nothing to sum
    untied = autoplan.suggest(spec + ",tie_embeddings=False", "1x2xA100-80GB", global_batch=8, seq_len=128, pp=2,
                              **pins)[0]
    assert untied.predicted.breakdown["tied_grad_sync_s"] == 0.0


def test_search_under_shared_cores_keeps_the_faster_simulated_cutting(monkeypatch):
    import dataclasses as dc

    from autoplan.cost.config import ParallelConfig
    from autoplan.plan import Job
    from autoplan.search import evaluate as evaluate_mod

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    profile = autoplan.profile("gpt:num_layers=24,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16",
                               batch_size=1, seq_len=16, dtype="fp32")
    timed = profile.with_blocks([dc.replace(b, fwd_time_s=1e-3, bwd_time_s=2e-3) for b in profile.blocks])
    timed = dc.replace(timed, extra={**timed.extra, "threads": 1})
    cfg = ParallelConfig(tp=1, pp=4, dp=1, micro_batch_size=1, num_microbatches=4, schedule="1f1b")

    def plan_with(climb):
        monkeypatch.setattr(evaluate_mod, "climb_boundaries", climb)
        ctx = SearchContext(timed, parse_cluster("1x4xcpu"), Job(global_batch=4, seq_len=16, dtype="float32"), "gpt")
        return evaluate(ctx, cfg).plan

    searched = plan_with(evaluate_mod.climb_boundaries)
    dp_only = plan_with(lambda problem, start, step_time_s, **_: (start, step_time_s(start)))
    # 4 ranks on 2 cores: a lighter first stage shortens the ramps where a core idles.
    assert searched.predicted.step_time_s < dp_only.predicted.step_time_s
    assert searched.stages[0].end_block < dp_only.stages[0].end_block


def test_evaluate_cuts_scores_given_boundaries_as_the_search_does():
    from autoplan.cost.config import ParallelConfig
    from autoplan.plan import Job
    from autoplan.search.evaluate import evaluate_cuts

    profile = autoplan.profile(SMALL, batch_size=1, seq_len=512)
    ctx = SearchContext(profile, parse_cluster("1x4xA100-80GB"), Job(global_batch=16, seq_len=512), SMALL)
    cfg = ParallelConfig(tp=1, pp=4, dp=1, micro_batch_size=1, num_microbatches=16, schedule="1f1b")
    searched = evaluate(ctx, cfg).plan
    again = evaluate_cuts(ctx, cfg, searched.boundaries)
    assert again.boundaries == searched.boundaries
    assert again.predicted.step_time_s == searched.predicted.step_time_s
    equal = evaluate_cuts(ctx, cfg, [0, 3, 6, 9, profile.num_blocks])
    assert equal.predicted.step_time_s >= searched.predicted.step_time_s
