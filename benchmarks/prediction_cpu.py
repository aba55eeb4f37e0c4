"""Predicted against measured step time on this CPU: a profile timed here, the `1x4xcpu` cluster, 4 ranks.

    python benchmarks/prediction_cpu.py [--steps 8] [--json out.json]

For `1f1b` and `gpipe` on 4 pipeline ranks: profile the model's blocks on this CPU with one thread
(what each of the 4 spawned ranks gets on a 2-core machine), plan it with every dimension pinned,
run the plan with `autoplan run` machinery (4 gloo processes), and compare the median measured step
time (after 2 warm-up steps) with the prediction. Target: within 15%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

MODEL = "gpt:num_layers=8,hidden_size=256,num_heads=4,vocab_size=2048,max_seq_len=128"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch

    from autoplan.api import suggest_with_stats
    from autoplan.runtime import run_plan

    torch.set_num_threads(1)  # each of the 4 ranks runs with one thread on this 2-core machine
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["AUTOPLAN_CACHE_DIR"] = tmp
        for schedule in ("1f1b", "gpipe"):
            result, _ = suggest_with_stats(args.model, "1x4xcpu", global_batch=16, seq_len=128, dtype="fp32",
                                           profile_device="cpu", tp=1, pp=4, dp=1, micro_batch_size=2,
                                           schedule=schedule, recompute="none", zero=0)
            plan = result.plans[0]
            plan_path, metrics_path = f"{tmp}/{schedule}.json", f"{tmp}/{schedule}.jsonl"
            plan.save(plan_path)
            code = run_plan(plan_path, steps=args.steps, nproc=4, metrics_path=metrics_path)
            if code != 0:
                print(f"run failed with exit code {code}", file=sys.stderr)
                return code
            with open(metrics_path) as f:
                steps = [json.loads(line) for line in f]
            measured = statistics.median(s["step_time_s"] for s in steps[2:])
            predicted = plan.predicted.step_time_s
            rows.append({"schedule": schedule, "predicted_s": predicted, "measured_s": measured,
                         "error": predicted / measured - 1, "cuts": list(plan.boundaries)})
    print(f"{'schedule':<8} {'predicted':>10} {'measured':>10} {'error':>8}")
    for r in rows:
        print(f"{r['schedule']:<8} {r['predicted_s']:>9.3f}s {r['measured_s']:>9.3f}s {r['error']:>+8.1%}")
    print("target: |error| <= 15%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
