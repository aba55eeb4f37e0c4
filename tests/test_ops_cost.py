"""The operator-level cost model: the profile's operator list, the per-operator times, calibrations."""

from __future__ import annotations

import json
import math

import pytest

import autoplan
from autoplan import models as zoo
from autoplan.cli import main as cli_main
from autoplan.cluster import get_gpu
from autoplan.cost.calibration import (
    Calibration,
    CalibrationError,
    default_calibration,
    load_calibration,
    shipped_calibrations,
)
from autoplan.cost.ops import attention_time_s, gemm_time_s, memory_time_s, op_time_s
from autoplan.graph.blocks import ModelProfile
from autoplan.graph.profile import profile_model

SPEC = "gpt:num_layers=2,hidden_size=256,num_heads=4,vocab_size=1024,max_seq_len=128"


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> ModelProfile:
    model = zoo.build_model(SPEC)
    prof, _ = profile_model(model, zoo.example_inputs(SPEC, 1, 128), loss_fn=zoo.lm_loss,
                            example_target=zoo.example_targets(SPEC, 1, 128), model_name=SPEC,
                            cache_dir=tmp_path_factory.mktemp("cache"))
    return prof


def test_a_layer_lists_its_gemms_attention_and_memory_ops_with_batch_and_tp_axes(profile):
    layer = next(b for b in profile.blocks if b.kind == "layer")
    gemms = [o for o in layer.ops if o.kind == "gemm"]
    attention = [o for o in layer.ops if o.kind == "attention"]
    assert {o.phase for o in layer.ops} == {"fwd", "bwd"}
    assert len(attention) == 2 and all(o.causal for o in attention)  # forward and backward, causal
    # Forward GEMMs: qkv (256 -> 768), proj, fc1 (256 -> 1024), fc2; the tokens (128) grow with the batch.
    fwd = sorted((o.shape for o in gemms if o.phase == "fwd"), key=lambda s: s[2] * s[3])
    assert fwd == [(1, 128, 256, 256), (1, 128, 768, 256), (1, 128, 1024, 256), (1, 128, 256, 1024)]
    for op in gemms:
        assert op.shape[op.batch_axis] == 128, op
        assert op.shape[op.tp_axis] in (768, 1024, 256), op  # the wider weight dimension
    # The recorded FLOPs are the FLOP counter's.
    assert sum(o.count * o.flops for o in layer.ops if o.phase == "fwd") == pytest.approx(layer.fwd_flops)
    # A weight's bytes do not grow with the batch; a norm's output is hidden-shaped.
    assert all(o.fixed_bytes > 0 for o in gemms)
    assert any(o.kind == "memory" and o.tp == "hidden" for o in layer.ops)


def test_profiles_round_trip_with_their_operators(profile):
    again = ModelProfile.from_dict(json.loads(profile.to_json()))
    assert again == profile


def test_gemm_is_priced_by_the_roofline():
    gpu = get_gpu("H100-SXM-80GB")
    cal = default_calibration(gpu)
    big = gemm_time_s(cal, gpu, 1, 8192, 8192, 8192, "bf16")
    assert big == pytest.approx(2 * 8192**3 / (cal.gemm("bf16") * gpu.peak("bf16")))
    skinny = gemm_time_s(cal, gpu, 64, 2048, 2048, 16, "bf16")  # k = 16: bound by its bytes
    traffic = 2 * 64 * (2048 * 16 + 16 * 2048 + 2048 * 2048)
    assert skinny == pytest.approx(traffic / (cal.memory_bandwidth_efficiency * gpu.mem_bw_bytes_per_s))
    assert memory_time_s(cal, gpu, 1) == cal.kernel_floor_s
    full = attention_time_s(cal, gpu, 1e12, False, "fwd", "bf16")
    assert attention_time_s(cal, gpu, 1e12, True, "fwd", "bf16") == pytest.approx(full * cal.causal_work_fraction)


