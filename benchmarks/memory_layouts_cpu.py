"""Every layout kind on 2 gloo ranks: the memory autoplan's runtime holds, measured beside the prediction.

    python benchmarks/memory_layouts_cpu.py [--dtype fp32|bf16] [--steps 3] [--only NAME,...]
                                            [--json benchmarks/results/memory_layouts_cpu_<dtype>.json]

Issue 40, item 1: "validate it ... on this machine against the runtime's own measured peak for every
layout kind". One small zoo Llama (grouped-query attention, SwiGLU: `MODEL`) and one small mixture of
experts (`MOE_MODEL`, for ep), sequence 128, global batch 8, micro-batch 2, on `1x2xcpu`. Each case
pins one layout kind (tp 2 with and without sequence parallelism; pp 2 under 1F1B, interleaved 1F1B
and ZB-H1; dp 2 under ZeRO 0, 1 and 3; recompute selective and full; cp 2; ep 2), `autoplan.suggest`
plans it from the analytic profile (`profile_device="meta"`, its default: saved bytes are counted on
fake tensors either way), and the plan runs through `autoplan.partition(...).step` on 2 spawned gloo
ranks, as `autoplan run` runs it. Per rank:

- state: parameters, gradients and optimizer state held after a step (calibrate/measure.py
  `held_state_bytes`) beside the plan's weights + gradients + optimizer bytes;
- peak: that state held before a step plus the most bytes the step's ops keep alive at once
  (`LiveBytes`: activations, receive buffers, gathered parameters, transient gradients) beside the
  plan's peak less the allowance (`allowance_bytes`: a CUDA context and fragmentation, which a CPU
  rank does not have), as benchmarks/zero_levels_cpu.py measures it.

Ratios are predicted / measured; a peak ratio below 0.95 is flagged UNDER (the memory model's
target: never under by more than 5%). Printed: one line per case, the rank with the lowest peak
ratio. About 20-40 s a case on a 2-core machine (spawning the ranks dominates). A case whose ranks
fail is printed as ERROR and the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
from pathlib import Path

import torch

MODEL = ("llama3-8b:num_layers=4,hidden_size=256,num_heads=4,num_kv_heads=2,ffn_hidden_size=512,"
         "vocab_size=4096,max_seq_len=256")
MOE_MODEL = ("mixtral-8x7b:num_layers=2,hidden_size=256,num_heads=4,num_kv_heads=2,ffn_hidden_size=512,"
             "vocab_size=4096,num_experts=4,max_seq_len=256")
SEQ, GLOBAL_BATCH, MICRO_BATCH, WORLD = 128, 8, 2, 2
BASE = dict(tp=1, pp=1, dp=2, cp=1, zero=0, recompute="none", schedule="1f1b")
CASES = [  # (name, model, pins over BASE)
    ("dp2-zero0", MODEL, {}),
    ("dp2-zero1", MODEL, dict(zero=1)),
    ("dp2-zero3", MODEL, dict(zero=3)),
    ("recompute-selective", MODEL, dict(recompute="selective")),
    ("recompute-full", MODEL, dict(recompute="full")),
    ("tp2-sp-off", MODEL, dict(tp=2, dp=1, sequence_parallel=False)),
    ("tp2-sp-on", MODEL, dict(tp=2, dp=1, sequence_parallel=True)),
    ("pp2-1f1b", MODEL, dict(pp=2, dp=1)),
    ("pp2-interleaved", MODEL, dict(pp=2, dp=1, schedule="interleaved-1f1b", virtual_stages=2)),
    ("pp2-zb-h1", MODEL, dict(pp=2, dp=1, schedule="zb-h1")),
    ("cp2", MODEL, dict(cp=2)),
    ("ep2", MOE_MODEL, dict(ep=2)),
]
UNDER = 0.95


def plan_case(model: str, pins: dict, dtype: str):
    """The plan `autoplan.suggest` makes with the case's dimensions pinned."""
    from autoplan.api import suggest_with_stats

    result, _ = suggest_with_stats(model, f"1x{WORLD}xcpu", global_batch=GLOBAL_BATCH, seq_len=SEQ, dtype=dtype,
                                   profile_device="meta", top=1, micro_batch_size=MICRO_BATCH, **{**BASE, **pins})
    if not result.plans:
        raise SystemExit(f"autoplan: error: no plan for {pins}")
    return result.plans[0]


