"""`autoplan calibrate`'s fits: the measured points (calibrate_kernels.py) -> the shares and floors
`cost/ops.py` reads, with a summary row per fitted number and a note for each capped one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autoplan.calibrate.calibrate_kernels import TORCH_DTYPES, fmt_size
from autoplan.cluster import GPU
from autoplan.cost.calibration import Calibration
from autoplan.cost.ops import gemm_time_s


def _golden_min(f: Callable[[float], float], lo: float, hi: float, steps: int = 80) -> float:
    """Minimum of a unimodal f on [lo, hi] (golden-section search)."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    for _ in range(steps):
        if f(c) < f(d):
            b, d = d, c
            c = b - ratio * (b - a)
        else:
            a, c = c, d
            d = a + ratio * (b - a)
    return (a + b) / 2


def _fit_gemm(points: list[dict[str, Any]], base: Calibration, gpu: GPU, key: str) -> float:
    """The GEMM share of peak that makes `gemm_time_s` fit the sweep best: least squares on log
    time over every point. Log time weighs every shape by its relative error, as the planner's
    ranking does; fitting through `gemm_time_s` itself (traffic term and floor included, with the
    measured bandwidth and floor) keeps the share from absorbing the memory time of the skinny
    shapes, which a median of per-point shares would have to drop by a compute-bound cut-off.
    Unclamped: a share above 1 means the datasheet peak is below what this device did."""
    element_bytes = torch.tensor([], dtype=TORCH_DTYPES[key]).element_size()

    def loss(log_share: float) -> float:
        cal = base.replace(gemm_efficiency={key: math.exp(log_share)})
        return sum((math.log(gemm_time_s(cal, gpu, 1, p["m"], p["n"], p["k"], key, element_bytes))
                    - math.log(p["time_s"])) ** 2 for p in points)

    return math.exp(_golden_min(loss, math.log(1e-4), math.log(100.0)))


# [Note: unstable calibrations]
# Each point's time is the median of its repeats, and its spread (max - min) / median says how far
# they disagreed. One preempted repeat gives one point a large spread and leaves its median alone;
# but when a fitted number's points disagree by more than their median time *typically* (the median
# of their spreads over 100%), the medians themselves are the machine's other load: `autoplan
# calibrate` on a 2-core machine at a load of 70 wrote spreads up to 14,002% (issue 44), and the
# file would have priced every plan by that load. Such a fit is refused unless forced (--force);
# a worst point over NOISY_POINT_SPREAD is a note.
UNSTABLE_SPREAD = 1.0
"""A fitted number whose points' median spread exceeds this is refused without --force."""
NOISY_POINT_SPREAD = 0.5
"""A fitted number with a point spread over this gets a note (same threshold as a profile's noisy block)."""


def unstable_rows(rows: Sequence[dict[str, Any]], limit: float = UNSTABLE_SPREAD) -> list[dict[str, Any]]:
    """The summary rows whose points' median spread is over `limit` ([Note: unstable calibrations])."""
    return [row for row in rows if row.get("spread_median", 0.0) > limit]


def unstable_message(rows: Sequence[dict[str, Any]], limit: float = UNSTABLE_SPREAD) -> str:
    """The one-line refusal of a fit whose `rows` are unstable (`unstable_rows`)."""
    worst = sorted(rows, key=lambda r: -r["spread_median"])
    shown = ", ".join(f"{row['quantity']} {row['spread_median']:,.0%}" for row in worst[:3]) + (
        f" and {len(worst) - 3} more" if len(worst) > 3 else "")
    return (f"calibration not written: {len(rows)} fitted number{'s' if len(rows) != 1 else ''} rest on timings "
            f"whose median point's repeats disagree by more than {limit:.0%} ({shown}), so this machine was "
            f"busy; rerun `autoplan calibrate` on an idle machine, or pass --force to write it anyway")


def noisy_point_note(rows: Sequence[dict[str, Any]], threshold: float = NOISY_POINT_SPREAD) -> str | None:
    """A note naming the fitted numbers with a point spread over `threshold`, or None."""
    noisy = sorted((row for row in rows if row.get("spread_max", 0.0) > threshold), key=lambda r: -r["spread_max"])
    if not noisy:
        return None
    shown = ", ".join(f"{row['quantity']} {row['spread_max']:,.0%}" for row in noisy)
    return (f"noisy points: some repeats disagree by more than {threshold:.0%} ((max - min) / median; worst: {shown}); "
            f"each point is the median of its repeats, but an idle machine gives steadier numbers")


def spreads_of(points: Sequence[dict[str, Any]]) -> dict[str, float]:
    values = [p["spread"] for p in points]
    return {"points": len(values), "spread_median": statistics.median(values), "spread_max": max(values)}


def _clamp(name: str, value: float, notes: list[str], why: str) -> float:
    """Calibration shares live in (0, 1]; a measured share above 1 is kept in the record and capped."""
    if value > 1.0:
        notes.append(f"{name} measured {value:.3g} > 1 ({why}); capped at 1")
        return 1.0
    return value


