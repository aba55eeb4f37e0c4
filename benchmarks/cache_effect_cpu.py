"""How much a warm cache flatters a small block's isolated timing on this CPU (one thread).

    python benchmarks/cache_effect_cpu.py

Times forward + backward of one h = 256 gpt layer (3 MB of weights: fits in the last-level cache when
timed alone) and of a 256k-vocabulary head (262 MB: never fits), each with the cache warm and after
writing a 256 MB buffer (the cache flushed, as for a layer deep in a pipeline stage whose other layers
evicted its weights). Prints both and the head's cost in layers: the profile's timing (warm) makes the
head look that many layers heavy. One reason measured plan quality on 4 CPU ranks lags
(docs/status.md).
"""

from __future__ import annotations

import statistics
import time

import torch

MODEL = "gpt:num_layers=2,hidden_size=256,num_heads=4,vocab_size=256000,max_seq_len=32"


def _median_s(fn, flush: torch.Tensor | None, repeats: int = 7, warmup: int = 2) -> float:
    samples = []
    for _ in range(repeats):
        if flush is not None:
            flush.zero_()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[warmup:])


def main() -> int:
    from autoplan import models as zoo

    torch.set_num_threads(1)
    model = zoo.build_model(MODEL, device="cpu", seed=0)
    x = torch.randn(2, 32, 256, requires_grad=True)
    flush = torch.empty(64 * 2**20)  # 256 MB, larger than any last-level cache here

    def layer() -> None:
        model.layers[0](x).sum().backward()

    def head() -> None:
        model.output(x).sum().backward()

    print(f"{'cache':<8} {'layer ms':>9} {'head ms':>9} {'head / layer':>13}")
    for name, buffer in (("warm", None), ("flushed", flush)):
        layer_s, head_s = _median_s(layer, buffer), _median_s(head, buffer)
        print(f"{name:<8} {1e3 * layer_s:>9.2f} {1e3 * head_s:>9.2f} {head_s / layer_s:>13.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
