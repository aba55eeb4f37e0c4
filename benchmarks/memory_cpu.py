"""What torch allocates for a forward and backward on CPU, beside autoplan's memory terms.

    python benchmarks/memory_cpu.py [--json benchmarks/results/memory_cpu.json]

For a few zoo models made small (2 layers), one micro-batch is run forward and backward on the CPU
with `lm_loss`, and every storage an op allocates is tracked while it lives (a TorchDispatchMode
registers each output's storage; a weakref finalizer subtracts it when torch frees it; the storages
of parameters and buffers, model state that ops may return views of, are not counted). Measured:

- saved: bytes autograd saves for backward (`saved_tensors_hooks`, each storage once, parameters and
  buffers excluded), what the profile's `Block.saved_bytes` claims to count (there on fake tensors);
- after forward: bytes alive once the loss is computed, less the gradients (the activations, as the
  allocator holds them);
- peak: the most bytes alive at once during forward and backward of the second step, when the
  parameter gradients from the first are allocated (accumulation, as in every step after the first).

Predicted, from `autoplan.profile` (analytic, meta) and cost/memory.py at tp = pp = dp = 1 and one
micro-batch in flight: the profile's saved bytes, the activation term, and activations + buffers
(backward transients) + one gradient per parameter in the model's dtype (plain autograd here, not
the runtime's fp32 master gradients). Ratios are predicted / measured: >= 1 means not under-predicted.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from autoplan.calibrate.measure import LiveBytes, storage_key

CASES = [  # (spec, batch, seq)
    ("gpt:num_layers=2,hidden_size=256,num_heads=4,vocab_size=4096,max_seq_len=512", 2, 512),
    ("gpt3-1.3b:num_layers=2,hidden_size=512,num_heads=8", 2, 512),
    ("gpt2-small:num_layers=2", 2, 512),
    ("llama3-8b:num_layers=2,hidden_size=512,num_heads=8,num_kv_heads=2,ffn_hidden_size=1536,vocab_size=16384", 2, 512),
    ("llama2-7b:num_layers=2,hidden_size=512,num_heads=8,num_kv_heads=8,ffn_hidden_size=1376", 2, 512),
]
DTYPES = ("float32", "bfloat16")


def measure(spec: str, batch: int, seq: int, dtype: torch.dtype) -> dict:
    from autoplan.models import build_model, example_inputs, example_targets, lm_loss

    model = build_model(spec, device="cpu", dtype=dtype)
    (ids,) = example_inputs(spec, batch_size=batch, seq_len=seq, device="cpu")
    targets = example_targets(spec, batch_size=batch, seq_len=seq, device="cpu")
    state = {storage_key(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t.untyped_storage())
        if key not in state:
            saved[key] = t.untyped_storage().nbytes()
        return t

    tracker = LiveBytes(state)
    with tracker:
        lm_loss(model(ids), targets).backward()  # allocates the gradients, as a first step does
        before = tracker.peak = tracker.current
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = lm_loss(model(ids), targets)
        after_forward = tracker.current - before
        loss.backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return {"saved_bytes": sum(saved.values()), "after_forward_bytes": after_forward, "peak_bytes": tracker.peak,
            "param_grad_bytes": grads}


def predict(spec: str, batch: int, seq: int, dtype: str) -> dict:
    import autoplan
    from autoplan.cluster import parse_cluster
    from autoplan.cost.config import ParallelConfig
    from autoplan.cost.memory import held_params, rank_memory

    profile = autoplan.profile(spec, batch_size=batch, seq_len=seq, dtype=dtype)
    cfg = ParallelConfig(tp=1, pp=1, dp=1, micro_batch_size=batch, num_microbatches=1, schedule="1f1b")
    gpu = parse_cluster("1x1xH100-SXM-80GB").gpu_types[0]
    n = profile.num_blocks
    memory = rank_memory(profile, cfg, gpu, dtype, [(0, n)], [1])
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    grads = held_params(profile, cfg, [(0, n)]) * itemsize
    return {"saved_bytes": sum(b.saved_bytes for b in profile.blocks),
            "activations_bytes": memory.activations_bytes, "buffers_bytes": memory.buffers_bytes,
            "peak_bytes": memory.activations_bytes + memory.buffers_bytes + grads,
            "per_block_saved_bytes": {b.name: b.saved_bytes for b in profile.blocks}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="benchmarks/results/memory_cpu.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    mib = 2**20
    print(f"torch {torch.__version__}, {platform.machine()}; MiB, predicted / measured")
    print(f"{'model':<44} {'dtype':<8} {'saved meas':>10} {'pred':>8} {'ratio':>5}  {'acts meas':>9} {'pred':>8} "
          f"{'ratio':>5}  {'peak meas':>9} {'pred':>8} {'ratio':>5}")
    for spec, batch, seq in CASES:
        for dtype in DTYPES:
            measured = measure(spec, batch, seq, getattr(torch, dtype))
            predicted = predict(spec, batch, seq, dtype)
            row = {"spec": spec, "batch": batch, "seq": seq, "dtype": dtype, "measured": measured,
                   "predicted": predicted,
                   "saved_ratio": predicted["saved_bytes"] / measured["saved_bytes"],
                   "activations_ratio": predicted["activations_bytes"] / measured["after_forward_bytes"],
                   "peak_ratio": predicted["peak_bytes"] / measured["peak_bytes"]}
            rows.append(row)
            short = spec if len(spec) <= 44 else spec[:41] + "..."
            print(f"{short:<44} {dtype:<8} {measured['saved_bytes'] / mib:10.1f} {predicted['saved_bytes'] / mib:8.1f} "
                  f"{row['saved_ratio']:5.2f}  {measured['after_forward_bytes'] / mib:9.1f} "
                  f"{predicted['activations_bytes'] / mib:8.1f} {row['activations_ratio']:5.2f}  "
                  f"{measured['peak_bytes'] / mib:9.1f} {predicted['peak_bytes'] / mib:8.1f} {row['peak_ratio']:5.2f}",
                  flush=True)
    worst = min(min(r["activations_ratio"], r["peak_ratio"]) for r in rows)
    print(f"lowest predicted / measured (activations, peak): {worst:.2f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch": torch.__version__, "machine": platform.machine(), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
