"""Measured step time of autoplan's cuts against two common cuttings, on 4 CPU ranks.

    python benchmarks/plan_quality_measured.py [--steps 5] [--json out.json]

A gpt with a 256k vocabulary on `1x4xcpu`, pp = 4, 1F1B. At h = 256 and s = 32 its head costs about
82 layers, so the model has 300 layers: with fewer than three times the head's cost in layers, the
head alone is the slowest stage and every sensible cutting ties (a 12-layer version measured
autoplan = parameter-balanced, equal layers 1.15x slower).
The same plan is run three times through the executor, changing only the stage boundaries:
autoplan's (the DP on a profile timed on this CPU), cuts that balance parameter counts (DeepSpeed's
`partition_method="parameters"`), and equal layer counts (DeepSpeed's `"uniform"`). Prints the three
median step times (after one warm-up step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile

MODEL = "gpt:num_layers=300,hidden_size=256,num_heads=4,vocab_size=256000,max_seq_len=32"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch

    from autoplan.api import suggest_with_stats
    from autoplan.cost.memory import param_counts
    from autoplan.runtime import run_plan
    from autoplan.search.partition import balanced_by, equal_layers

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["AUTOPLAN_CACHE_DIR"] = tmp
        result, profiled = suggest_with_stats(args.model, "1x4xcpu", global_batch=8, seq_len=32, dtype="fp32",
                                              profile_device="cpu", tp=1, pp=4, dp=1, micro_batch_size=2,
                                              schedule="1f1b", recompute="none", zero=0)
        plan = result.plans[0]
        from autoplan.cost.config import ParallelConfig

        cfg = ParallelConfig(tp=1, pp=4, dp=1, micro_batch_size=2, num_microbatches=4, schedule="1f1b")
        cuttings = {
            "autoplan": plan.boundaries,
            "parameters": balanced_by(param_counts(profiled.profile, cfg), 4),
            "equal layers": equal_layers(profiled.profile.num_blocks, 4),
        }
        for name, boundaries in cuttings.items():
            stages = tuple(dataclasses.replace(s, first_block=a, end_block=b, first_block_name=plan.block_names[a],
                                               last_block_name=plan.block_names[b - 1])
                           for s, a, b in zip(plan.stages, boundaries, boundaries[1:]))
            variant = dataclasses.replace(plan, stages=stages)
            path, metrics = f"{tmp}/{len(rows)}.json", f"{tmp}/{len(rows)}.jsonl"
            variant.save(path)
            if run_plan(path, steps=args.steps, nproc=4, metrics_path=metrics) != 0:
                return 1
            with open(metrics) as f:
                times = [json.loads(line)["step_time_s"] for line in f][1:]
            rows.append({"cuts": name, "boundaries": list(boundaries), "median_step_s": statistics.median(times)})
    base = rows[0]["median_step_s"]
    print(f"{'cuts':<14} {'boundaries':<24} {'median step':>12} {'vs autoplan':>12}")
    for r in rows:
        print(f"{r['cuts']:<14} {str(r['boundaries']):<24} {r['median_step_s']:>11.3f}s {r['median_step_s'] / base:>11.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
