"""How much longer each pipeline action runs on shared CPU cores than processor sharing says.

    python benchmarks/sharing_stretch_cpu.py [--rounds 2] [--steps 8] [--schedule 1f1b] [--ranks 4]

The cost model stretches a block timed alone by max(1, k T / C) while k ranks of T threads compute
on C cores (cost/sharing.py, processor sharing). This checks that assumption action by action on a
real run, apart from the rest of the model: profile the model on this CPU, run its 4-rank plan
(`--ranks 2` on a 2-core machine: a control without sharing) with a trace, and for every forward and backward after the 2 warm-up steps compare

- the measured stretch: the action's measured duration / its time in the profile, and
- the processor-sharing stretch max(1, k T / C), with k the mean number of ranks computing during
  the action *as measured in the trace* (not as simulated).

A median ratio of 1.0 means processor sharing describes the machine; above 1, actions run slower
than their share of the cores explains (context switches, caches shared by more working sets,
the machine's neighbours). Printed per band of concurrency, with the predicted and measured step.

On Linux it also reads /proc/stat over the measured steps (from the end of step 2 to the end of the
last) and prints the machine's busy cores, the CPU seconds used per step (of them in the kernel:
system and interrupts, e.g. gloo's loopback TCP) and the profiled compute per step (every stage's
forward and backward times its micro-batches). The model spends only the profiled compute (plus the
small optimizer and sync tails), so CPU seconds above it are work the model does not see.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

MODEL = "gpt:num_layers=8,hidden_size=256,num_heads=4,vocab_size=2048,max_seq_len=128"
BANDS = ((1.0, 1.0 + 1e-9), (1.0 + 1e-9, 1.5), (1.5, 1.8), (1.8, float("inf")))


def _ratios(trace: dict, plan, threads: float, cores: float, first_step: int) -> list[tuple[float, float]]:
    """(measured stretch, processor-sharing stretch) per compute action of the trace's later steps."""
    import numpy as np

    from autoplan.schedule import Action, ActionKind

    actions = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("args", {}).get("step", 0) < first_step:
            continue
        try:
            action = Action.parse(e["name"])
        except ValueError:
            continue  # the step's tail (TIED_GRAD_SYNC, OPTIMIZER, ...)
        if action.kind in (ActionKind.F, ActionKind.B):
            actions.append((action, float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    edges = np.array(sorted({t for _, start, end in actions for t in (start, end)}))
    computing = np.zeros(len(edges) - 1)
    for _, start, end in actions:
        lo, hi = np.searchsorted(edges, [start, end])
        computing[lo:hi] += 1
    widths = np.diff(edges)
    out = []
    for action, start, end in actions:
        lo, hi = np.searchsorted(edges, [start, end])
        span = widths[lo:hi].sum()
        if span <= 0:
            continue
        concurrency = float((computing[lo:hi] * widths[lo:hi]).sum() / span)
        stage = plan.stages[action.stage]
        alone_us = 1e6 * (stage.fwd_time_s if action.kind is ActionKind.F else stage.bwd_time_s)
        out.append(((end - start) / alone_us, max(1.0, concurrency * threads / cores)))
    return out


def _proc_stat() -> tuple[int, int, int] | None:
    """(all jiffies, idle + iowait jiffies, system + irq + softirq jiffies) from /proc/stat; None off Linux."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    return user + nice + system + idle + iowait + irq + softirq + steal, idle + iowait, system + irq + softirq


class _CpuWindow(threading.Thread):
    """Samples /proc/stat when the metrics file first holds `first` steps and when it holds `last`."""

    def __init__(self, metrics_path: str, first: int, last: int) -> None:
        super().__init__(daemon=True)
        self.metrics_path, self.first, self.last = metrics_path, first, last
        self.samples: dict[int, tuple[tuple[int, int, int] | None, float]] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                with open(self.metrics_path) as f:
                    lines = sum(1 for _ in f)
            except OSError:
                lines = 0
            for mark in (self.first, self.last):
                if lines >= mark and mark not in self.samples:
                    self.samples[mark] = (_proc_stat(), time.perf_counter())
            if self.last in self.samples:
                return
            time.sleep(0.005)

    def summary(self, cores: float) -> tuple[float, float, float] | None:
        """(busy cores, CPU seconds per step, of them in the kernel) between the two marks."""
        if self.first not in self.samples or self.last not in self.samples:
            return None
        (a, wall_a), (b, wall_b) = self.samples[self.first], self.samples[self.last]
        if a is None or b is None or b[0] <= a[0]:
            return None
        busy_fraction = 1 - (b[1] - a[1]) / (b[0] - a[0])
        kernel_fraction = (b[2] - a[2]) / (b[0] - a[0])
        per_step_s = (wall_b - wall_a) / (self.last - self.first)
        return cores * busy_fraction, cores * busy_fraction * per_step_s, cores * kernel_fraction * per_step_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--ranks", type=int, default=4, help="pipeline ranks on the 1xNxcpu cluster")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first 2 are warm-up)")
    import torch

    from autoplan.api import suggest_with_stats
    from autoplan.runtime import run_plan

    if args.ranks < 2:
        parser.error("--ranks must be at least 2 (a pipeline)")
    torch.set_num_threads(1)  # what each of 4 ranks gets on a 2-core machine
    cores = float(os.cpu_count() or 1)
    pairs: list[tuple[float, float]] = []
    for round_index in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["AUTOPLAN_CACHE_DIR"] = tmp
            result, profiled = suggest_with_stats(args.model, f"1x{args.ranks}xcpu", global_batch=16, seq_len=128,
                                                  dtype="fp32", profile_device="cpu", tp=1, pp=args.ranks, dp=1,
                                                  micro_batch_size=2,
                                                  schedule=args.schedule, recompute="none", zero=0)
            plan = result.plans[0]
            threads = float(profiled.profile.extra.get("threads") or 1)
            plan_path, trace_path, metrics_path = f"{tmp}/plan.json", f"{tmp}/trace.json", f"{tmp}/metrics.jsonl"
            plan.save(plan_path)
            window = _CpuWindow(metrics_path, first=2, last=args.steps)
            window.start()
            code = run_plan(plan_path, steps=args.steps, nproc=args.ranks, metrics_path=metrics_path,
                            trace_path=trace_path)
            window.done.set()
            window.join()
            if code != 0:
                print(f"run failed with exit code {code}", file=sys.stderr)
                return code
            with open(metrics_path) as f:
                measured = statistics.median(json.loads(line)["step_time_s"] for line in list(f)[2:])
            with open(trace_path) as f:
                round_pairs = _ratios(json.load(f), plan, threads, cores, first_step=2)
            pairs += round_pairs
            print(f"round {round_index}  cuts {list(plan.boundaries)}  predicted {plan.predicted.step_time_s:.3f} s  "
                  f"measured {measured:.3f} s  measured / sharing stretch, median "
                  f"{statistics.median(m / s for m, s in round_pairs):.3f}", flush=True)
            cpu = window.summary(cores)
            if cpu is not None:
                profiled_s = sum((st.fwd_time_s + st.bwd_time_s) * plan.num_microbatches for st in plan.stages)
                busy, cpu_s, kernel_s = cpu
                print(f"         busy cores {busy:.2f} of {cores:g}  CPU per step {cpu_s:.3f} s (kernel {kernel_s:.3f} s)  "
                      f"profiled compute per step {profiled_s:.3f} s  ratio {cpu_s / profiled_s:.2f}", flush=True)
    print(f"\n{'sharing stretch':<16} {'actions':>8} {'measured / sharing':>19}")
    for lo, hi in BANDS:
        band = [m / s for m, s in pairs if lo <= s < hi]
        if band:
            label = "1 (no sharing)" if hi - lo < 1e-6 else f"{lo:.2f}-{hi:.2f}"
            print(f"{label:<16} {len(band):>8} {statistics.median(band):>19.3f}")
    print(f"{'all':<16} {len(pairs):>8} {statistics.median(m / s for m, s in pairs):>19.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
