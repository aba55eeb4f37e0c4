"""On one CUDA GPU: autoplan's runtime's peak memory and step time for llama3-8b layers, against the prediction.

    python benchmarks/gpu_memory_check.py [--gpu H100-SXM-80GB] [--steps 6] [--budget-s 480]
                                          [--json benchmarks/results/memory_gpu_<device>.json]

Issue 40, item 7: the memory model must equal what the runtime holds on the device it plans for.
For `llama3-8b:num_layers=4` (the 8B model's own layer, embedding and vocabulary: 1.9B parameters), bf16,
sequence 4096, a global batch of 4 sequences on one GPU, each layout in `LAYOUTS` (micro-batch 1 and 2,
recompute none / selective / full) is planned by `autoplan.suggest` with every dimension pinned (the
analytic profile, as a user's plan is) and trained for `--steps` steps in this process through
`autoplan.partition` (one NCCL rank, fused AdamW, as `autoplan run` on CUDA). Measured after the steps:
`torch.cuda.max_memory_allocated` and `max_memory_reserved` above what was allocated / reserved before
the plan was built, and the median step time after 2 warm-up steps. Printed per layout: predicted peak
(the plan's total, with the allowance for the CUDA context, NCCL and fragmentation, [Note: allowance]
in cost/memory.py), the prediction without the allowance (what the allocator counts), both measured
peaks, their ratios, and predicted / measured step time. The JSON (default
benchmarks/results/memory_gpu_<device>.json) keeps every figure and the plan's memory terms.

About 3-6 minutes on an H100 or H200 (three layouts, model build, 6 steps each); `--budget-s` skips the
layouts left once the elapsed time passes it, so the script ends inside a 10-minute device slot.
Needs CUDA: without it, one line on stderr and exit code 2 (tests/test_gpu_memory_check.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

MODEL = "llama3-8b:num_layers=4"
SEQ = 4096
GLOBAL_BATCH = 4
LAYOUTS = [  # (micro-batch, recompute)
    (1, "none"),
    (2, "selective"),
    (2, "full"),
]
GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]


def _gpu_name(device_name: str) -> str:
    """autoplan's device-table name for this CUDA device (H200 or H100; anything else: the H100's)."""
    return "H200-SXM-141GB" if "H200" in device_name else "H100-SXM-80GB"


def _plan(gpu: str, micro_batch: int, recompute: str):
    import autoplan

    plans = autoplan.suggest(MODEL, f"1x1x{gpu}", global_batch=GLOBAL_BATCH, seq_len=SEQ, dtype="bf16", top=1,
                             tp=1, pp=1, dp=1, micro_batch_size=micro_batch, recompute=recompute)
    if not plans:
        raise SystemExit(f"autoplan: error: suggest found no plan for micro-batch {micro_batch}, recompute {recompute}")
    return plans[0]


def _train(plan, steps: int) -> dict:
    """Train `plan` here (one NCCL rank): median step time, peak allocated and reserved above the baseline."""
    import torch

    from autoplan import models as zoo
    from autoplan.runtime import partition
    from autoplan.runtime.launcher.training import synthetic_batch

    device = torch.device("cuda", 0)
    gc.collect()
    torch.cuda.empty_cache()
    base_alloc = torch.cuda.memory_allocated(device)
    base_reserved = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    pm = partition(plan.model, plan, device=device)
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-4, fused=True)
    vocab = zoo.model_info(plan.model)["vocab_size"]
    times, losses = [], []
    for step in range(steps):
        ids, targets = synthetic_batch(0, step, plan.job.global_batch, plan.job.seq_len, vocab)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = pm.step(ids, target=targets)
        optimizer.step()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    out = {"measured_step_s": statistics.median(times[2:]) if len(times) > 2 else times[-1],
           "max_allocated_bytes": torch.cuda.max_memory_allocated(device) - base_alloc,
           "max_reserved_bytes": torch.cuda.max_memory_reserved(device) - base_reserved,
           "losses": losses}
    del pm, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _default_json(device_name: str) -> Path:
    slug = "".join(c if c.isalnum() else "_" for c in device_name).strip("_").lower()
    return ROOT / "benchmarks" / "results" / f"memory_gpu_{slug}.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", help="autoplan GPU name of this device (default: from the device's name)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip the layouts left past this many seconds")
    parser.add_argument("--json", type=Path, help="where to write the rows (default: benchmarks/results/memory_gpu_<device>.json)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("autoplan: error: no CUDA device; gpu_memory_check.py measures GPU memory, run it on a machine with a GPU",
              file=sys.stderr)
        return 2
    import torch.distributed as dist

    started = time.perf_counter()
    device_name = torch.cuda.get_device_name(0)
    gpu = args.gpu or _gpu_name(device_name)
    print(f"torch {torch.__version__}, {device_name}, planning for {gpu}; {MODEL}, seq {SEQ}, "
          f"global batch {GLOBAL_BATCH}, bf16", flush=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    rows, skipped = [], []
    for micro_batch, recompute in LAYOUTS:
        if time.perf_counter() - started > args.budget_s:
            skipped.append({"micro_batch_size": micro_batch, "recompute": recompute})
            print(f"skipped mb {micro_batch} {recompute}: past --budget-s {args.budget_s:.0f}", flush=True)
            continue
        plan = _plan(gpu, micro_batch, recompute)
        memory = plan.stages[0].memory
        measured = _train(plan, args.steps)
        predicted = plan.predicted.peak_memory_bytes
        allocated_pred = predicted - memory.allowance_bytes
        row = {"model": MODEL, "seq_len": SEQ, "global_batch": GLOBAL_BATCH, "micro_batch_size": plan.micro_batch_size,
               "num_microbatches": plan.num_microbatches, "recompute": plan.recompute,
               "predicted_peak_bytes": predicted, "predicted_without_allowance_bytes": allocated_pred,
               "predicted_terms_bytes": {k: getattr(memory, k + "_bytes") for k in
                                         ("weights", "grads", "optimizer", "gathered", "activations", "buffers",
                                          "allowance")},
               "predicted_step_s": plan.predicted.step_time_s, **measured}
        row["ratio_total_to_reserved"] = predicted / measured["max_reserved_bytes"]
        row["ratio_allocated"] = allocated_pred / measured["max_allocated_bytes"]
        row["ratio_step"] = plan.predicted.step_time_s / measured["measured_step_s"]
        rows.append(row)
        print(f"mb {plan.micro_batch_size} x {plan.num_microbatches} {plan.recompute:<9} "
              f"peak predicted {predicted / GIB:6.2f} GiB (without allowance {allocated_pred / GIB:6.2f}); measured "
              f"allocated {measured['max_allocated_bytes'] / GIB:6.2f}, reserved {measured['max_reserved_bytes'] / GIB:6.2f}; "
              f"ratio alloc {row['ratio_allocated']:.2f}, total/reserved {row['ratio_total_to_reserved']:.2f}; "
              f"step predicted {plan.predicted.step_time_s:.3f} s measured {measured['measured_step_s']:.3f} s "
              f"({row['ratio_step']:.2f}); loss {measured['losses'][0]:.3f} -> {measured['losses'][-1]:.3f}", flush=True)
        print("  predicted GiB: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in row["predicted_terms_bytes"].items()),
              flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    out = {"device": device_name, "torch": torch.__version__, "gpu": gpu, "model": MODEL, "seq_len": SEQ,
           "rows": rows, "skipped": skipped, "elapsed_s": time.perf_counter() - started}
    path = args.json or _default_json(device_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    under = [r for r in rows if r["ratio_allocated"] < 0.95]
    print(f"{len(rows)} layouts measured in {out['elapsed_s']:.0f} s; under-predicted (alloc < 0.95): {len(under)}; "
          f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
