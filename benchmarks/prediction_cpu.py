"""Predicted against measured step time on this CPU: a profile timed here, the `1x4xcpu` cluster, 4 ranks.

    python benchmarks/prediction_cpu.py [--rounds 3] [--steps 8] [--no-control] [--json out.json]

For `1f1b` and `gpipe` on 4 pipeline ranks: profile the model's blocks on this CPU with one thread
(what each of the 4 spawned ranks gets on a 2-core machine), plan it with every dimension pinned,
run the plan with `autoplan run` machinery (4 gloo processes), and compare the median measured step
time (after 2 warm-up steps) with the prediction. Target: within 15%.

Each round profiles afresh (a new cache), so a round is one independent prediction and
measurement. On a shared VM the machine's speed swings by 10-30% over minutes, which moves a round's
error as much as the model does. So each round also runs a control: the same model on 2 ranks of
`1x2xcpu` (one core each, no sharing: the part of the model that 4 ranks on 2 cores add is not
involved). When the control is off by much, the round measured the machine, not the prediction.
Every round is printed with its control; the summary gives, per schedule, the median error over
all rounds (the target is judged on this) and over the rounds whose control was within 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

MODEL = "gpt:num_layers=8,hidden_size=256,num_heads=4,vocab_size=2048,max_seq_len=128"
QUIET_CONTROL = 0.10  # a round whose no-sharing control is off by at most this counts as quiet


def _predict_and_measure(model: str, ranks: int, schedule: str, steps: int, tmp: str) -> dict:
    from autoplan.api import suggest_with_stats
    from autoplan.runtime import run_plan

    result, _ = suggest_with_stats(model, f"1x{ranks}xcpu", global_batch=16, seq_len=128, dtype="fp32",
                                   profile_device="cpu", tp=1, pp=ranks, dp=1, micro_batch_size=2,
                                   schedule=schedule, recompute="none", zero=0)
    plan = result.plans[0]
    plan_path, metrics_path = f"{tmp}/{ranks}-{schedule}.json", f"{tmp}/{ranks}-{schedule}.jsonl"
    plan.save(plan_path)
    code = run_plan(plan_path, steps=steps, nproc=ranks, metrics_path=metrics_path)
    if code != 0:
        raise SystemExit(f"run of {ranks}-rank {schedule} failed with exit code {code}")
    with open(metrics_path) as f:
        measured = statistics.median(json.loads(line)["step_time_s"] for line in list(f)[2:])
    predicted = plan.predicted.step_time_s
    return {"ranks": ranks, "schedule": schedule, "predicted_s": predicted, "measured_s": measured,
            "error": predicted / measured - 1, "cuts": list(plan.boundaries)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--no-control", action="store_true", help="skip the 2-rank no-sharing control runs")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first 2 are warm-up)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    import torch

    torch.set_num_threads(1)  # each of the 4 ranks runs with one thread on this 2-core machine
    rows = []
    for round_index in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["AUTOPLAN_CACHE_DIR"] = tmp  # a fresh profile each round, shared by its runs
            runs = [(4, "1f1b"), (4, "gpipe")] + ([] if args.no_control else [(2, "1f1b")])
            for ranks, schedule in runs:
                row = _predict_and_measure(args.model, ranks, schedule, args.steps, tmp)
                rows.append({"round": round_index, **row})
        by_run = {(r["ranks"], r["schedule"]): r for r in rows if r["round"] == round_index}
        control = by_run.get((2, "1f1b"))
        for (ranks, schedule), r in by_run.items():
            if ranks == 4:
                print(f"round {round_index}  {schedule:<6} cuts {r['cuts']}  predicted {r['predicted_s']:.3f} s  "
                      f"measured {r['measured_s']:.3f} s  error {r['error']:+.1%}"
                      + (f"  (control, 2 ranks unshared: {control['error']:+.1%})" if control else ""), flush=True)
    quiet_rounds = {r["round"] for r in rows if r["ranks"] == 2 and abs(r["error"]) <= QUIET_CONTROL}
    print(f"\n{'schedule':<8} {'median error':>12}   per round")
    for schedule in ("1f1b", "gpipe"):
        errors = [r["error"] for r in rows if r["ranks"] == 4 and r["schedule"] == schedule]
        print(f"{schedule:<8} {statistics.median(errors):>+12.1%}   {', '.join(f'{e:+.1%}' for e in errors)}")
    if not args.no_control:
        print(f"rounds whose control was within {QUIET_CONTROL:.0%}: {len(quiet_rounds)} of {args.rounds}")
        for schedule in ("1f1b", "gpipe"):
            errors = [r["error"] for r in rows if r["ranks"] == 4 and r["schedule"] == schedule and r["round"] in quiet_rounds]
            if errors:
                print(f"{schedule:<8} {statistics.median(errors):>+12.1%}   in those rounds")
    print("target: |median error over all rounds| <= 15%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
