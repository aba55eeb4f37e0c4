"""A stack's optimizer step is priced by the bytes it moves per parameter (cost/time.py [Note:
optimizer bytes]): 28 for a fused mixed-precision Adam, 46 for Megatron-LM's 2021 step, a count
read off its code that the published fit never touches."""

from __future__ import annotations

import json
import shutil

import pytest
from _scripts import load_benchmark

from autoplan.cli import main as cli_main
from autoplan.cost.calibration import STACK_FIELDS, Calibration, CalibrationError, shipped_calibrations
from autoplan.cost.time import ADAM_BYTES_PER_PARAM
from autoplan.published import FIT_PARAMETERS, apply_parameters, load_runs, parameters_of, shipped_by_chip

SPEC = "gpt:num_layers=4,hidden_size=512,num_heads=8,vocab_size=1024,max_seq_len=256"


def _plan(args: list[str], capsys) -> dict:
    assert cli_main(args) == 0
    return json.loads(capsys.readouterr().out)["plans"][0]


def test_megatron_lm_2021_steps_its_optimizer_over_46_bytes_a_parameter(capsys):
    """`autoplan suggest --stack megatron-lm-2021`: the same pinned plan's optimizer step takes 46/28
    of today's (unscale, clip norm and master copy are passes of their own)."""
    args = ["suggest", "--model", SPEC, "--cluster", "1x8xA100-80GB", "--global-batch", "16", "--seq-len", "256",
            "--top", "1", "--json", "--tp", "2", "--pp", "2", "--dp", "2", "--zero", "0", "--schedule", "1f1b",
            "--micro-batch-size", "2", "--recompute", "none"]
    today = _plan(args, capsys)
    megatron = _plan([*args, "--stack", "megatron-lm-2021"], capsys)
    assert [today[k] for k in ("tp", "pp", "dp", "zero")] == [megatron[k] for k in ("tp", "pp", "dp", "zero")]
    before, after = today["predicted"]["breakdown"]["optimizer_s"], megatron["predicted"]["breakdown"]["optimizer_s"]
    assert before > 0
    assert after == pytest.approx(before * 46 / 28, rel=1e-9)


def test_the_field_is_a_stack_field_the_megatron_2021_stacks_set_and_no_fit_reads():
    assert "optimizer_bytes_per_param" in STACK_FIELDS
    assert Calibration.__dataclass_fields__["optimizer_bytes_per_param"].default == ADAM_BYTES_PER_PARAM == 28.0
    assert not any("optimizer" in name for name in FIT_PARAMETERS)
    for cal in shipped_calibrations().values():
        assert cal.optimizer_bytes_per_param == 28.0
        if "megatron-lm-2021" in cal.stacks:
            assert cal.for_stack("megatron-lm-2021").optimizer_bytes_per_param == 46
            assert "b4bc51b1e7" in cal.stacks["megatron-lm-2021"]["note"]


def test_a_refit_writes_the_stacks_optimizer_bytes_back_unchanged(tmp_path, monkeypatch):
    """`validate_published.py --write` writes what it fitted; the stack's byte count comes back as the
    file had it, even with every fitted number moved."""
    script = load_benchmark("validate_published")
    folder = tmp_path / "autoplan" / "cost" / "calibrations"
    folder.mkdir(parents=True)
    for name in ("A100-SXM4-80GB", "H100-SXM-80GB"):
        shutil.copy(script.ROOT / "autoplan" / "cost" / "calibrations" / f"{name}.json", folder)
    monkeypatch.setattr(script, "ROOT", tmp_path)
    runs = load_runs()
    shipped = shipped_by_chip(runs)
    moved = apply_parameters(shipped, parameters_of(shipped) * 0.99)
    assert moved["A100"].gemm("bf16") != shipped["A100"].gemm("bf16")
    script._write_calibrations(moved, runs)
    for name in ("A100-SXM4-80GB", "H100-SXM-80GB"):
        data = json.loads((folder / f"{name}.json").read_text())
        family = name.split("-")[0]
        assert data["gemm"]["efficiency"]["bf16"] == pytest.approx(moved[family].gemm("bf16"))  # rewritten
        assert data["stacks"]["megatron-lm-2021"]["optimizer_bytes_per_param"] == 46
        assert "optimizer_bytes_per_param" not in data["stack"]  # the default stack's 28 is not written


def test_a_malformed_byte_count_is_one_line(tmp_path):
    data = json.loads(json.dumps(shipped_calibrations()["A100-SXM4-80GB"].to_dict()))
    data["stacks"]["megatron-lm-2021"]["optimizer_bytes_per_param"] = "46"
    with pytest.raises(CalibrationError, match="optimizer_bytes_per_param must be bytes per parameter"):
        Calibration.from_dict(data, where="x.json")
