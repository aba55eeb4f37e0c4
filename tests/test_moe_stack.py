"""Megatron-Core's mixture-of-experts stack as the cost model prices it (autoplan/published.py [Note:
Megatron-Core's MoE stack], calibration.py [Note: software stacks]): a DeepEP dispatch sends a token
once per destination rank (cost/experts.py `dispatch_share`), and a layer whose all-to-all brings the
token counts to the host issues its kernels at the host's pace (`host_sync_kernel_s`). Shown through
`autoplan suggest --stack ...`, the published runs' stacks, and the helpers."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

import autoplan
from autoplan.cli import main as cli_main
from autoplan.cluster import get_gpu, parse_cluster
from autoplan.cost.calibration import Calibration, CalibrationError, default_calibration
from autoplan.cost.config import ParallelConfig
from autoplan.cost.experts import dispatch_share, expert_exchange_times_s
from autoplan.cost.time import op_pass_times

E, K = 16, 4
SPEC = (f"moe:num_layers=2,hidden_size=256,num_heads=4,num_kv_heads=4,ffn_hidden_size=256,vocab_size=512,"
        f"max_seq_len=256,num_experts={E},experts_per_token={K},dropless=true")


@pytest.fixture(scope="module")
def profile():
    return autoplan.profile(SPEC, seq_len=256)


def _cfg(ep: int, dp: int = 8) -> ParallelConfig:
    return ParallelConfig(tp=1, pp=1, dp=dp, ep=ep, micro_batch_size=1, num_microbatches=1, schedule="1f1b")


def test_the_profile_records_the_experts_each_token_reaches(profile):
    assert profile.extra["experts"]["experts_per_token"] == K
    assert profile.extra["experts"]["num_experts"] == E


def test_a_deepep_dispatch_sends_each_token_once_per_rank(profile):
    """ep (1 - C(E - E/ep, k) / C(E, k)) distinct ranks per token, over k copies."""
    for ep in (2, 4, 8, 16):
        expected = ep * (1 - math.comb(E - E // ep, K) / math.comb(E, K)) / K
        assert dispatch_share(profile, _cfg(ep, dp=16), "ranks") == pytest.approx(expected)
    # One expert per rank: k distinct ranks, nothing to combine.
    assert dispatch_share(profile, _cfg(16, dp=16), "ranks") == pytest.approx(1.0)
    # Two ranks hold all 16: a token's 4 experts land on one or both, never more.
    assert dispatch_share(profile, _cfg(2), "ranks") < 0.5
    assert dispatch_share(profile, _cfg(8), "copies") == 1.0
    assert dispatch_share(profile, _cfg(1), "ranks") == 1.0
    # A profile that does not record k (a model whose config does not say it) is priced by its copies.
    unknown = dataclasses.replace(profile, extra={**profile.extra, "experts": {
        k: v for k, v in profile.extra["experts"].items() if k != "experts_per_token"}})
    assert dispatch_share(unknown, _cfg(8), "ranks") == 1.0
    cluster = parse_cluster("1x8xH100-80GB")
    copies = expert_exchange_times_s(profile, cluster, _cfg(8), "copies")
    ranks = expert_exchange_times_s(profile, cluster, _cfg(8), "ranks")
    layers = copies > 0
    assert layers.any() and (ranks[layers] < copies[layers]).all()


def test_qwen3_235b_routing_reaches_about_five_ranks_of_eight():
    """Qwen3-235B's routing (8 of 128 experts) at ep 8, on a narrow copy of its layer: 5.34 distinct
    ranks per token, a share of 0.667 of the copies (docs/cost-model.md, "Mixture of experts")."""
    narrow = autoplan.profile("moe:num_layers=1,hidden_size=64,num_heads=4,num_kv_heads=4,ffn_hidden_size=32,"
                              "vocab_size=128,max_seq_len=64,num_experts=128,experts_per_token=8,dropless=true",
                              seq_len=64)
    assert dispatch_share(narrow, _cfg(8), "ranks") == pytest.approx(5.339 / 8, abs=1e-3)


def test_a_layer_that_waits_on_the_host_prices_its_kernels_at_the_hosts_pace(profile):
    gpu = get_gpu("H100-SXM-80GB")
    cal = default_calibration(gpu)
    synced = cal.replace(host_sync_kernel_s=100e-6)
    layer = next(b for b in profile.blocks if b.kind == "layer")
    head = profile.blocks[-1]
    forward_kernels = sum(op.count for op in layer.ops if op.phase == "fwd")

    def passes(block, c, ep):
        return op_pass_times(block, c, gpu, 1.0, 1, False, "bfloat16", profile.dtype, ep)

    backward_kernels = sum(op.count for op in layer.ops if op.phase == "bwd")
    fwd, bwd, _ = passes(layer, synced, 2)
    plain_fwd, plain_bwd, _ = passes(layer, cal, 2)
    assert fwd >= forward_kernels * 100e-6 * 0.999 > plain_fwd
    assert bwd >= backward_kernels * 100e-6 * 0.999 > plain_bwd
    # Without expert parallelism nothing waits on the host; a block without experts never does.
    assert passes(layer, synced, 1) == passes(layer, cal, 1)
    assert passes(head, synced, 2) == passes(head, cal, 2)


def test_the_shipped_h100_calibration_names_the_megatron_core_stacks():
    cal = default_calibration(get_gpu("H100-SXM-80GB"))
    a2a, deepep = cal.for_stack("megatron-core"), cal.for_stack("megatron-core-deepep")
    assert (a2a.expert_dispatch, deepep.expert_dispatch) == ("copies", "ranks")
    assert a2a.host_sync_kernel_s == deepep.host_sync_kernel_s > cal.kernel_floor_s
    assert a2a.tp_comm_overlap and deepep.tp_comm_overlap and not cal.tp_comm_overlap
    assert a2a.attention_fwd_efficiency == deepep.attention_fwd_efficiency <= 0.75
    # Today's stack (autoplan's runtime) keeps its own numbers: the fitted ones are Megatron-Core's.
    assert cal.expert_dispatch == "copies" and cal.host_sync_kernel_s == 0.0
    # A round trip keeps the stacks and the fields.
    again = Calibration.from_dict(cal.to_dict())
    assert again.for_stack("megatron-core-deepep") == deepep


@pytest.mark.parametrize("change, message", [
    ({"expert_dispatch": "tokens"}, "expert_dispatch must be one of"),
    ({"host_sync_kernel_s": -1}, "host_sync_kernel_s must be seconds"),
    ({"attention_fwd_efficiency": 3}, "attention_fwd_efficiency must be a number in (0, 1]"),
])
def test_a_malformed_stack_is_one_line(change, message):
    data = default_calibration(get_gpu("H100-SXM-80GB")).to_dict()
    data["stacks"]["megatron-core"] = {**data["stacks"]["megatron-core"], **change}
    with pytest.raises(CalibrationError, match="megatron-core") as raised:
        Calibration.from_dict(data)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def _step(args: list[str], capsys) -> dict:
    assert cli_main(args) == 0
    return json.loads(capsys.readouterr().out)["plans"][0]


def test_suggest_prices_a_plan_under_megatron_cores_stacks(capsys):
    """`autoplan suggest --stack megatron-core-deepep`: the same plan with DeepEP's dispatch moves fewer
    bytes than with the all-to-all dispatcher, and both compute at Megatron-Core's numbers; on
    an A100 cluster, whose calibration names no such stack, it is one line and exit 2."""
    # Wide enough that the exchange is priced by its bytes, not its latencies.
    wide = SPEC.replace("hidden_size=256", "hidden_size=2048").replace("max_seq_len=256", "max_seq_len=4096")
    args = ["suggest", "--model", wide, "--cluster", "1x8xH100-80GB", "--global-batch", "16", "--seq-len", "4096",
            "--top", "1", "--json", "--tp", "1", "--pp", "1", "--dp", "8", "--ep", "8", "--zero", "1",
            "--micro-batch-size", "2", "--recompute", "none"]
    flash = _step(args, capsys)
    a2a = _step([*args, "--stack", "megatron-core"], capsys)
    deepep = _step([*args, "--stack", "megatron-core-deepep"], capsys)
    assert a2a["ep"] == deepep["ep"] == 8
    assert deepep["predicted"]["breakdown"]["ep_comm_s"] < a2a["predicted"]["breakdown"]["ep_comm_s"]
    # 8 ranks of 2 experts, 4 experts per token: each token reaches fewer than 4 ranks.
    share = 8 * (1 - math.comb(E - 2, K) / math.comb(E, K)) / K
    # The exchange's bytes shrink by the share; its latency terms do not, so the time shrinks a bit less.
    ratio = deepep["predicted"]["breakdown"]["ep_comm_s"] / a2a["predicted"]["breakdown"]["ep_comm_s"]
    assert share < ratio < 1.0 and ratio == pytest.approx(share, rel=0.08)
    # The two stacks compute alike (only their dispatch differs), and not as today's stack does (its
    # attention share and host pace are its own).
    assert a2a["predicted"]["breakdown"]["compute_s"] == pytest.approx(deepep["predicted"]["breakdown"]["compute_s"])
    assert a2a["predicted"]["breakdown"]["compute_s"] != pytest.approx(flash["predicted"]["breakdown"]["compute_s"])
    a100 = [a if a != "1x8xH100-80GB" else "1x8xA100-80GB" for a in args]
    assert cli_main([*a100, "--stack", "megatron-core"]) == 2
    err = capsys.readouterr().err.strip()
    assert "megatron-core" in err and len(err.splitlines()) == 1


def test_the_published_moe_runs_ran_dropless_under_their_dispatchers_stack():
    from autoplan.published import MEGATRON_CORE_STACKS, load_runs

    moe = {r.id: r for r in load_runs() if r.regime == "MoE"}
    assert moe, "the shared data has mixture-of-experts runs"
    for run in moe.values():
        assert "dropless=true" in run.model and "capacity_factor" not in run.model
        assert run.stack in MEGATRON_CORE_STACKS.values()
    assert moe["mcore_mixtral_8x7b_ep8_pp4"].stack == "megatron-core"
    assert moe["zoo_q235_tp4_ep8_pp8"].stack == "megatron-core-deepep"


def test_the_stack_fit_moves_no_dense_run():
    """`with_stack_parameters` (what `fit_stacks` sets) changes the Megatron-Core stacks only: the
    H100's dense published runs predict the same."""
    from autoplan.published import (
        calibrations_for,
        load_runs,
        predict_all,
        run_gpus,
        shipped_by_chip,
        stack_parameters_of,
        with_stack_parameters,
    )

    dense = [r for r in load_runs() if r.regime != "MoE" and "H100" in r.cluster][:3]
    assert len(dense) == 3
    shipped = shipped_by_chip(dense)
    moved = with_stack_parameters(shipped, ["H100"], 0.3, 70e-6)
    assert stack_parameters_of(moved) == (0.3, 70e-6) != stack_parameters_of(shipped)
    gpus = run_gpus(dense)
    before = [p.step_s for p in predict_all(dense, calibrations_for(shipped, gpus))]
    after = [p.step_s for p in predict_all(dense, calibrations_for(moved, gpus))]
    assert np.allclose(before, after)


