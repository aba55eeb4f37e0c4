"""Stage balance: autoplan's cuts against the exact optimum and two common baselines.

    python benchmarks/balance.py [--json out.json]

A 48-layer gpt (h=4096) with a 256k vocabulary, whose head alone costs about 4.8 layers, cut into 4 and 8
pipeline stages. (With fewer layers the head becomes the slowest stage by itself and every cutting ties.)
For each, the slowest stage's predicted time per micro-batch (forward + backward) with
- autoplan's DP cuts (what `suggest` uses),
- the exact optimum of the same problem (ILP with PuLP/CBC),
- cuts that balance parameter counts (DeepSpeed's `partition_method="parameters"`),
- cuts with equal layer counts (DeepSpeed's `"uniform"`; embedding on the first stage, head on the last).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

MODEL = "gpt:num_layers=48,hidden_size=4096,num_heads=32,vocab_size=256000,max_seq_len=2048"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    import autoplan
    from autoplan.cluster import parse_cluster
    from autoplan.cost.config import ParallelConfig
    from autoplan.cost.memory import param_counts
    from autoplan.plan import Job
    from autoplan.search.baselines import balanced_by, equal_layers
    from autoplan.search.context import SearchContext
    from autoplan.search.ilp import solve_ilp
    from autoplan.search.partition import solve_dp
    from autoplan.search.stage_model import CutProblem, stage_stats

    profile = autoplan.profile(MODEL, batch_size=1, seq_len=2048)
    cluster = parse_cluster("1x8xA100-80GB")
    ctx = SearchContext(profile, cluster, Job(global_batch=64, seq_len=2048), MODEL)
    rows = []
    print(f"{'stages':>6} {'autoplan':>10} {'optimum':>10} {'params':>10} {'equal':>10}   (slowest stage, ms per micro-batch)")
    for stages in (4, 8):
        cfg = ParallelConfig(tp=1, pp=stages, dp=8 // stages, micro_batch_size=1, num_microbatches=32, schedule="1f1b")
        problem = CutProblem(block_time_s=ctx.block_times(cluster.gpu, cfg).total_s, cut_time_s=ctx.link_times(cfg),
                             block_static_bytes=ctx.static_bytes(cfg), block_act_bytes=ctx.act_bytes(cfg),
                             inflight=np.array([stages - s for s in range(stages)], dtype=float),
                             capacity_bytes=np.full(stages, np.inf))
        ours = solve_dp(problem)
        exact = solve_ilp(problem, time_limit_s=120)
        by_params = balanced_by(param_counts(profile, cfg), stages)
        by_layers = equal_layers(profile.num_blocks, stages)
        params_s = float(stage_stats(problem, by_params)[0].max())
        layers_s = float(stage_stats(problem, by_layers)[0].max())
        row = {"stages": stages, "autoplan_s": ours.bottleneck_s, "optimum_s": exact.bottleneck_s,
               "optimum_proven": exact.optimal, "params_balanced_s": params_s, "equal_layers_s": layers_s,
               "autoplan_cuts": ours.boundaries, "params_cuts": by_params, "equal_cuts": by_layers}
        rows.append(row)
        print(f"{stages:>6} {ours.bottleneck_s * 1e3:>10.2f} {exact.bottleneck_s * 1e3:>10.2f} {params_s * 1e3:>10.2f} "
              f"{layers_s * 1e3:>10.2f}   autoplan/optimum {ours.bottleneck_s / exact.bottleneck_s:.4f}, "
              f"params/autoplan {params_s / ours.bottleneck_s:.3f}, equal/autoplan {layers_s / ours.bottleneck_s:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2, default=list)
    return 0


if __name__ == "__main__":
    sys.exit(main())
