"""`autoplan calibrate`: the user's path through the CLI on CPU, the fits on synthetic points, GPU names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autoplan.calibrate.calibrate import guess_gpu
from autoplan.calibrate.calibrate_fit import fit_calibration
from autoplan.cli import main
from autoplan.cluster import GPUS, cpu_device, parse_cluster, with_collective_curves
from autoplan.cost.calibration import Calibration, load_calibration
from autoplan.cost.ops import attention_time_s, gemm_time_s

MODEL = "gpt:num_layers=2,hidden_size=64,num_heads=4,vocab_size=128,max_seq_len=32"


def run_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


# The runs below time this machine for real and check the file is usable; --force writes it even when a
# loaded test machine makes the timings unstable (the refusal is tested with injected noise in
# test_newcomer_timing.py).
@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("calibrate")
    result = run_cli("calibrate", "--device", "cpu", "--quick", "--force", "--out", "cal.json", cwd=folder)
    return folder, result


def test_quick_cpu_calibration_is_usable_by_suggest(calibrated):
    folder, result = calibrated
    assert result.returncode == 0, result.stderr
    assert "GEMM share (fp32)" in result.stdout and "spread" in result.stdout
    assert "gemm fp32 [1/" in result.stderr  # one progress line per benchmark
    cal = load_calibration(folder / "cal.json")
    assert cal.gpu == "cpu"
    numbers = [*cal.gemm_efficiency.values(), cal.attention_fwd_efficiency, cal.attention_bwd_efficiency,
               cal.causal_work_fraction, cal.memory_bandwidth_efficiency, cal.kernel_floor_s]
    assert all(n > 0 for n in numbers)
    assert "measured by `autoplan calibrate` on" in cal.sources["gemm"]
    for kind in ("gemm", "attention", "memory"):
        points = cal.measurements[kind]
        assert points and all(p["time_s"] > 0 and p["spread"] >= 0 for p in points)

    suggested = run_cli("suggest", "--model", MODEL, "--cluster", "1x2xcpu", "--global-batch", "4",
                        "--calibration", "cal.json", "--out", "p.json", cwd=folder)
    assert suggested.returncode == 0, suggested.stderr
    assert json.loads((folder / "p.json").read_text())["tp"] >= 1


def test_refuses_to_overwrite(calibrated, capsys):
    folder, _ = calibrated
    before = (folder / "cal.json").read_text()
    assert main(["calibrate", "--device", "cpu", "--quick", "--out", str(folder / "cal.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--force" in err
    assert (folder / "cal.json").read_text() == before


@pytest.mark.parametrize("args, words", [
    (["--gpu", "NOPE"], "unknown gpu 'NOPE'"),
    (["--gpu", "H100"], "--gpu must be cpu"),
    (["--dtype", "int8"], "unknown dtype"),
    (["--nproc", "2"], "--nproc only applies with --collectives"),
    (["--collectives", "--nproc", "1"], "at least 2 ranks"),
])
def test_mistakes_are_one_line(tmp_path, capsys, args, words):
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--device", "cpu", "--quick", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not out.exists()


def test_collectives_on_gloo(tmp_path):
    result = run_cli("calibrate", "--device", "cpu", "--quick", "--collectives", "--nproc", "2", "--force", "--out",
                     "cal.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "cal.json").read_text())
    link = data["collectives"]["intra_node"]
    assert link["ranks"] == 2
    for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        assert len(link[op]) >= 2 and all(size > 0 and bw > 0 for size, bw in link[op])
    cal = load_calibration(tmp_path / "cal.json")
    cluster = with_collective_curves(parse_cluster("1x2xcpu"), cal.collectives)  # the reader accepts it
    assert cluster.intra_node.curves
    assert all("spread" in p for p in cal.measurements["collectives"])


def test_fit_recovers_the_numbers_it_was_made_with():
    gpu = GPUS["H100-SXM-80GB"]
    truth = Calibration(gpu=gpu.name, gemm_efficiency={"bf16": 0.7}, attention_fwd_efficiency=0.5,
                        attention_bwd_efficiency=0.4, causal_work_fraction=0.55, memory_bandwidth_efficiency=0.85,
                        kernel_floor_s=4e-6)
    gemm = [{"dtype": "bf16", "m": m, "n": n, "k": k, "spread": 0.01,
             "time_s": gemm_time_s(truth, gpu, 1, m, n, k, "bf16", 2.0)}
            for m in (512, 8192) for n in (1024, 8192) for k in (1024, 8192)]
    memory = [{"kernel": "copy", "bytes": b, "spread": 0.01, "time_s": max(4e-6, 2 * b / (0.85 * gpu.mem_bw_bytes_per_s)),
               "bw_bytes_per_s": 2 * b / max(4e-6, 2 * b / (0.85 * gpu.mem_bw_bytes_per_s))}
              for b in (2**16, 2**28, 2**30)]
    attention = []
    for causal in (False, True):
        for phase, flops in (("fwd", 1e12), ("bwd", 2.5e12)):
            attention.append({"batch": 1, "heads": 32, "seq": 4096, "head_dim": 128, "causal": causal, "phase": phase,
                              "flops": flops, "spread": 0.01,
                              "time_s": attention_time_s(truth, gpu, flops, causal, phase, "bf16")})
    fitted, rows, notes = fit_calibration(gpu, ["bf16"], gemm, attention, memory)
    assert fitted["gemm_efficiency"]["bf16"] == pytest.approx(0.7, rel=1e-3)
    assert fitted["attention_fwd_efficiency"] == pytest.approx(0.5)
    assert fitted["attention_bwd_efficiency"] == pytest.approx(0.4)
    assert fitted["causal_work_fraction"] == pytest.approx(0.55)
    assert fitted["memory_bandwidth_efficiency"] == pytest.approx(0.85)
    assert fitted["kernel_floor_s"] == pytest.approx(4e-6)
    assert not notes and {r["quantity"] for r in rows} >= {"GEMM share (bf16)", "kernel floor"}


def test_fit_caps_shares_above_one_and_says_so():
    gpu = cpu_device()
    gemm = [{"dtype": "fp32", "m": 512, "n": 512, "k": 512, "spread": 0.0, "time_s": 1e-9}]
    memory = [{"kernel": "copy", "bytes": b, "spread": 0.0, "time_s": 1e-9, "bw_bytes_per_s": 1e18} for b in (1, 2, 3)]
    attention = [{"batch": 1, "heads": 1, "seq": 8, "head_dim": 8, "causal": c, "phase": p, "flops": 1e9,
                  "spread": 0.0, "time_s": 1e-9} for c in (False, True) for p in ("fwd", "bwd")]
    fitted, _, notes = fit_calibration(gpu, ["fp32"], gemm, attention, memory)
    assert fitted["gemm_efficiency"]["fp32"] == 1.0 and fitted["unclamped"]["gemm_efficiency"]["fp32"] > 1
    assert any("AUTOPLAN_CPU_GFLOPS_PER_CORE" in n for n in notes)


@pytest.mark.parametrize("name, mem_gib, expected", [
    ("NVIDIA H100 80GB HBM3", 80, "H100-SXM-80GB"),
    ("NVIDIA H100 PCIe", 80, "H100-PCIe-80GB"),
    ("NVIDIA H200", 141, "H200-SXM-141GB"),
    ("NVIDIA A100-SXM4-80GB", 80, "A100-SXM4-80GB"),
    ("NVIDIA A100-SXM4-40GB", 40, "A100-SXM4-40GB"),
    ("NVIDIA L40S", 48, "L40S"),
    ("NVIDIA B200", 179, "B200-SXM-180GB"),
    ("NVIDIA GB200", 185, "GB200"),
    ("AMD Instinct MI325X", 256, "MI325X"),
    ("NVIDIA GeForce RTX 4090", 24, None),
])
def test_guess_gpu(name, mem_gib, expected):
    assert guess_gpu(name, mem_gib * 2**30) == expected