def test_without_fitted_numbers_the_stacks_price_as_the_chip_does():
    from autoplan.published import stack_parameters_of, unfitted_stacks

    cal = default_calibration(get_gpu("H100-SXM-80GB"))
    plain = unfitted_stacks({"H100": cal}, ["H100"])
    assert stack_parameters_of(plain) == (round(cal.attention_fwd_efficiency, 4), 0.0)


def test_tp_communication_inside_the_gemms_is_not_exposed():
    """`tp_comm_overlap` (Transformer Engine's userbuffer overlap) hides the sequence-parallel
    collectives; without sequence parallelism, or under today's stack, they stay exposed."""
    from autoplan.cost.time import block_times

    dense = autoplan.profile("llama:num_layers=2,hidden_size=512,num_heads=8,vocab_size=512,max_seq_len=256",
                             seq_len=256)
    gpu = get_gpu("H100-SXM-80GB")
    cluster = parse_cluster("1x8xH100-80GB")
    cal = default_calibration(gpu)
    overlapped = cal.for_stack("megatron-core")

    def tp_seconds(c, sp):
        cfg = ParallelConfig(tp=4, pp=1, dp=2, micro_batch_size=1, num_microbatches=1, schedule="1f1b",
                             sequence_parallel=sp)
        times = block_times(dense, gpu, cluster, cfg, "bfloat16", c)
        return float((times.tp_fwd_s + times.tp_bwd_s).sum())

    assert tp_seconds(cal, True) > 0
    # The layers' collectives are hidden; the embedding's and the head's are not Transformer Engine
    # GEMMs and stay.
    hidden = tp_seconds(overlapped, True)
    assert 0 < hidden < 0.5 * tp_seconds(cal, True)
    assert tp_seconds(overlapped, False) == pytest.approx(tp_seconds(cal, False))


def test_tp_communication_overlap_leaves_the_expert_exchange_exposed(profile):
    from autoplan.cost.time import block_times

    gpu = get_gpu("H100-SXM-80GB")
    cluster = parse_cluster("1x8xH100-80GB")
    cfg = ParallelConfig(tp=2, pp=1, dp=4, ep=8, micro_batch_size=1, num_microbatches=1, schedule="1f1b",
                         sequence_parallel=True)
    overlapped = default_calibration(gpu).for_stack("megatron-core")
    times = block_times(profile, gpu, cluster, cfg, "bfloat16", overlapped)
    exchange = expert_exchange_times_s(profile, cluster, cfg, "copies")
    layers = exchange > 0
    assert layers.any()
    assert np.allclose(times.tp_fwd_s[layers], exchange[layers])