def test_tensor_parallelism_and_micro_batch_scale_an_op(profile):
    gpu = get_gpu("A100-SXM4-80GB")
    cal = default_calibration(gpu).replace(kernel_floor_s=0.0)
    layer = next(b for b in profile.blocks if b.kind == "layer")
    fc1 = next(o for o in layer.ops if o.kind == "gemm" and o.phase == "fwd" and o.shape[2] == 1024)
    # Compute-bound at these sizes: linear in the micro-batch (a tiny one is bound by the weight's bytes).
    assert op_time_s(fc1, cal, gpu, 128, 1, False) == pytest.approx(2 * op_time_s(fc1, cal, gpu, 64, 1, False))
    assert op_time_s(fc1, cal, gpu, 1, 1, False) > op_time_s(fc1, cal, gpu, 64, 1, False) / 64
    # tp divides a compute-bound GEMM (at tp 2 the k 256 x n 512 tile stays above the A100's roofline
    # ridge at any fitted share; at tp 4 it sits on the ridge).
    assert op_time_s(fc1, cal, gpu, 256, 2, False) == pytest.approx(op_time_s(fc1, cal, gpu, 256, 1, False) / 2,
                                                                     rel=0.05)
    hidden = next(o for o in layer.ops if o.kind == "memory" and o.tp == "hidden")
    assert op_time_s(hidden, cal, gpu, 8, 4, False) == op_time_s(hidden, cal, gpu, 8, 1, False)  # replicated
    assert op_time_s(hidden, cal, gpu, 8, 4, True) < op_time_s(hidden, cal, gpu, 8, 1, False)  # sequence parallel


def test_shipped_calibrations_cover_a100_and_h100_and_say_where_they_come_from():
    shipped = shipped_calibrations()
    assert {"A100-SXM4-80GB", "H100-SXM-80GB"} <= set(shipped)
    for cal in shipped.values():
        for section in ("file", "gemm", "attention", "memory"):
            assert cal.sources[section], (cal.gpu, section)
    # Both fitted to the published runs (issue 28), the H100's own block measurements kept beside.
    for name in ("A100-SXM4-80GB", "H100-SXM-80GB"):
        assert "validate_published.py --write" in shipped[name].sources["gemm"]
        assert "megatron-lm-2021" in shipped[name].stacks
    assert "block times measured on the GPU" in shipped["H100-SXM-80GB"].sources["file"]
    assert shipped["H100-SXM-80GB"].measurements["points"]
    # Same chip, other memory size: the A100 file; an unknown type: assumed, and it says so.
    assert default_calibration(get_gpu("A100-SXM4-40GB")).gemm_efficiency == shipped["A100-SXM4-80GB"].gemm_efficiency
    assert "assumed" in default_calibration(get_gpu("L40S")).sources["file"]


def test_a_bad_calibration_file_is_one_line(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"schema": 1, "gpu": "H100-SXM-80GB", "gemm": {"efficiency": {"bf16": 1.7}},
                                "attention": {"fwd_efficiency": 0.5, "bwd_efficiency": 0.4},
                                "memory": {"bandwidth_efficiency": 0.8, "kernel_floor_s": 5e-6}}))
    with pytest.raises(CalibrationError, match=r"gemm.efficiency.bf16 must be a number in \(0, 1\]"):
        load_calibration(path)
    with pytest.raises(CalibrationError, match="does not exist"):
        load_calibration(tmp_path / "missing.json")


