"""How much a timed CPU profile varies from one profiling to the next on this machine.

    python benchmarks/profile_noise_cpu.py [--rounds 6] [--model SPEC] [--repeats 5,20]

Profiles the model on this CPU (one thread, a fresh cache each time) `--rounds` times for each
repeat count in `--repeats` (the number of timed runs whose median is each block's time),
alternating so that every count sees the same machine. Prints each profile's summed block time
and, per repeat count, the coefficient of variation (std / mean) of that sum across profiles, the
median of the blocks' own variations, and the seconds one profile took.

What it tells: if more repeats do not lower the variation, the profile's noise is the machine's
speed changing over seconds to minutes (a shared VM's neighbours), which no number of repeats
within one block's timing can average out; a prediction from such a profile inherits it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

MODEL = "gpt:num_layers=8,hidden_size=256,num_heads=4,vocab_size=2048,max_seq_len=128"


def _cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.mean(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--repeats", default="5,20", help="comma-separated repeat counts to compare")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 to measure a variation")
    try:
        counts = [int(x) for x in args.repeats.split(",")]
    except ValueError:
        parser.error(f"--repeats {args.repeats!r} must be comma-separated integers, e.g. 5,20")
    import torch

    from autoplan import models as zoo
    from autoplan.graph.profile import profile_model

    torch.set_num_threads(1)  # as each of 4 ranks on a 2-core machine runs
    spec = zoo.parse_model_spec(args.model)
    model = zoo.build_model(spec, device="meta")
    inputs = zoo.example_inputs(spec, args.batch_size, args.seq_len, device="meta")
    targets = zoo.example_targets(spec, args.batch_size, args.seq_len, device="meta")
    blocks: dict[int, list[list[float]]] = {n: [] for n in counts}
    seconds: dict[int, list[float]] = {n: [] for n in counts}
    for round_index in range(args.rounds):
        for repeats in counts:
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                prof, _ = profile_model(model, inputs, loss_fn=zoo.lm_loss, example_target=targets,
                                        model_name=spec.name, dtype=torch.float32, device="cpu",
                                        repeats=repeats, cache_dir=tmp)
                seconds[repeats].append(time.perf_counter() - t0)
            times = [b.fwd_time_s + b.bwd_time_s for b in prof.blocks]
            blocks[repeats].append(times)
            print(f"round {round_index}  {repeats:>3} repeats  blocks sum {sum(times) * 1e3:8.1f} ms  "
                  f"(profiled in {seconds[repeats][-1]:.1f} s)", flush=True)
    print(f"\n{'repeats':>7} {'sum cv':>8} {'block cv':>9} {'s/profile':>10}")
    for repeats in counts:
        sums = [sum(t) for t in blocks[repeats]]
        block_cv = statistics.median(_cv(list(col)) for col in zip(*blocks[repeats]))
        print(f"{repeats:>7} {_cv(sums):>8.1%} {block_cv:>9.1%} {statistics.median(seconds[repeats]):>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
