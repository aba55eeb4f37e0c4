"""Speed work that must not change results: the analytic profile cache, the shared DP pass, the
meta-only shortcuts of the zoo, and the paused garbage collector (no timings here; see
benchmarks/search_speed.py)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from autoplan import models as zoo
from autoplan.api import profile_with_graph
from autoplan.graph import profile as profile_mod
from autoplan.models import llama
from autoplan.search._gc import gc_paused
from autoplan.search.partition import DPSolver, brute_force, solve_dp
from autoplan.search.stage_model import CutProblem

SMALL = "gpt:num_layers=3,hidden_size=64,num_heads=4,vocab_size=128,max_seq_len=64"


def test_analytic_profile_cached_and_equal(tmp_path, monkeypatch):
    first = profile_with_graph(SMALL, seq_len=32, cache_dir=tmp_path).profile
    files = list(tmp_path.glob("analytic-*.json"))
    assert len(files) == 1

    def fail(*args, **kwargs):
        raise AssertionError("a cached analytic profile must not be re-run on fake tensors")

    monkeypatch.setattr(profile_mod, "run_fake", fail)
    second = profile_with_graph(SMALL, seq_len=32, cache_dir=tmp_path).profile
    assert second == first


def test_analytic_cache_key_tracks_shapes_and_dtype(tmp_path):
    profile_with_graph(SMALL, seq_len=32, cache_dir=tmp_path)
    longer = profile_with_graph(SMALL, seq_len=64, cache_dir=tmp_path).profile
    fp32 = profile_with_graph(SMALL, seq_len=32, dtype="fp32", cache_dir=tmp_path).profile
    assert len(list(tmp_path.glob("analytic-*.json"))) == 3
    assert longer.seq_len == 64 and fp32.dtype == "float32"


def test_damaged_cache_entry_is_reprofiled(tmp_path):
    first = profile_with_graph(SMALL, seq_len=32, cache_dir=tmp_path).profile
    (path,) = tmp_path.glob("analytic-*.json")
    path.write_text("{not json")
    assert profile_with_graph(SMALL, seq_len=32, cache_dir=tmp_path).profile == first


def test_dp_solver_shares_first_pass():
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(2, 12))
        s = int(rng.integers(1, n + 1))
        problem = CutProblem(
            block_time_s=rng.integers(1, 4, n).astype(float), cut_time_s=np.zeros(n + 1),
            block_static_bytes=rng.integers(0, 5, n).astype(float), block_act_bytes=rng.integers(0, 5, n).astype(float),
            inflight=rng.integers(1, 4, s).astype(float), capacity_bytes=np.full(s, 30.0),
            legal_cut=rng.random(n - 1) < 0.8)
        solver = DPSolver(problem)
        rough, refined = solver.solve(refine=False), solver.solve()
        fresh = solve_dp(problem)
        assert (rough is None) == (fresh is None) == (brute_force(problem) is None)
        if fresh is not None:
            assert refined == fresh
            assert rough.bottleneck_s == fresh.bottleneck_s == brute_force(problem).bottleneck_s


def test_dp_chunked_windows_match(monkeypatch):
    import autoplan.search.partition as partition

    rng = np.random.default_rng(4)
    problems = []
    for _ in range(50):
        n = int(rng.integers(3, 15))
        s = int(rng.integers(1, n + 1))
        problems.append(CutProblem(
            block_time_s=rng.random((s, n)), cut_time_s=np.zeros(n + 1), block_static_bytes=rng.random(n),
            block_act_bytes=rng.random(n), inflight=rng.integers(1, 4, s).astype(float),
            capacity_bytes=np.full(s, float(n) / 2)))
    whole = [solve_dp(p) for p in problems]
    monkeypatch.setattr(partition, "_CHUNK_ELEMENTS", 1)  # one stage per chunk, nothing kept
    assert [solve_dp(p) for p in problems] == whole


def test_meta_build_skips_values_but_materialize_fills_them():
    spec = "llama:num_layers=2,hidden_size=64,num_heads=4,num_kv_heads=2,vocab_size=128,max_seq_len=32"
    meta = zoo.build_model(spec, device="meta")
    rope = meta.layers[0].attention.rope
    assert rope.cos.device.type == "meta" and rope.cos.shape == (32, 16) and rope.cos.dtype == torch.float32
    assert meta.tok_embeddings.weight.requires_grad
    real = zoo.build_model(spec, device="cpu")
    cos, sin = llama._rope_tables(32, 16, real.layers[0].attention.rope.theta)
    torch.testing.assert_close(real.layers[0].attention.rope.cos, cos)
    torch.testing.assert_close(real.layers[0].attention.rope.sin, sin)
    assert real.tok_embeddings.weight.std() > 0


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_paused_restores_state(enabled):
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with gc_paused():
            assert not gc.isenabled()
            with gc_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_gc_pause_hands_objects_to_the_old_generation():
    was = gc.isenabled()
    try:
        gc.enable()
        with gc_paused():
            kept = [[i] for i in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() == 0  # nothing stays frozen
        assert all(gc.is_tracked(x) for x in kept[:10])
        assert gc.get_count()[0] < 1000  # not left for a young collection to walk
        # Objects a program froze itself stay frozen. The count is not compared for equality: a frozen
        # object another thread frees meanwhile (pytest-xdist's execnet thread) leaves the permanent
        # generation, and CI once saw 1550503 -> 1550500. A pause that unfroze would leave 0.
        gc.freeze()
        frozen = gc.get_freeze_count()
        with gc_paused():
            pass
        assert gc.get_freeze_count() > frozen // 2
        gc.unfreeze()
    finally:
        (gc.enable if was else gc.disable)()


def test_stage_stats_match_the_stage_model():
    from autoplan.search.stage_model import Prefix, _stage_mem, _stage_time, stage_stats

    rng = np.random.default_rng(5)
    for two_d in (False, True):
        for _ in range(30):
            n = int(rng.integers(2, 12))
            s = int(rng.integers(1, n + 1))
            problem = CutProblem(
                block_time_s=rng.random((s, n)) if two_d else rng.random(n), cut_time_s=rng.random(n + 1),
                block_static_bytes=rng.random(n), block_act_bytes=rng.random(n), inflight=rng.integers(1, 4, s),
                capacity_bytes=np.full(s, np.inf), cut_act_bytes=rng.random(n + 1))
            inner = sorted(rng.choice(np.arange(1, n), size=s - 1, replace=False).tolist())
            b = (0, *inner, n)
            times, mems = stage_stats(problem, b)
            pre = Prefix(problem)
            assert times.tolist() == [_stage_time(pre, problem, k, b[k], b[k + 1]) for k in range(s)]
            assert mems.tolist() == [_stage_mem(pre, problem, k, b[k], b[k + 1]) for k in range(s)]


def test_lazy_fake_parameters_count_tied_weights_once(tmp_path):
    """Fakes are made on first use; tied parameters still count once and every block its bytes."""
    spec = "gpt:num_layers=3,hidden_size=64,num_heads=4,vocab_size=128,max_seq_len=64"
    prof = profile_with_graph(spec, seq_len=32, cache_dir=tmp_path).profile
    model = zoo.build_model(zoo.parse_model_spec(spec), device="meta")
    assert sum(b.num_params for b in prof.blocks) == sum(p.numel() for p in model.parameters())
    assert all(b.param_bytes >= 2 * b.num_params for b in prof.blocks)


def test_dp_band_matches_full_windows(monkeypatch):
    """[Note: DP band]: keeping only the starts that can fit gives the very same cuttings."""
    rng = np.random.default_rng(6)
    problems = []
    for _ in range(150):
        n = int(rng.integers(3, 30))
        s = int(rng.integers(1, n + 1))
        problems.append(CutProblem(
            block_time_s=rng.integers(1, 5, n).astype(float), cut_time_s=rng.random(n + 1) * 0.5,
            block_static_bytes=rng.integers(0, 5, n).astype(float), block_act_bytes=rng.integers(0, 5, n).astype(float),
            inflight=rng.integers(1, 4, s).astype(float), capacity_bytes=rng.uniform(5.0, 40.0, s),
            legal_cut=rng.random(n - 1) < 0.9))
    banded = [(DPSolver(p).band, solve_dp(p), solve_dp(p, refine=False)) for p in problems]
    assert any(band < p.num_blocks - p.num_stages + 1 for (band, _, _), p in zip(banded, problems))
    monkeypatch.setattr(DPSolver, "_band", lambda self: self.width)
    assert [(solve_dp(p), solve_dp(p, refine=False)) for p in problems] == [b[1:] for b in banded]
