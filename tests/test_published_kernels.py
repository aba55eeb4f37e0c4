"""The attention kernel is a named stack choice, and every shipped share lies within what that kernel's
published benchmarks reach on its chip (cost/calibration.py [Note: attention kernels], issue 40)."""

from __future__ import annotations

import json

import pytest

from autoplan.cli import main as cli_main
from autoplan.cost.calibration import (
    ATTENTION_SHARE_BOUNDS,
    Calibration,
    CalibrationError,
    attention_share_bounds,
    shipped_calibrations,
)


def _shares():
    """(gpu, stack, kernel, share) for every stack of every shipped calibration."""
    for gpu, cal in shipped_calibrations().items():
        for stack in (cal.stack, *cal.stacks):
            under = cal.for_stack(stack)
            yield gpu, stack, under.attention_kernel, under.attention_fwd_efficiency, under.attention_bwd_efficiency


@pytest.mark.parametrize(("gpu", "stack", "kernel", "fwd", "bwd"), list(_shares()))
def test_every_shipped_attention_share_is_inside_its_kernels_published_range(gpu, stack, kernel, fwd, bwd):
    if kernel == "unfused":  # priced from its GEMMs and memory traffic: no share of its own
        return
    bounds = attention_share_bounds(kernel, gpu)
    assert bounds is not None, f"{gpu} {stack}: no published range for {kernel} on this chip"
    low, high = bounds
    assert low <= fwd <= high and low <= bwd <= high, f"{gpu} {stack} ({kernel}): {fwd}, {bwd} outside {bounds}"


def test_each_stack_names_the_kernel_it_ran():
    cals = shipped_calibrations()
    for cal in cals.values():
        assert cal.attention_kernel == "flash2"  # torch SDPA's flash backend, what autoplan's runtime calls
        assert cal.for_stack("megatron-lm-2021").attention_kernel == "unfused"
        assert cal.for_stack("llm-foundry").attention_kernel == "triton"
    assert cals["H100-SXM-80GB"].for_stack("megatron-core").attention_kernel == "cudnn"
    assert attention_share_bounds("flash2", "H200-SXM-141GB") == ATTENTION_SHARE_BOUNDS[("flash2", "H100")]


def test_the_published_llm_foundry_runs_are_priced_with_their_triton_kernel():
    from autoplan.published import FIT_PARAMETERS, LLM_FOUNDRY_STACK, bounds, load_runs

    runs = [r for r in load_runs() if r.source == "llm-foundry"]
    assert runs and all(r.stack == LLM_FOUNDRY_STACK for r in runs)
    assert bounds("H100.triton") == ATTENTION_SHARE_BOUNDS[("triton", "H100")]
    assert bounds("A100.attention") == ATTENTION_SHARE_BOUNDS[("flash2", "A100")]
    assert {"A100.triton", "H100.triton"} <= set(FIT_PARAMETERS)


def test_an_old_file_naming_flash_reads_as_flashattention2_and_an_unknown_kernel_is_one_line():
    cal = shipped_calibrations()["A100-SXM4-80GB"]
    data = cal.to_dict()
    data["stack"]["attention_kernel"] = "flash"
    assert Calibration.from_dict(data).attention_kernel == "flash2"
    data["stack"]["attention_kernel"] = "sdpa-math"
    with pytest.raises(CalibrationError, match="attention_kernel must be one of"):
        Calibration.from_dict(data)


def test_suggest_prices_attention_with_the_kernel_of_the_stack_it_names(capsys):
    """`autoplan suggest --stack llm-foundry` on H100s prices attention with the Triton kernel's share,
    not FlashAttention-2's: the same plan computes longer where that share is lower, shorter where higher."""
    spec = "gpt:num_layers=2,hidden_size=1024,num_heads=8,vocab_size=1024,max_seq_len=8192"
    args = ["suggest", "--model", spec, "--cluster", "1x8xH100-80GB", "--global-batch", "8", "--seq-len", "8192",
            "--top", "1", "--json", "--tp", "1", "--pp", "1", "--dp", "8", "--zero", "3",
            "--micro-batch-size", "1", "--recompute", "none"]

    def compute_s(extra: list[str]) -> float:
        assert cli_main([*args, *extra]) == 0
        return json.loads(capsys.readouterr().out)["plans"][0]["predicted"]["breakdown"]["compute_s"]

    default, triton = compute_s([]), compute_s(["--stack", "llm-foundry"])
    h100 = shipped_calibrations()["H100-SXM-80GB"]
    share, flash2 = h100.for_stack("llm-foundry").attention_fwd_efficiency, h100.attention_fwd_efficiency
    assert share != pytest.approx(flash2, rel=0.02)
    assert (triton > default) == (share < flash2) and triton != pytest.approx(default, rel=0.005)


def test_no_shipped_fitted_number_lies_outside_its_bounds():
    """Every number [Note: the published fit] solves for, as shipped, inside the range the fit
    searches (`bounds`: an attention share's is its kernel's published range)."""
    from autoplan.published import FIT_PARAMETERS, bounds, load_runs, parameters_of, shipped_by_chip

    for name, value in zip(FIT_PARAMETERS, parameters_of(shipped_by_chip(load_runs())), strict=True):
        low, high = bounds(name)
        assert low <= value <= high, f"{name} {value} outside [{low}, {high}]"
