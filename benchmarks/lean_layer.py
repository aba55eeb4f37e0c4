"""Bytes a zoo Llama layer saves for backward, against Korthikanti et al.'s count, and what that buys.

    python benchmarks/lean_layer.py [--label after] [--json benchmarks/results/lean_layer.json]
    PYTHONPATH=/tmp/before python benchmarks/lean_layer.py --label before   # an older tree's autoplan

For a llama3-8b- and a llama3-70b-shaped layer in bf16, in units of s*b*h bytes per layer:

- measured: one LlamaLayer built at the preset's shapes runs forward on this machine's CPU, and
  `torch.autograd.graph.saved_tensors_hooks` counts every storage autograd saves once (parameters
  and buffers excluded). The zoo's RMSNorm keeps on a CPU what CUDA's fused kernel keeps, x and an
  fp32 rstd a row ([Note: lean RMSNorm] in autoplan/models/ops.py), so the CPU's count is the GPU's.
  In an older tree (nn.RMSNorm, whose CPU composite form saves the fp32 input and the fp32
  normalized input: 6 bytes an element more per norm, two a layer, [Note: fused RMSNorm] in
  autoplan/cost/memory.py), "measured gpu" takes those 12 s*b*h off.
- profile: `autoplan.profile(spec)`'s layer block (`Block.saved_bytes`, on fake tensors), and after
  `fused_norm_surplus`, the correction the memory model applies for a GPU.
- formula: `korthikanti_terms` below, every term named.

Then the largest micro-batch autoplan's planner fits on one GPU for a few pinned layouts (recompute
off, `autoplan.suggest_with_stats` with tp/pp/dp/zero/sequence_parallel/schedule/micro_batch_size
pinned, the micro-batch raised until no plan fits), with that plan's predicted peak.

The script imports whichever `autoplan` is first on sys.path, so the same file measures an older
tree (`--label before` with PYTHONPATH pointing at it); results are merged into the JSON by label.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

LAYERS = {  # name -> zoo spec (two layers: the profile measures each distinct block once)
    "llama3-8b": "llama3-8b:num_layers=2",
    "llama3-70b": "llama3-70b:num_layers=2",
}
SEQ, BATCH = 64, 1  # saved bytes scale with s * b (the logsumexp and rstd terms too: per token)

FITS = [  # (name, model, cluster, seq_len, pins)
    ("llama3-8b fsdp dp8", "llama3-8b", "1x8xH100-80GB", 8192, dict(tp=1, pp=1, dp=8, cp=1, zero=3)),
    ("llama3-8b tp2 dp4 zero1 sp", "llama3-8b", "1x8xH100-80GB", 8192,
     dict(tp=2, pp=1, dp=4, cp=1, zero=1, sequence_parallel=True)),
    ("llama3-70b tp8 pp4 dp2 sp", "llama3-70b", "8x8xH100-80GB", 4096,
     dict(tp=8, pp=4, dp=2, cp=1, zero=1, sequence_parallel=True, schedule="1f1b")),
    ("llama3-70b tp8 pp8 dp1 sp", "llama3-70b", "8x8xH100-80GB", 4096,
     dict(tp=8, pp=8, dp=1, cp=1, zero=0, sequence_parallel=True, schedule="1f1b")),
]
MAX_MBS = 64


def korthikanti_terms(h: int, f: int, heads: int, kv_heads: int, item: int = 2) -> dict[str, float]:
    """Bytes one Llama layer saves for backward per token, in units of h bytes (so s*b*h bytes a layer).

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4.1,
    Eq. 1: sbh (34 + 5 a s / h) for a GPT layer with 2-byte activations: attention 11 sbh + 5 a s^2 b
    (QKV input 2, Q and K 4, softmax 2as^2b and its dropout mask as^2b, V 2 + the softmax-dropout output
    2as^2b, the output projection's input 2, dropout mask 1), MLP 19 sbh (input 2, GeLU input 8, GeLU
    output 8, dropout mask 1), two LayerNorms' inputs 4 sbh. Adapted to a Llama layer:

    - flash attention (Dao et al. 2022): no s x s term; the kernel saves its output O (the output
      projection's input, one tensor) and a fp32 logsumexp per head and token;
    - no dropout: no masks;
    - grouped-query attention: K and V at their own kv_heads (kv_heads / heads of Q's bytes each);
    - SwiGLU (Shazeer 2020) of width f, as Megatron-Core saves it (fused_bias_swiglu.py saves the fc1
      output [gate | up]; the fc2 input is the SwiGLU output): gate, up and their product, 3 x 2f;
    - RMSNorm: the input (as LayerNorm's) plus a fp32 rstd per token, the fused kernel's saved set.
    """
    g = kv_heads / heads
    return {
        "attention_norm input (residual)": item,
        "attention_norm rstd (fp32, per token)": 4 / h,
        "q/k/v projections' input (norm output)": item,
        "q (after rotary)": item,
        "k at num_kv_heads (after rotary)": item * g,
        "v at num_kv_heads": item * g,
        "attention output O (= wo input)": item,
        "flash logsumexp (fp32, per head and token)": 4 * heads / h,
        "mlp_norm input (residual)": item,
        "mlp_norm rstd (fp32, per token)": 4 / h,
        "w1/w3 input (norm output)": item,
        "SwiGLU gate (w1 output)": item * f / h,
        "SwiGLU up (w3 output)": item * f / h,
        "w2 input (SwiGLU output)": item * f / h,
    }


def _config(name: str):
    from autoplan.models.presets import PRESETS

    return PRESETS[name]


def measured(name: str) -> dict:
    """Saved storages of one real LlamaLayer forward, bf16 on this CPU."""
    from autoplan.models import ops
    from autoplan.models.llama import LlamaLayer

    cfg = _config(name)
    with torch.device("meta"):
        layer = LlamaLayer(cfg)
    layer = layer.to_empty(device="cpu").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02).to(p.dtype))
    rope = layer.attention.rope
    if hasattr(rope, "reset_buffers"):
        rope.reset_buffers()
    rope.cos, rope.sin = rope.cos.to(torch.bfloat16), rope.sin.to(torch.bfloat16)  # as the runtime casts buffers
    state = {t.untyped_storage().data_ptr() for t in [*layer.parameters(), *layer.buffers()]}
    saved: dict[int, dict] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in state and key not in saved:
            saved[key] = dict(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."), bytes=storage.nbytes())
        return t

    h = cfg.hidden_size
    x = torch.randn(BATCH, SEQ, h, generator=gen).to(torch.bfloat16).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    del out
    sbh = SEQ * BATCH * h
    tensors = sorted(saved.values(), key=lambda d: -d["bytes"])
    for d in tensors:
        d["per_sbh"] = d["bytes"] / sbh
    total = sum(d["bytes"] for d in tensors) / sbh
    repeated = [d for d in tensors if len(d["shape"]) == 4 and cfg.num_kv_heads != cfg.num_heads
                and d["shape"][1] == cfg.num_heads and d["shape"][-1] == cfg.head_dim]
    lean_norms = hasattr(ops, "rms_norm")  # an older tree (`--label before`) has no lean RMSNorm
    return dict(cpu=total, gpu_norms=total - (0.0 if lean_norms else 2 * 6.0), lean_norms=lean_norms,
                tensors=tensors, num_tensors=len(tensors), head_shaped_tensors=len(repeated))


def profiled(name: str) -> dict:
    import autoplan
    from autoplan.cost.memory import fused_norm_surplus

    prof = autoplan.profile(LAYERS[name], batch_size=BATCH, seq_len=SEQ, dtype="bf16")
    sbh = SEQ * BATCH * prof.hidden_size
    block = next(b for b in prof.blocks if b.kind == "layer")
    surplus = sum(fused_norm_surplus(block, prof.hidden_size))
    return dict(block=block.name, cpu=block.saved_bytes / sbh, gpu=(block.saved_bytes - surplus) / sbh,
                replicated_tp=block.saved_bytes_replicated_tp / sbh,
                fwd_flops=block.fwd_flops, bwd_flops=block.bwd_flops,
                attention_fwd_flops=block.attention_core_fwd_flops)


def largest_fit(model: str, cluster: str, seq_len: int, pins: dict) -> dict:
    """The largest micro-batch with a plan that fits, raising it until none does."""
    from autoplan.api import suggest_with_stats

    best = None
    for mbs in range(1, MAX_MBS + 1):
        num_micro = max(1, 2 * pins.get("pp", 1))
        global_batch = mbs * pins.get("dp", 1) * num_micro
        try:
            result, _ = suggest_with_stats(model, cluster, global_batch=global_batch, seq_len=seq_len, top=1,
                                           micro_batch_size=mbs, recompute="none", **pins)
        except ValueError as exc:  # PlanningError: nothing fits at this micro-batch
            return dict(micro_batch_size=best[0] if best else 0, peak_gib=best[1] if best else None,
                        next_refusal=str(exc).splitlines()[0][:300])
        plan = result.plans[0] if result.plans else None
        if plan is None or not plan.fits:  # every axis pinned: the search returns the plan, fitting or not
            need = f"; needs {plan.predicted.peak_memory_bytes / 2**30:.1f} GiB" if plan is not None else ""
            return dict(micro_batch_size=best[0] if best else 0, peak_gib=best[1] if best else None,
                        next_refusal=f"micro-batch {mbs} does not fit{need}")
        best = (mbs, plan.predicted.peak_memory_bytes / 2**30)
    return dict(micro_batch_size=best[0] if best else 0, peak_gib=best[1] if best else None, next_refusal="")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="after", help="the key these results are stored under (before/after)")
    ap.add_argument("--json", default="benchmarks/results/lean_layer.json")
    ap.add_argument("--skip-fits", action="store_true", help="only the per-layer bytes")
    args = ap.parse_args()
    import autoplan

    started = time.time()
    rows = {}
    for name in LAYERS:
        cfg = _config(name)
        terms = korthikanti_terms(cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_heads, cfg.num_kv_heads)
        rows[name] = dict(formula=sum(terms.values()), formula_terms=terms, measured=measured(name),
                          profile=profiled(name))
    print(f"saved for backward per layer, bytes / (s*b*h), bf16, s={SEQ} b={BATCH}; autoplan at "
          f"{Path(autoplan.__file__).parent} ({args.label})")
    print(f"{'layer':12} {'measured cpu':>13} {'measured gpu':>13} {'profile cpu':>12} {'profile gpu':>12} "
          f"{'formula':>8} {'cpu/formula':>12} {'gpu/formula':>12}")
    for name, r in rows.items():
        m, p = r["measured"], r["profile"]
        print(f"{name:12} {m['cpu']:13.2f} {m['gpu_norms']:13.2f} {p['cpu']:12.2f} {p['gpu']:12.2f} "
              f"{r['formula']:8.2f} {m['cpu'] / r['formula']:12.3f} {p['gpu'] / r['formula']:12.3f}")
        print(f"{'':12} k/v repeated to the query heads: {m['head_shaped_tensors'] - 2} tensor(s) "
              "(q and the attention output are head-shaped)")
    fits = {}
    if not args.skip_fits:
        print("\nlargest micro-batch that fits (recompute none), predicted peak per GPU")
        for label, model, cluster, seq_len, pins in FITS:
            fits[label] = dict(model=model, cluster=cluster, seq_len=seq_len, pins=pins,
                               **largest_fit(model, cluster, seq_len, pins))
            f = fits[label]
            peak = f"{f['peak_gib']:.1f} GiB" if f["peak_gib"] is not None else "-"
            print(f"  {label:28} {cluster:14} seq {seq_len:5}: micro-batch {f['micro_batch_size']:3} ({peak}); "
                  f"{f['next_refusal']}")
    out = Path(args.json)
    data = json.loads(out.read_text()) if out.exists() else {}
    data["command"] = ("PYTHONPATH=TREE python benchmarks/lean_layer.py --label LABEL (before: `git archive` of the "
                       "commit before the lean layer; after: that tree with the change)")
    data[args.label] = dict(autoplan=str(Path(autoplan.__file__).parent), torch=torch.__version__,
                            machine=platform.machine(), seq_len=SEQ, batch=BATCH, layers=rows, fits=fits,
                            wall_s=round(time.time() - started, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"\nwrote {out} [{args.label}] in {time.time() - started:.0f} s")
    if "before" in data and "after" in data:
        _compare(data["before"], data["after"])


def _compare(before: dict, after: dict) -> None:
    print("\nbefore -> after")
    for name in LAYERS:
        b, a = before["layers"].get(name), after["layers"].get(name)
        if b and a:
            print(f"  {name:12} profile, GPU norms: {b['profile']['gpu']:6.2f} -> {a['profile']['gpu']:6.2f} s*b*h bytes "
                  f"a layer (formula {a['formula']:.2f})")
    for label in after["fits"]:
        b, a = before["fits"].get(label), after["fits"][label]
        if b:
            print(f"  {label:28} largest micro-batch {b['micro_batch_size']} -> {a['micro_batch_size']}")


if __name__ == "__main__":
    main()
