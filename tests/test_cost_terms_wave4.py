"""Issue 40 item 4's terms: interleaving's bubble, Megatron-LM's residual dropout, DeepSpeed's
pipeline engine as a stack, and the Triton kernel's H100 range (docs/cost-model.md)."""

from __future__ import annotations

import json

import pytest

import autoplan
from autoplan.cli import main as cli_main
from autoplan.cluster import get_gpu, parse_cluster
from autoplan.cost.calibration import ATTENTION_SHARE_BOUNDS, default_calibration, shipped_calibrations
from autoplan.cost.config import ParallelConfig
from autoplan.cost.time import block_times, hidden_dropout_times_s
from autoplan.schedule.actions import ActionKind, make_schedule
from autoplan.schedule.simulate import simulate

SPEC = "gpt:num_layers=4,hidden_size=256,num_heads=4,vocab_size=512,max_seq_len=128"


@pytest.mark.parametrize("ranks,microbatches", [(2, 4), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("virtual", [1, 2, 4])
def test_interleaving_divides_the_bubble_by_the_virtual_stages(ranks, microbatches, virtual):
    """Narayanan et al. 2021, Sec. 2.2.2: with v chunks a rank, equal stages and free transfers, a
    1F1B step takes (m + (p - 1) / v) times a micro-batch's forward and backward on one rank. The
    simulator the search scores schedules with gives exactly that."""
    per_microbatch = 3.0  # forward 1 + backward 2, split over the rank's v chunks
    name = "1f1b" if virtual == 1 else "interleaved-1f1b"
    stages = ranks * virtual
    durations = {ActionKind.F: [1.0 / virtual] * stages, ActionKind.B: [2.0 / virtual] * stages}
    result = simulate(make_schedule(name, ranks, microbatches, virtual), durations)
    assert result.makespan_s == pytest.approx(per_microbatch * (microbatches + (ranks - 1) / virtual))
    bubble = (ranks - 1) / virtual
    assert result.bubble_fraction == pytest.approx(bubble / (microbatches + bubble))


@pytest.fixture(scope="module")
def profile():
    return autoplan.profile(SPEC, seq_len=128)


def _cfg(tp: int = 1, sp: bool = False) -> ParallelConfig:
    return ParallelConfig(tp=tp, pp=1, dp=1, micro_batch_size=2, num_microbatches=1, schedule="1f1b",
                          recompute="full", sequence_parallel=sp)


@pytest.mark.parametrize("tp,sp", [(1, False), (4, False), (4, True)])
def test_megatrons_residual_dropout_costs_its_mask_and_a_backward_kernel(profile, tp, sp):
    """[Note: hidden dropout] in cost/time.py: two dropouts a layer, one byte of mask an element in the
    forward, 5 bytes an element in the backward, on the whole hidden state unless sequence parallelism
    splits it; full recompute runs the forward's again. Only the stack that says so pays."""
    gpu = get_gpu("A100-SXM4-80GB")
    cluster = parse_cluster("1x8xA100-80GB")
    base = default_calibration(gpu)
    megatron = base.for_stack("megatron-lm-2021")
    assert megatron.hidden_dropout and not base.hidden_dropout
    without = megatron.replace(hidden_dropout=False)
    cfg = _cfg(tp, sp)
    on = block_times(profile, gpu, cluster, cfg, "bfloat16", megatron)
    off = block_times(profile, gpu, cluster, cfg, "bfloat16", without)
    layers = [i for i, b in enumerate(profile.blocks) if b.kind == "layer"]
    assert layers and len(layers) == 4
    bandwidth = megatron.memory_bandwidth_efficiency * gpu.mem_bw_bytes_per_s
    for i in range(profile.num_blocks):
        if i not in layers:
            assert on.fwd_s[i] == off.fwd_s[i] and on.bwd_s[i] == off.bwd_s[i]
            continue
        block = profile.blocks[i]
        elements = block.output_bytes / 2 * cfg.micro_batch_size / profile.batch_size / (tp if sp else 1)
        assert elements == 2 * 128 * 256 / (tp if sp else 1)  # s b h, bf16
        mask_s = 2 * elements * 1.0 / bandwidth
        backward_s = 2 * max(megatron.kernel_floor_s, elements * 5.0 / bandwidth)
        assert on.fwd_s[i] - off.fwd_s[i] == pytest.approx(mask_s)
        # The backward's kernels, and the recomputed forward's masks (full recompute).
        assert on.bwd_s[i] - off.bwd_s[i] == pytest.approx(backward_s + mask_s)
    assert hidden_dropout_times_s(profile.blocks[0], megatron, gpu, 1.0, 1, False, "bfloat16", "bfloat16") == (0, 0)


def test_the_2021_runs_are_priced_with_their_dropout():
    """Megatron-LM SC'21's stack drops out its residual branches (Megatron-LM's default then); no other
    shipped stack does."""
    for cal in shipped_calibrations().values():
        assert cal.for_stack("megatron-lm-2021").hidden_dropout
        for name in (cal.stack, *cal.stacks):
            if name != "megatron-lm-2021":
                assert not cal.for_stack(name).hidden_dropout, (cal.gpu, name)


def test_the_llm_foundry_triton_range_on_the_h100_is_flash2s_over_the_published_ratio():
    """calibration.py [Note: attention kernels]: the 2023 Triton kernel is 1.3-2.5x slower than
    FlashAttention-2 (Dao 2023, Sec. 4.1), on either chip; the fitted share lies inside."""
    for chip in ("A100", "H100"):
        low, high = ATTENTION_SHARE_BOUNDS[("flash2", chip)]
        assert ATTENTION_SHARE_BOUNDS[("triton", chip)] == (round(low / 2.5, 2), round(high / 1.3, 2))
    for cal in shipped_calibrations().values():
        if "llm-foundry" in cal.stacks:
            chip = cal.gpu.split("-")[0]
            low, high = ATTENTION_SHARE_BOUNDS[("triton", chip)]
            assert low <= cal.for_stack("llm-foundry").attention_fwd_efficiency <= high


def _plan(args: list[str], capsys) -> dict:
    assert cli_main(args) == 0
    return json.loads(capsys.readouterr().out)["plans"][0]


def test_suggest_prices_deepspeeds_pipeline_engine(capsys):
    """`autoplan suggest --stack deepspeed`: DeepSpeed's PipelineEngine sends and receives with blocking
    calls and all-reduces gradients after the last backward, so the same pinned plan computes alike
    and waits longer than under today's stack (transfers overlapped, gradients reduced in buckets
    during the backward)."""
    wide = SPEC.replace("hidden_size=256", "hidden_size=1024").replace("num_layers=4", "num_layers=8")
    args = ["suggest", "--model", wide, "--cluster", "2x8xA100-80GB", "--global-batch", "64", "--seq-len", "128",
            "--top", "1", "--json", "--tp", "1", "--pp", "2", "--dp", "8", "--zero", "0", "--schedule", "1f1b",
            "--micro-batch-size", "2", "--recompute", "none"]
    today = _plan(args, capsys)
    deepspeed = _plan([*args, "--stack", "deepspeed"], capsys)
    assert (today["pp"], today["dp"]) == (deepspeed["pp"], deepspeed["dp"]) == (2, 8)
    before, after = today["predicted"]["breakdown"], deepspeed["predicted"]["breakdown"]
    assert after["compute_s"] == pytest.approx(before["compute_s"])
    assert after["dp_comm_exposed_s"] > before["dp_comm_exposed_s"]
    assert deepspeed["predicted"]["step_time_s"] > today["predicted"]["step_time_s"]
    for cal in shipped_calibrations().values():
        engine = cal.for_stack("deepspeed")
        assert engine.p2p_blocking and not engine.overlap_grad_reduce
        assert engine.attention_kernel == cal.attention_kernel
