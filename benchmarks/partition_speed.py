"""Stage-cutting speed: the DP (search workhorse) beside the ILP (certificate), on the same problems.

    python benchmarks/partition_speed.py [--json out.json]

Prints one row per (n, S): median wall time of ``solve_dp`` and ``solve_ilp`` and whether their
bottlenecks agree. The ILP is only run where it finishes in seconds (n=40, S=8 by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from autoplan.search.ilp import solve_ilp
from autoplan.search.partition import solve_dp
from autoplan.search.stage_model import CutProblem


def llama_like(num_blocks: int, num_stages: int, seed: int = 0) -> CutProblem:
    """An embedding, num_blocks-2 similar layers with jitter, and a heavy head; 1F1B in-flight."""
    rng = np.random.default_rng(seed)
    time_s = 1e-3 * (1.0 + 0.05 * rng.standard_normal(num_blocks))
    time_s[0], time_s[-1] = 0.2e-3, 4e-3
    static = np.full(num_blocks, 3.2e9)
    static[0] = static[-1] = 8e9
    act = np.full(num_blocks, 0.1e9)
    inflight = np.arange(num_stages, 0, -1, dtype=np.float64)
    return CutProblem(
        block_time_s=time_s,
        cut_time_s=np.r_[0.0, np.full(num_blocks - 1, 5e-5), 0.0],
        block_static_bytes=static,
        block_act_bytes=act,
        inflight=inflight,
        capacity_bytes=np.full(num_stages, 80e9),
    )


def timed(fn, repeats: int) -> tuple[float, object]:
    samples, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows as JSON to this path")
    args = parser.parse_args()
    rows = []
    for n, s, run_ilp in [(130, 64, False), (130, 8, False), (40, 8, True)]:
        problem = llama_like(n, s)
        dp_s, dp = timed(lambda p=problem: solve_dp(p), repeats=20)
        row = {"n": n, "S": s, "dp_ms": dp_s * 1e3, "dp_bottleneck_ms": dp.bottleneck_s * 1e3}
        if run_ilp:
            ilp_s, ilp = timed(lambda p=problem: solve_ilp(p, time_limit_s=60), repeats=3)
            row |= {
                "ilp_ms": ilp_s * 1e3,
                "ilp_bottleneck_ms": ilp.bottleneck_s * 1e3,
                "ilp_optimal": ilp.optimal,
                "ilp_over_dp_time": ilp_s / dp_s,
            }
        rows.append(row)
    print(
        f"{'n':>4} {'S':>4} {'DP ms':>9} {'ILP ms':>9} {'ILP/DP':>8} {'DP bottleneck ms':>17} {'ILP bottleneck ms':>18} {'certified':>9}"
    )
    for r in rows:
        ilp_ms = f"{r['ilp_ms']:9.1f}" if "ilp_ms" in r else f"{'-':>9}"
        ratio = f"{r['ilp_over_dp_time']:8.0f}" if "ilp_ms" in r else f"{'-':>8}"
        ilp_b = f"{r['ilp_bottleneck_ms']:18.6f}" if "ilp_ms" in r else f"{'-':>18}"
        cert = str(r.get("ilp_optimal", "-"))
        print(
            f"{r['n']:>4} {r['S']:>4} {r['dp_ms']:9.2f} {ilp_ms} {ratio} {r['dp_bottleneck_ms']:17.6f} {ilp_b} {cert:>9}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
