"""How fast `autoplan.suggest` answers, tracing and profiling included (timed after `import autoplan`).

    python benchmarks/search_speed.py [--json out.json]

Cases: gpt3-175b on 128 x 8 A100-80GB (global batch 1536, seq 2048; target 2 s on a 2-core machine),
and a 16k-GPU case, llama3-405b on 2048 x 8 H100-80GB (global batch 2048, seq 8192).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

CASES = [
    ("gpt3-175b", "128x8xA100-80GB", 1536, 2048),
    ("llama3-405b", "2048x8xH100-80GB", 2048, 8192),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    import autoplan
    from autoplan.api import suggest_with_stats

    rows = []
    print(f"{'model':<12} {'cluster':<18} {'GPUs':>6} {'total s':>8} {'search s':>9} {'evaluated':>9} {'configs/s':>9}  best plan")
    for model, cluster, batch, seq in CASES:
        started = time.perf_counter()
        result, _ = suggest_with_stats(model, cluster, global_batch=batch, seq_len=seq, top=5)
        total = time.perf_counter() - started
        best = result.plans[0]
        rate = result.configs_evaluated / result.time_s
        label = f"tp{best.tp} pp{best.pp} dp{best.dp} {best.schedule} mfu {best.predicted.mfu:.1%}"
        print(f"{model:<12} {cluster:<18} {best.num_gpus:>6} {total:>8.2f} {result.time_s:>9.2f} "
              f"{result.configs_evaluated:>9} {rate:>9.0f}  {label}")
        rows.append({"model": model, "cluster": cluster, "total_s": total, "search_s": result.time_s,
                     "configs_evaluated": result.configs_evaluated, "configs_per_s": rate})
    print("target: gpt3-175b on 1024 GPUs within 2 s, profiling included")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    del autoplan
    return 0


if __name__ == "__main__":
    sys.exit(main())
