"""Measured step time of autoplan's cuts against two common cuttings, on CPU ranks.

    python benchmarks/plan_quality_measured.py [--ranks 4] [--rounds 3] [--steps 4] [--json out.json]
        [--trace-dir DIR]

A gpt with a 256k vocabulary on `1xNxcpu`, pp = N (4 by default), 1F1B. At h = 256 and s = 32 its
head costs about 82 layers, so the model has 300 layers: with fewer than three times the head's cost
in layers, the head alone is the slowest stage and every sensible cutting ties.
The same plan is run through the executor with three sets of stage boundaries: autoplan's (the DP on
a profile timed on this CPU), cuts that balance parameter counts (DeepSpeed's
`partition_method="parameters"`), and equal layer counts (DeepSpeed's `"uniform"`). The three run
in alternating rounds (A B C A B C ...), so drift of the machine hits all alike; each round's
median step (after one warm-up step) is kept, and the table shows the median over rounds.

On this 2-core machine, 4 ranks share 2 cores: a rank that waits for its neighbour frees its core for
the others (processor sharing), so the step is bound by total work more than by the slowest stage,
and cuttings differ less than on devices of their own. `--ranks 2` gives each rank a core.
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
    parser.add_argument("--ranks", type=int, default=4, help="pipeline ranks (processes), pp = ranks")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--json")
    parser.add_argument("--trace-dir", help="write each run's Chrome trace (actions, gradient syncs, optimizer) here")
    args = parser.parse_args()
    import torch

    from autoplan.api import suggest_with_stats
    from autoplan.cluster import parse_cluster
    from autoplan.cost.config import ParallelConfig
    from autoplan.cost.memory import param_counts
    from autoplan.runtime import run_plan
    from autoplan.search.baselines import balanced_by, equal_layers
    from autoplan.search.context import SearchContext
    from autoplan.search.evaluate import evaluate_cuts

    pp = args.ranks
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // pp))  # what each rank gets when run
    samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["AUTOPLAN_CACHE_DIR"] = tmp
        result, profiled = suggest_with_stats(args.model, f"1x{pp}xcpu", global_batch=8, seq_len=32, dtype="fp32",
                                              profile_device="cpu", tp=1, pp=pp, dp=1, micro_batch_size=2,
                                              schedule="1f1b", recompute="none", zero=0)
        plan = result.plans[0]
        cfg = ParallelConfig(tp=1, pp=pp, dp=1, micro_batch_size=2, num_microbatches=4, schedule="1f1b")
        cuttings = {
            "autoplan": plan.boundaries,
            "parameters": balanced_by(param_counts(profiled.profile, cfg), pp),
            "equal layers": equal_layers(profiled.profile.num_blocks, pp),
        }
        ctx = SearchContext(profiled.profile, parse_cluster(f"1x{pp}xcpu"), plan.job, args.model)
        predicted = {name: evaluate_cuts(ctx, cfg, b).predicted.step_time_s for name, b in cuttings.items()}
        paths = {}
        for name, boundaries in cuttings.items():
            stages = tuple(dataclasses.replace(s, first_block=a, end_block=b, first_block_name=plan.block_names[a],
                                               last_block_name=plan.block_names[b - 1])
                           for s, a, b in zip(plan.stages, boundaries, boundaries[1:]))
            paths[name] = f"{tmp}/{len(paths)}.json"
            dataclasses.replace(plan, stages=stages).save(paths[name])
        for round_index in range(args.rounds):
            for name, path in paths.items():
                metrics = f"{tmp}/{name}-{round_index}.jsonl"
                trace = None
                if args.trace_dir:
                    os.makedirs(args.trace_dir, exist_ok=True)
                    trace = os.path.join(args.trace_dir, f"{name.replace(' ', '_')}-{round_index}.json")
                if run_plan(path, steps=args.steps, nproc=pp, metrics_path=metrics, trace_path=trace) != 0:
                    return 1
                with open(metrics) as f:
                    times = [json.loads(line)["step_time_s"] for line in f][1:]
                samples.setdefault(name, []).append(statistics.median(times))
            print(f"round {round_index + 1}/{args.rounds}: "
                  + ", ".join(f"{name} {samples[name][-1]:.3f}s" for name in paths), flush=True)
    rows = [{"cuts": name, "boundaries": list(cuttings[name]), "round_medians_s": samples[name],
             "median_step_s": statistics.median(samples[name]), "predicted_step_s": predicted[name]}
            for name in cuttings]
    base = rows[0]["median_step_s"]
    print(f"{pp} ranks, {args.rounds} alternating rounds of {args.steps} steps")
    print(f"{'cuts':<14} {'boundaries':<28} {'median step':>12} {'vs autoplan':>12} {'predicted':>10}  rounds")
    for r in rows:
        rounds = " ".join(f"{t:.3f}" for t in r["round_medians_s"])
        print(f"{r['cuts']:<14} {str(r['boundaries']):<28} {r['median_step_s']:>11.3f}s "
              f"{r['median_step_s'] / base:>11.2f}x {r['predicted_step_s']:>9.3f}s  {rounds}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