def _rank(rank: int, port: int, plan_json: str, steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from autoplan.calibrate.measure import LiveBytes, held_state_bytes
    from autoplan.plan import Plan
    from autoplan.runtime import partition

    try:
        plan = Plan.from_dict(json.loads(plan_json))
        pm = partition(plan.model, plan, device="cpu")
        optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-4)
        template = pm.output_template
        for step in range(steps):
            inputs, target = pm.source.batch(0, step, plan.job.global_batch, plan.job.seq_len, template.shape,
                                             template.dtype)
            pm.step(*inputs, target=target)
            optimizer.step()
        # The next step's peak: what is held going in (gradients dropped at its start) plus what its ops
        # keep alive at once.
        pm.zero_grad()
        before = held_state_bytes(pm, optimizer)
        inputs, target = pm.source.batch(0, steps, plan.job.global_batch, plan.job.seq_len, template.shape,
                                         template.dtype)
        # Parameters and buffers are model state, counted in `before`: an op returning a view of one
        # (the transpose a linear takes of its weight) must not count its storage as allocated.
        tracker = LiveBytes(_state_keys(pm))
        with tracker:
            pm.step(*inputs, target=target)
        optimizer.step()
        after = held_state_bytes(pm, optimizer)
        queue.put((rank, {"state": after, "peak": sum(before.values()) + tracker.peak,
                          "pp_index": pm.layout.pp_index}))
    except Exception as exc:  # reported by the parent, one line a rank
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _state_keys(pm) -> set[int]:
    """`storage_key`s of every parameter (masters and working copies, DTensors by their shard) and buffer."""
    from torch.distributed.tensor import DTensor

    from autoplan.calibrate.measure import storage_key

    tensors = [*pm.parameters()]
    for stage in pm.stages.values():
        tensors += [*stage.module.parameters(), *stage.module.buffers()]
    return {storage_key((t.to_local() if isinstance(t, DTensor) else t).untyped_storage()) for t in tensors}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(plan, steps: int, timeout_s: float = 600.0) -> dict[int, dict]:
    """Run `plan` on WORLD spawned gloo ranks; each rank's state and peak bytes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, plan.to_json(), steps, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return results


def case_rows(name: str, model: str, pins: dict, dtype: str, steps: int) -> list[dict]:
    """Predicted and measured state and peak of every rank of one case."""
    from autoplan.cost.memory import allowance_bytes

    plan = plan_case(model, pins, dtype)
    results = measure(plan, steps)
    gpu = plan.cluster_obj().gpu_types[0]
    rows = []
    for rank in sorted(results):
        res = results[rank]
        if "error" in res:
            return [{"case": name, "model": model, "dtype": dtype, "rank": rank, "error": res["error"]}]
        memory = next(s.memory for s in plan.stages if s.pp_rank == res["pp_index"])
        predicted_state = memory.weights_bytes + memory.grads_bytes + memory.optimizer_bytes
        predicted_peak = memory.total_bytes - allowance_bytes(gpu)
        measured_state = sum(res["state"].values())
        rows.append({"case": name, "model": model, "dtype": dtype, "rank": rank, "pp_index": res["pp_index"],
                     "layout": {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "cp": plan.cp, "ep": plan.ep,
                                "zero": plan.zero, "schedule": plan.schedule, "virtual_stages": plan.virtual_stages,
                                "recompute": plan.recompute, "sequence_parallel": plan.sequence_parallel,
                                "micro_batch_size": plan.micro_batch_size, "num_microbatches": plan.num_microbatches},
                     "measured_state_bytes": measured_state, "predicted_state_bytes": predicted_state,
                     "measured_peak_bytes": res["peak"], "predicted_peak_bytes": predicted_peak,
                     "predicted_terms_bytes": {k: getattr(memory, k + "_bytes") for k in
                                               ("weights", "grads", "optimizer", "gathered", "activations",
                                                "buffers")},
                     "state_ratio": predicted_state / measured_state, "peak_ratio": predicted_peak / res["peak"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="fp32", help="fp32 (default: what a CPU computes natively) or bf16")
    parser.add_argument("--only", help="comma-separated case names (default: every case)")
    parser.add_argument("--json", type=Path, help="default: benchmarks/results/memory_layouts_cpu_<dtype>.json")
    args = parser.parse_args(argv)
    names = [c[0] for c in CASES]
    only = args.only.split(",") if args.only else names
    unknown = [n for n in only if n not in names]
    if unknown:
        print(f"autoplan: error: unknown case {', '.join(unknown)}; cases: {', '.join(names)}", file=sys.stderr)
        return 2
    mib = 2**20
    print(f"{WORLD} gloo ranks on {os.cpu_count()} cores ({platform.machine()}), torch {torch.__version__}, "
          f"{args.dtype}; seq {SEQ}, global batch {GLOBAL_BATCH}, micro-batch {MICRO_BATCH}; MiB, the rank with the "
          "lowest peak ratio; ratio = predicted / measured", flush=True)
    print(f"{'case':<20} {'rank':>4} {'state meas':>10} {'pred':>8} {'ratio':>5}  {'peak meas':>9} {'pred':>8} "
          f"{'ratio':>5}", flush=True)
    rows = []
    for name, model, pins in CASES:
        if name not in only:
            continue
        mine = case_rows(name, model, pins, args.dtype, args.steps)
        rows += mine
        if "error" in mine[0]:
            print(f"{name:<20} {mine[0]['rank']:>4} ERROR {mine[0]['error']}", flush=True)
            continue
        r = min(mine, key=lambda x: x["peak_ratio"])
        flag = "  UNDER" if r["peak_ratio"] < UNDER else ""
        print(f"{name:<20} {r['rank']:>4} {r['measured_state_bytes'] / mib:>10.2f} {r['predicted_state_bytes'] / mib:>8.2f} "
              f"{r['state_ratio']:>5.2f}  {r['measured_peak_bytes'] / mib:>9.2f} {r['predicted_peak_bytes'] / mib:>8.2f} "
              f"{r['peak_ratio']:>5.2f}{flag}", flush=True)
    ok = [r for r in rows if "error" not in r]
    under = sorted({r["case"] for r in ok if r["peak_ratio"] < UNDER})
    failed = sorted({r["case"] for r in rows if "error" in r})
    if ok:
        print(f"{len({r['case'] for r in ok})} cases measured; peak ratio {min(r['peak_ratio'] for r in ok):.2f}.."
              f"{max(r['peak_ratio'] for r in ok):.2f}; UNDER: {', '.join(under) or 'none'}; "
              f"failed to run: {', '.join(failed) or 'none'}")
    path = args.json or Path(__file__).resolve().parent / "results" / f"memory_layouts_cpu_{args.dtype}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"torch": torch.__version__, "machine": platform.machine(), "dtype": args.dtype,
                                "seq": SEQ, "global_batch": GLOBAL_BATCH, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
