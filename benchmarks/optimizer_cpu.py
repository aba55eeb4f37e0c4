"""AdamW step on CPU: torch's default (per-tensor loop) against `fused=True`, as `autoplan run` uses.

    python benchmarks/optimizer_cpu.py [--params 65536000] [--threads 1]

One parameter tensor the size of a 256k x 256 vocabulary (the head of the plan-quality benchmark's
gpt); prints each step's median time, the effective memory bandwidth at 28 bytes per parameter (the
cost model's Adam traffic, cost/time.py) and the ratio. The fused step is what the cost model's
memory-bound estimate describes; the loop makes several passes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def _step_s(num_params: int, fused: bool, repeats: int = 5) -> float:
    p = torch.nn.Parameter(torch.randn(num_params))
    p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW([p], lr=1e-3, fused=fused)
    optimizer.step()  # creates the state
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=256000 * 256)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = {name: _step_s(args.params, fused) for name, fused in (("default", False), ("fused", True))}
    for name, seconds in rows.items():
        print(f"{name:<8} {seconds:.3f} s  {args.params * 28 / seconds / 1e9:.1f} GB/s at 28 B/param")
    print(f"default / fused: {rows['default'] / rows['fused']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