def test_suggest_uses_a_calibration_file_through_the_cli(tmp_path, capsys):
    """The user's path: a calibration for the cluster's GPU changes the prediction. (This small model's
    kernels are all at the floor, so a slower floor predicts a slower step.)"""
    h100 = default_calibration(get_gpu("H100-SXM-80GB"))
    slow = h100.replace(kernel_floor_s=h100.kernel_floor_s * 3)
    path = tmp_path / "h100.json"
    path.write_text(json.dumps(slow.to_dict()))
    args = ["suggest", "--model", SPEC, "--cluster", "1x2xH100-80GB", "--global-batch", "8", "--seq-len", "128",
            "--top", "1", "--json"]
    assert cli_main(args) == 0
    shipped = json.loads(capsys.readouterr().out)["plans"][0]["predicted"]["step_time_s"]
    assert cli_main([*args, "--calibration", str(path)]) == 0
    calibrated = json.loads(capsys.readouterr().out)["plans"][0]["predicted"]["step_time_s"]
    assert calibrated > shipped * 1.2
    assert cli_main([*args, "--calibration", str(tmp_path / "nope.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_api_takes_a_calibration_object():
    gpu = get_gpu("A100-SXM4-80GB")
    base = default_calibration(gpu)
    plans = autoplan.suggest(SPEC, "1x2xA100-80GB", global_batch=8, seq_len=128, top=1)
    faster = autoplan.suggest(SPEC, "1x2xA100-80GB", global_batch=8, seq_len=128, top=1,
                              calibration=_calibrations(base.replace(kernel_floor_s=base.kernel_floor_s / 4)))
    assert faster[0].predicted.step_time_s < plans[0].predicted.step_time_s
    assert math.isfinite(faster[0].predicted.step_time_s)


def _calibrations(cal: Calibration):
    from autoplan.cost.calibration import Calibrations

    return Calibrations({cal.gpu: cal})


def test_a_meta_run_profiles_as_a_fake_run_does(tmp_path, monkeypatch):
    """[Note: meta or fake] in graph/fake_run.py: a zoo model runs on meta tensors, with attention routed
    to the fused kernel; the profile is the one FakeTensorMode gives, and nothing leaks out."""
    import torch

    import autoplan.graph.fake_run as fake_run

    spec = "llama3-8b:num_layers=2,hidden_size=256,num_heads=4,num_kv_heads=2,ffn_hidden_size=512,vocab_size=512"
    on_meta = autoplan.profile(spec, seq_len=64, cache_dir=tmp_path / "meta")
    assert torch.empty(1).device.type == "cpu"  # the meta device context did not outlive the run
    original = fake_run._run_in

    def fake_only(mode, *args, meta, **kwargs):
        if meta:
            raise fake_run.ProfileError("fake tensors only")
        return original(mode, *args, meta=meta, **kwargs)

    monkeypatch.setattr(fake_run, "_run_in", fake_only)
    on_fake = autoplan.profile(spec, seq_len=64, cache_dir=tmp_path / "fake")
    assert on_meta == on_fake
    assert any(o.kind == "attention" for b in on_meta.blocks for o in b.ops)


def test_a_timed_profile_reports_its_spread_through_the_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path))
    assert cli_main(["profile", "--model", SPEC, "--seq-len", "32", "--device", "cpu", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "timing spread" in out and "worst" in out


def test_a_named_stack_prices_unfused_attention_through_the_cli(capsys):
    """[Note: software stacks]: `--stack megatron-lm-2021` prices attention unfused (every score
    through memory), which is slower at long sequences than today's flash attention; an unknown stack
    is one line and exit 2."""
    args = ["suggest", "--model", "gpt:num_layers=2,hidden_size=512,num_heads=8,vocab_size=1024,max_seq_len=4096",
            "--cluster", "1x8xA100-80GB", "--global-batch", "8", "--seq-len", "4096", "--top", "1", "--json", "--tp", "1",
            "--pp", "1", "--zero", "0", "--recompute", "none", "--micro-batch-size", "1"]
    assert cli_main(args) == 0
    flash = json.loads(capsys.readouterr().out)["plans"][0]["predicted"]["step_time_s"]
    assert cli_main([*args, "--stack", "megatron-lm-2021"]) == 0
    unfused = json.loads(capsys.readouterr().out)["plans"][0]["predicted"]["step_time_s"]
    assert unfused > flash * 1.3
    assert cli_main([*args, "--stack", "nonsense"]) == 2
    err = capsys.readouterr().err
    assert "nonsense" in err and "megatron-lm-2021" in err and len(err.strip().splitlines()) == 1


def test_unfused_attention_is_gemms_plus_score_traffic():
    """cost/ops.py: two GEMMs forward, four backward, and 9 / 11 bytes per score at 2-byte elements."""
    from autoplan.cost.ops import gemm_time_s, memory_time_s, unfused_attention_time_s

    gpu = get_gpu("A100-SXM4-80GB")
    cal = default_calibration(gpu).for_stack("megatron-lm-2021")
    shape = (2, 16, 2048, 2048, 128)
    scores = 2 * 16 * 2048 * 2048
    gemm = gemm_time_s(cal, gpu, 32, 2048, 2048, 128, "bfloat16")
    forward = unfused_attention_time_s(cal, gpu, shape, "fwd", "bfloat16")
    backward = unfused_attention_time_s(cal, gpu, shape, "bwd", "bfloat16")
    assert forward == pytest.approx(gemm + gemm_time_s(cal, gpu, 32, 2048, 128, 2048, "bfloat16")
                                    + memory_time_s(cal, gpu, 9 * scores))
    assert backward > forward
    assert memory_time_s(cal, gpu, 11 * scores) < backward
