"""The host's own time per operator in eager PyTorch, on this machine: a check beside the
Megatron-Core stacks' fitted `host_sync_kernel_s` (autoplan/published.py [Note: Megatron-Core's MoE
stack]), which says how long the host takes to issue each kernel of a mixture-of-experts layer once it
has waited on the device.

    python benchmarks/host_per_kernel_cpu.py [--repeats 50] [--threads 1]

Runs one layer of the zoo's dropless mixture of experts (the same code a Qwen3-style layer runs, at a
width where every operator's arithmetic is negligible: hidden 32, 8 tokens) forward and backward,
counts the ATen operators it dispatches (a TorchDispatchMode), and prints the host's time per operator
that launches a kernel: the median over repeats of the step divided by the operators that are not
views (views launch nothing, graph/operators.py; their host work is counted in the step).
That is a floor for the host's time per kernel on a GPU, which adds the launch itself (cudaLaunchKernel,
a few microseconds) and, in Megatron-Core, its Python modules, autograd functions and Transformer
Engine wrappers around each kernel. It is a check on the fitted figure's scale, not a fit: the host of
the published runs is not this machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan import models as zoo

SPEC = ("moe:num_layers=1,hidden_size=32,num_heads=4,num_kv_heads=2,ffn_hidden_size=16,vocab_size=64,"
        "max_seq_len=8,num_experts=16,experts_per_token=4,dropless=true")


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        self.views += bool(getattr(func, "is_view", False))
        return func(*args, **(kwargs or {}))


def _layer_step(layer: torch.nn.Module, x: torch.Tensor) -> None:
    out = layer(x)
    out.float().sum().backward()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = zoo.build_model(SPEC, device="cpu")
    layer = model.layers[0]
    x = torch.randn(1, 8, 32, requires_grad=True)
    for _ in range(5):  # warm-up: allocator, dispatcher caches
        _layer_step(layer, x)
    counting = _Counting()
    with counting:
        _layer_step(layer, x)
    samples = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        _layer_step(layer, x)
        samples.append(time.perf_counter() - start)
    step = statistics.median(samples)
    spread = (max(samples) - min(samples)) / step
    kernels = counting.calls - counting.views
    print(f"one dropless MoE layer, forward and backward: {counting.calls} ATen operators dispatched, "
          f"{kernels} of them not views")
    print(f"median step {step * 1e6:.0f} us over {args.repeats} repeats (spread {spread:.0%}), "
          f"{args.threads} thread(s), torch {torch.__version__}")
    print(f"host time per kernel-launching operator here: {step / kernels * 1e6:.1f} us "
          f"(the Megatron-Core stacks' fitted host_sync_kernel_s: see autoplan/cost/calibrations/H100-SXM-80GB.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
