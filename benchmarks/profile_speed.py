"""How fast and how lean analytic profiling is: llama3-405b at batch 1, sequence 8192, on fake tensors.

    python benchmarks/profile_speed.py [--model SPEC] [--seq-len N] [--json out.json]

Prints the wall time (after `import autoplan`) and the process's peak resident memory; the targets
are 30 s and 3 GiB on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-405b")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--json")
    args = parser.parse_args()
    import autoplan

    started = time.perf_counter()
    profile = autoplan.profile(args.model, batch_size=1, seq_len=args.seq_len)
    seconds = time.perf_counter() - started
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux reports KiB
    print(f"{args.model} (batch 1, seq {args.seq_len}): {profile.num_blocks} blocks, {profile.num_params / 1e9:.1f}B "
          f"parameters, {profile.flops / 1e15:.1f} PFLOP per sequence")
    print(f"profile time {seconds:.1f} s (target < 30 s), peak resident memory {peak_gib:.2f} GiB (target < 3 GiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "seq_len": args.seq_len, "time_s": seconds, "peak_rss_gib": peak_gib}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
