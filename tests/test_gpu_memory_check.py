"""benchmarks/gpu_memory_check.py (issue 40, item 7): without CUDA it says so in one line and exits 2; its
layouts are plans `autoplan.suggest` makes, with the pinned micro-batch and recompute, that fit the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_memory_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_memory_check as gmc  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would measure")
def test_without_cuda_one_line_and_exit_2(tmp_path):
    out = tmp_path / "never.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no CUDA device" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not out.exists()


def test_the_layouts_are_pinned_plans_that_fit():
    seen = set()
    for micro_batch, recompute in gmc.LAYOUTS:
        plan = gmc._plan("H100-SXM-80GB", micro_batch, recompute)
        assert (plan.tp, plan.pp, plan.dp, plan.micro_batch_size, plan.recompute) == (1, 1, 1, micro_batch, recompute)
        assert plan.fits and plan.predicted.peak_memory_bytes < 80 * 2**30
        seen.add((micro_batch, recompute))
    assert {mb for mb, _ in seen} == {1, 2} and {rc for _, rc in seen} == {"none", "selective", "full"}


def test_device_names_map_to_the_device_table():
    assert gmc._gpu_name("NVIDIA H200") == "H200-SXM-141GB"
    assert gmc._gpu_name("NVIDIA H100 80GB HBM3") == "H100-SXM-80GB"
    assert gmc._default_json("NVIDIA H100 80GB HBM3").name == "memory_gpu_nvidia_h100_80gb_hbm3.json"
