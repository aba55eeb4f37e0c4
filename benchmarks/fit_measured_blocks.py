"""Fit a GPU's calibration to block times measured on it, and check it on whole steps measured there.

    python benchmarks/fit_measured_blocks.py                       # the H100 logs in benchmarks/results/
    python benchmarks/fit_measured_blocks.py --write               # also write autoplan/cost/calibrations/H100-SXM-80GB.json
    python benchmarks/fit_measured_blocks.py --results 'benchmarks/results/cuda_check_h100_run*.json'

Input: `benchmarks/cuda_check.py` logs (JSON): every block of gpt3-1.3b, gpt3-13b and llama3-8b (two
layers each) timed forward and backward on the GPU at micro-batch 1 and 2, sequence 2048, bf16, in
several runs; and whole training steps of gpt3-1.3b run there with `autoplan.partition`.

Fit: the median over runs of each (model, batch, block, pass) is one point. Five numbers of
cost/ops.py are fitted by least squares on log(predicted / measured) over all points (coordinate
search in log space): the GEMM share of peak, flash attention's forward and backward shares, the
memory-bandwidth share and the kernel floor. Points whose runs disagree by more than 25% of their
median are shown, not fitted. The causal work fraction is not fitted (with causal
attention only, it cannot be told from the shares): 1/2, FlashAttention-2's skipping of masked
tiles (Dao 2023, Sec. 3.1.1). Leave one model out: fit on two models' blocks, predict the third's.
The measured steps are not fitted; they check the result.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import statistics
import sys
from datetime import date
from pathlib import Path

import numpy as np

from autoplan import models as zoo
from autoplan.cluster import get_gpu
from autoplan.cost.calibration import Calibration, default_calibration
from autoplan.cost.time import op_pass_times
from autoplan.graph.profile import profile_model

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ("gemm", "attention_fwd", "attention_bwd", "memory", "floor")


def _profile(spec: str):
    model = zoo.build_model(spec)
    prof, _ = profile_model(model, zoo.example_inputs(spec, 1, 2048), loss_fn=zoo.lm_loss,
                            example_target=zoo.example_targets(spec, 1, 2048), model_name=spec,
                            info={k: v for k, v in zoo.model_info(spec).items() if isinstance(v, int)})
    return prof


def load_points(paths: list[str]) -> tuple[list[dict], list[dict], str]:
    """Median measured ms per (model, batch, block, pass), and the measured whole steps."""
    samples: dict[tuple, list[float]] = {}
    steps: list[dict] = []
    device = ""
    for path in paths:
        data = json.loads(Path(path).read_text())
        device = data.get("device", device)
        for row in data.get("blocks") or []:
            for phase in ("fwd", "bwd"):
                samples.setdefault((row["model"], row["batch"], row["name"], phase), []).append(row[f"measured_{phase}_ms"])
        steps += [dict(r, log=Path(path).name) for r in data.get("runs") or []]
    points = [{"model": m, "batch": b, "block": n, "phase": p, "measured_s": statistics.median(v) / 1e3,
               "spread": (max(v) - min(v)) / statistics.median(v), "runs": len(v)}
              for (m, b, n, p), v in sorted(samples.items())]
    return points, steps, device


def with_params(base: Calibration, x: np.ndarray) -> Calibration:
    gemm = {k: (float(x[0]) if k in ("bf16", "fp16") else v) for k, v in base.gemm_efficiency.items()}
    return base.replace(gemm_efficiency=gemm, attention_fwd_efficiency=float(x[1]), attention_bwd_efficiency=float(x[2]),
                        memory_bandwidth_efficiency=float(x[3]), kernel_floor_s=float(x[4]), causal_work_fraction=0.5)


def predict(points: list[dict], profiles: dict, cal: Calibration, gpu) -> np.ndarray:
    out = []
    for p in points:
        prof = profiles[p["model"]]
        block = next(b for b in prof.blocks if b.name == p["block"])
        fwd, bwd, _ = op_pass_times(block, cal, gpu, p["batch"] / prof.batch_size, 1, False, "bfloat16", prof.dtype)
        out.append(fwd if p["phase"] == "fwd" else bwd)
    return np.array(out)


def fit(points: list[dict], profiles: dict, base: Calibration, gpu) -> Calibration:
    """Coordinate search on log(parameter), minimizing the mean squared log error."""
    x = np.array([base.gemm("bf16"), base.attention_fwd_efficiency, base.attention_bwd_efficiency,
                  base.memory_bandwidth_efficiency, base.kernel_floor_s])
    # The floor is capped at 10 us: a block timed alone pays a launch and synchronization per call
    # that back-to-back kernels in a training step overlap (left free, it fits 33 us).
    upper = np.array([1.0, 1.0, 1.0, 1.0, 1e-5])
    measured = np.array([p["measured_s"] for p in points])

    def loss(v: np.ndarray) -> float:
        return float(np.mean(np.log(predict(points, profiles, with_params(base, v), gpu) / measured) ** 2))

    best = loss(x)
    step = 0.3
    for _ in range(40):
        improved = False
        for k in range(len(x)):
            for sign in (1, -1):
                trial = x.copy()
                trial[k] = min(upper[k], trial[k] * math.exp(sign * step))
                value = loss(trial)
                if value < best - 1e-12:
                    x, best, improved = trial, value, True
                    break
        if not improved:
            step /= 2
            if step < 1e-3:
                break
    return with_params(base, x)


def _errors(points, profiles, cal, gpu) -> np.ndarray:
    return predict(points, profiles, cal, gpu) / np.array([p["measured_s"] for p in points]) - 1


def _summary(errors) -> str:
    a = np.abs(errors)
    return f"median |error| {np.median(a):.1%}, worst {a.max():.1%}"


def _describe(cal: Calibration) -> str:
    return (f"GEMM {cal.gemm('bf16'):.3f}, attention fwd {cal.attention_fwd_efficiency:.3f} / bwd "
            f"{cal.attention_bwd_efficiency:.3f} (causal work 0.5), memory bandwidth {cal.memory_bandwidth_efficiency:.3f}, "
            f"kernel floor {cal.kernel_floor_s * 1e6:.1f} us")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "cuda_check_h100_run*.json"))
    parser.add_argument("--gpu", default="H100-SXM-80GB")
    parser.add_argument("--write", action="store_true", help="write the fit as the shipped calibration of --gpu")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--max-spread", type=float, default=0.25,
                        help="fit only points whose runs agree within this share of their median (default 0.25)")
    args = parser.parse_args()
    paths = sorted(glob.glob(args.results))
    points, steps, device = load_points(paths)
    if not points:
        sys.exit(f"fit_measured_blocks: no block measurements in {args.results}")
    gpu = get_gpu(args.gpu)
    profiles = {m: _profile(m) for m in sorted({p["model"] for p in points})}
    base = default_calibration(gpu)
    # Points whose runs disagree by more than MAX_SPREAD (the small blocks: an embedding or a norm
    # timed alone is a few launches, and its runs differ by 50-180%) are shown, not fitted.
    steady = [p for p in points if p["spread"] <= args.max_spread]
    cal = fit(steady, profiles, base, gpu)
    errors = _errors(points, profiles, cal, gpu)
    print(f"{len(points)} points from {len(paths)} logs on {device}, {len(steady)} steady enough to fit; "
          f"fit: {_describe(cal)}")
    print(f"{'model':<24} {'mb':>2} {'block':<10} {'pass':<4} {'measured ms':>11} {'spread':>7} {'predicted':>9} {'error':>7} {'left out':>8}")
    held = np.zeros(len(points))
    for model in profiles:
        if not any(p["model"] != model for p in steady):
            continue
        keep = [p for p in steady if p["model"] != model]
        other = fit(keep, profiles, cal, gpu)
        idx = [i for i, p in enumerate(points) if p["model"] == model]
        held[idx] = _errors([points[i] for i in idx], profiles, other, gpu)
    predicted = predict(points, profiles, cal, gpu)
    for i, p in enumerate(points):
        print(f"{p['model']:<24} {p['batch']:>2} {p['block']:<10} {p['phase']:<4} {p['measured_s'] * 1e3:>11.3f} "
              f"{p['spread']:>7.0%} {predicted[i] * 1e3:>9.3f} {errors[i]:>+7.1%} {held[i]:>+8.1%}")
    layers = [i for i, p in enumerate(points) if p["block"].startswith("layers")]
    fitted = [i for i, p in enumerate(points) if p["spread"] <= args.max_spread]
    print(f"fitted points: in-sample {_summary(errors[fitted])}; leaving each model out {_summary(held[fitted])}")
    print(f"all blocks: in-sample {_summary(errors)}; leaving each model out {_summary(held)}")
    print(f"layers only: in-sample {_summary(errors[layers])}; leaving each model out {_summary(held[layers])}")
    if args.write:
        note = (f"fitted by `python benchmarks/fit_measured_blocks.py --write` to block times measured by this project "
                f"on an {device} (benchmarks/results/cuda_check_h100_run*.json, torch 2.11, "
                f"benchmarks/cuda_check.py); causal work fraction 0.5 assumed (FlashAttention-2)")
        cal = cal.replace(sources={**cal.sources, "file": f"{args.gpu}: fitted to block times measured by this project "
                                   f"on the GPU (benchmarks/fit_measured_blocks.py, {date.today()})",
                                   "gemm": note, "attention": note, "memory": note},
                          measurements={"points": points, "in_sample_median_abs_error": float(np.median(np.abs(errors))),
                                        "leave_one_model_out_median_abs_error": float(np.median(np.abs(held)))})
        path = ROOT / "autoplan" / "cost" / "calibrations" / f"{args.gpu}.json"
        path.write_text(json.dumps(cal.to_dict(), indent=2) + "\n")
        print(f"wrote {path}")
    if args.json:
        args.json.write_text(json.dumps({"calibration": cal.to_dict(), "points": points,
                                         "errors": errors.tolist(), "left_out": held.tolist()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