def fit_calibration(gpu: GPU, keys: Sequence[str], gemm: list[dict], attention: list[dict], memory: list[dict],
         ) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """(fitted numbers, summary rows, notes) from the raw points."""
    notes: list[str] = []
    peak_why = ("the CPU peak is an estimate: set AUTOPLAN_CPU_GFLOPS_PER_CORE" if gpu.name == "cpu"
                else "the datasheet peak is below what was measured; check --gpu")
    rows: list[dict[str, Any]] = []

    # Memory: the largest kernels stream (bandwidth); the smallest are all launch and tail (floor).
    # Copies and adds alike: ops.py prices every memory-bound kernel by bytes moved.
    sizes = sorted({p["bytes"] for p in memory})
    large = [p for p in memory if p["bytes"] in sizes[-2:]]
    small = [p for p in memory if p["bytes"] == sizes[0]]
    bw_bytes_per_s = statistics.median(p["bw_bytes_per_s"] for p in large)
    bw_share_raw = bw_bytes_per_s / gpu.mem_bw_bytes_per_s
    bw_share = _clamp("memory bandwidth share", bw_share_raw, notes,
                      "the CPU bandwidth is an estimate, and small sizes stay in cache" if gpu.name == "cpu"
                      else "the datasheet bandwidth is below what was measured; check --gpu")
    floor_s = statistics.median(p["time_s"] for p in small)
    rows.append({"quantity": "memory bandwidth share", "value": bw_share,
                 "detail": f"{bw_bytes_per_s / 1e9:.1f} GB/s of {gpu.mem_bw_bytes_per_s / 1e9:g}; median of the "
                           f"{fmt_size(sizes[-2])}+ kernels", **spreads_of(large)})
    rows.append({"quantity": "kernel floor", "value": floor_s, "unit": "s",
                 "detail": f"median time of the {fmt_size(sizes[0])} kernels", **spreads_of(small)})

    base = Calibration(gpu=gpu.name, gemm_efficiency={keys[0]: 1.0}, attention_fwd_efficiency=1.0,
                       attention_bwd_efficiency=1.0, causal_work_fraction=1.0,
                       memory_bandwidth_efficiency=bw_share_raw, kernel_floor_s=floor_s)
    gemm_raw, gemm_share = {}, {}
    for key in keys:
        pts = [p for p in gemm if p["dtype"] == key]
        gemm_raw[key] = _fit_gemm(pts, base, gpu, key)
        gemm_share[key] = _clamp(f"GEMM share ({key})", gemm_raw[key], notes, peak_why)
        best = max(2 * p["m"] * p["n"] * p["k"] / p["time_s"] for p in pts)
        rows.append({"quantity": f"GEMM share ({key})", "value": gemm_share[key],
                     "detail": f"least squares on log time; best {best / 1e12:.2f} of "
                               f"{gpu.peak(key) / 1e12:.3g} TFLOP/s", **spreads_of(pts)})

    # Attention: the share from the full (non-causal) calls, whose work the FLOP count describes
    # exactly; the causal fraction is then how much of that time a causal call takes.
    peak = gpu.peak(keys[0])
    attention_raw: dict[str, float] = {}
    for phase in ("fwd", "bwd"):
        full = [p for p in attention if p["phase"] == phase and not p["causal"]]
        attention_raw[phase] = statistics.median(p["flops"] / (p["time_s"] * peak) for p in full)
        rows.append({"quantity": f"attention {phase} share", "value": 0.0,
                     "detail": "median over the non-causal shapes", **spreads_of(full)})
    shares = {phase: _clamp(f"attention {phase} share", attention_raw[phase], notes, peak_why)
              for phase in ("fwd", "bwd")}
    rows[-2]["value"], rows[-1]["value"] = shares["fwd"], shares["bwd"]
    ratios = []
    for p in attention:
        if p["causal"]:
            twin = next(q for q in attention if not q["causal"] and q["phase"] == p["phase"]
                        and all(q[f] == p[f] for f in ("batch", "heads", "seq", "head_dim")))
            ratios.append(p["time_s"] / twin["time_s"])
    causal_raw = statistics.median(ratios)
    causal = _clamp("causal work fraction", causal_raw, notes,
                    "this causal kernel takes longer than the full one: it masks rather than skips")
    rows.append({"quantity": "causal work fraction", "value": causal,
                 "detail": "median causal / non-causal time", **spreads_of([p for p in attention if p["causal"]])})

    fitted = {"gemm_efficiency": gemm_share, "attention_fwd_efficiency": shares["fwd"],
              "attention_bwd_efficiency": shares["bwd"], "causal_work_fraction": causal,
              "memory_bandwidth_efficiency": bw_share, "kernel_floor_s": floor_s,
              "unclamped": {"gemm_efficiency": gemm_raw, "attention_fwd_efficiency": attention_raw["fwd"],
                            "attention_bwd_efficiency": attention_raw["bwd"], "causal_work_fraction": causal_raw,
                            "memory_bandwidth_efficiency": bw_share_raw}}
    return fitted, rows, notes
