"""Whether this CPU runs bf16 / fp16 GEMMs natively: each of a linear layer's three GEMMs (forward,
input gradient, weight gradient) in fp32 and in half precision, side by side, with the ratio.

    python benchmarks/cpu_half_precision.py

On a CPU without AVX512-BF16 or AMX, half-precision GEMMs go through a conversion path many times
slower than fp32, and `autoplan profile --device cpu` times blocks in fp32 instead
(graph/timing.py `timing_dtype`). The shapes are one gpt2-small MLP projection at 1,024 tokens.
"""

from __future__ import annotations

import statistics
import time

import torch

TOKENS, HIDDEN, FFN = 1024, 768, 3072


def _median_s(gemm, operands, repeats: int = 3) -> float:
    gemm(*operands)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        gemm(*operands)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    print(f"AVX512-BF16 {torch.cpu._is_avx512_bf16_supported()}, AMX tiles {torch.cpu._is_amx_tile_supported()}, "
          f"AMX fp16 {torch.cpu._is_amx_fp16_supported()}, {torch.get_num_threads()} threads")
    print(f"{'GEMM':<34}{'fp32 ms':>9}{'bf16 ms':>10}{'ratio':>8}{'fp16 ms':>10}{'ratio':>8}")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=generator)
    w = torch.randn(FFN, HIDDEN, generator=generator)
    g = torch.randn(TOKENS, FFN, generator=generator)
    gemms = {"forward x @ w.T": lambda x, w, g: x @ w.t(),
             "input gradient g @ w": lambda x, w, g: g @ w,
             "weight gradient g.T @ x": lambda x, w, g: g.t() @ x}
    for name, gemm in gemms.items():
        fp32 = _median_s(gemm, (x, w, g))
        row = f"{name:<34}{fp32 * 1e3:>9.1f}"
        for dtype in (torch.bfloat16, torch.float16):
            half = _median_s(gemm, tuple(t.to(dtype) for t in (x, w, g)))
            row += f"{half * 1e3:>10.1f}{half / fp32:>7.1f}x"
        print(row)


if __name__ == "__main__":
    main()
