"""Predicted peak memory per GPU against published measured peaks: the memory table and its gate.

The rows are benchmarks/data/published_memory.json (docs/published-memory.md cites each). Every row
is evaluated with all its stated dimensions pinned, by the search's own evaluation
(search/evaluate.py, as tests/test_published_memory.py and autoplan/published.py do), and its memory
counted under the stack the source ran (cost/memory_stacks.py). The prediction reads only the row's
configuration, never `measured_gib`; settings the source does not state come from the stack's
defaults, and the table prints which (the row's `assumed`), apart from the settings read from a
configuration file the source's command names (`from_config`). A row's `memory_stack`, where it has
one, names the runtime version whose memory it is counted with (a torchtitan run of 2025 with
torch.compile), its `stack` the calibration's stack its step time is priced with.

Flags: UNDER when the prediction is below 0.95 x the measured peak (docs/architecture.md, "Never under-predict");
FALSE-OOM when the prediction exceeds the GPU's memory for a run that trained. `--check` fails on
either, except the rows of `KNOWN_UNDER` (each with the reason the model cannot yet explain it; strict). The figure compared
is what the source measured: a torchtitan row's "Memory" is the allocator's peak reserved bytes, so
it is compared with the prediction's total, which includes the allowance for what the allocator
reserves beyond what it allocates ([Note: allowance] in cost/memory.py). A Megatron row's figure is
`max_memory_allocated` (its memory report), which leaves the allowance's share out: the gate still
compares the total, the figure the planner refuses layouts with (a run that trained needed at least
the allocated bytes), and the table also prints the ratio of the prediction without the allowance
("alloc") so an allocated-bytes shortfall shows.

    python benchmarks/validate_memory.py                 # the table
    python benchmarks/validate_memory.py --check         # exit 1 on any UNDER or FALSE-OOM
    python benchmarks/validate_memory.py --json PATH     # every row as JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from autoplan import models as zoo
from autoplan.cluster import GPU, get_gpu, parse_cluster
from autoplan.cost import memory as memory_model
from autoplan.cost.config import ParallelConfig
from autoplan.cost.memory_stacks import stack_memory
from autoplan.graph.profile import profile_model
from autoplan.plan import Job, MemoryBreakdown
from autoplan.search import inflight as inflight_module
from autoplan.search.context import SearchContext
from autoplan.search.evaluate import evaluate
from autoplan.search.inflight import schedule_inflight

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "published_memory.json"
GIB = 2**30
UNDER_RATIO = 0.95
"""A prediction below this share of the measured peak is flagged UNDER (issue 40: never under by more than 5%)."""
OVER_TARGET = 1.15
"""The issue's target for the high side (+15%); reported, not gated."""
TERMS = ("weights_bytes", "grads_bytes", "optimizer_bytes", "gathered_bytes", "activations_bytes", "buffers_bytes",
         "allowance_bytes")

KNOWN_UNDER = {
    "tt_h100_l31_405b_fsdp1_cp8_tp8_pp8_256k": (
        "torchtitan's CP 8 at 256K measured 84.9 GiB, 9.6 above the CP 1 row with the same tokens per GPU and "
        "pipeline (75.3; CP 2 75.9, CP 4 77.1). About 5.2 GiB of it is Float8's all-gather, which torchtitan "
        "9dec370 turns on only where FSDP shards over dp_shard > 1 (torchtitan/float8.py, "
        "`enable_fsdp_float8_all_gather = parallel_dims.dp_shard_enabled and ...`): under pp a rank holds its "
        "stage's unsharded weights all step (reshard_after_forward=False), in bf16 at FSDP 1 x CP 8 and in float8 "
        "at FSDP 2-8 (torchao eab345c fsdp_utils.py `fsdp_post_all_gather` keeps the gathered float8 bytes), "
        "1 byte a parameter on 5.6 billion (the last rank's 15 layers). The model prices neither Float8 nor its "
        "all-gather, so it counts bf16 weights on every 405B row: right for this one, about 5.2 GiB high for the "
        "CP 1 / 2 / 4 and Table 5 rows (priced in float8, the Table 5 1F1B row would be about 0.90). The other "
        "4.4 GiB continues the CP 1 -> 2 -> 4 steps (+0.6, +1.2 GiB): a term that doubles with the whole sequence, "
        "about 19 KiB a token of it on the peak rank, which no source found names (ring attention's all-gathered "
        "keys and values are 0.5 KiB a token a layer here, the rotary table 1 KiB). So it stays under (0.94)"),
}
"""Rows the model still predicts below 0.95 x measured, and why: printed as UNDER, left out of `--check`
until the model explains them. Strict: a row listed here that is no longer under fails the gate, so the
entry comes off the day the model admits it (as tests/test_published_memory.py marks its xfails)."""

_PROFILES: dict[tuple[str, int], Any] = {}


def load_rows(path: Path = DATA) -> list[dict]:
    return json.loads(Path(path).read_text())["rows"]


def row_gpu(row: dict) -> GPU:
    """The row's GPU. A memory size autoplan's device table lacks (torchtitan's 96 GB H100s) is the
    table's GPU of that chip with the stated size, usable in the same share as the table's entry
    (81,559 of 81,920 MiB on an 80 GB H100)."""
    gpu = get_gpu(row["cluster_kind"])
    stated = row.get("gpu_mem_gb")
    nominal = round(gpu.mem_bytes / 2**30 / 8) * 8  # 80 or 40 GB parts: the nominal size in GiB
    if stated and abs(stated - nominal) > 2 and "H200" not in gpu.name:
        usable = gpu.mem_bytes / (nominal * 2**30)
        gpu = dataclasses.replace(gpu, name=f"{gpu.name.split('-')[0]}-{stated}GB", mem_bytes=int(stated * 2**30 * usable))
    return gpu


def row_config(row: dict) -> ParallelConfig:
    """The row's layout, every stated dimension pinned (autoplan's conventions: dp counts cp's ranks)."""
    replicas = row["dp"] // row["cp"]
    return ParallelConfig(
        tp=row["tp"], pp=row["pp"], dp=row["dp"], cp=row["cp"], ep=row["ep"], micro_batch_size=row["mbs"],
        num_microbatches=row["global_batch"] // (replicas * row["mbs"]),
        schedule=row["schedule"] if row["pp"] > 1 else "1f1b", virtual_stages=row.get("virtual_stages") or 1,
        recompute=row["recompute"], zero=row["zero"], dp_replicate=row.get("dp_replicate", 1),
        sequence_parallel=bool(row.get("sequence_parallel", False)))


def _profile(spec: str, seq: int):
    key = (spec, seq)
    if key not in _PROFILES:
        model = zoo.build_model(spec)
        info = {k: v for k, v in zoo.model_info(spec).items() if isinstance(v, int)}
        _PROFILES[key], _ = profile_model(model, zoo.example_inputs(spec, 1, seq), loss_fn=zoo.lm_loss,
                                          example_target=zoo.example_targets(spec, 1, seq), model_name=spec, info=info)
    return _PROFILES[key]


def _takes_stack() -> bool:
    """Whether this tree's memory model counts per stack (cost/memory_stacks.py); a tree before it
    counts the default stack's bytes (how the before figures of the report were taken)."""
    return "stack" in inspect.signature(memory_model.rank_memory).parameters


def _rank_rows(cfg, rank: int, inflight: list[int]) -> tuple:
    """The rank's moments as the search passes them (search/assemble.py `rank_memories`): the held
    rows, and the FSDP lifetimes where this tree's memory model takes them (a tree before them
    passes the held rows alone, `interleaved_held`)."""
    if hasattr(inflight_module, "rank_moments"):
        moments = inflight_module.rank_moments(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.virtual_stages,
                                               rank, inflight)
        return (None, {}) if moments is None else (moments.held, {"lifetimes": moments[1:]})
    if cfg.schedule != "interleaved-1f1b" or cfg.virtual_stages < 2:
        return None, {}
    held = inflight_module.interleaved_held(cfg.pp, cfg.num_microbatches, cfg.virtual_stages)[rank]
    return (held if list(held.max(axis=0)) == inflight else None), {}


def row_stack(row: dict) -> str | None:
    """The stack whose runtime held the row's memory: its `memory_stack` where it names one, else its `stack`."""
    return row.get("memory_stack") or row.get("stack")


def predict_memory(row: dict) -> tuple[MemoryBreakdown, GPU]:
    """The largest per-GPU memory of the row's layout under its stack, and its GPU. The cuts are the
    evaluation's (search/evaluate.py, nothing refused); each pipeline rank's memory is then counted as
    search/assemble.py `rank_memories` counts it, with the row's stack."""
    spec, seq = row["model"]["spec"], row["seq"]
    prof = _profile(spec, seq)
    gpu = row_gpu(row)
    cluster = parse_cluster(f"{row['nodes']}x{row['gpus_per_node']}x{get_gpu(row['cluster_kind']).name}")
    job = Job(global_batch=row["global_batch"], seq_len=seq, dtype=row.get("dtype", "bfloat16"))
    cfg = row_config(row)
    ctx = SearchContext(prof, cluster, job, spec)
    evaluation = evaluate(ctx, cfg, require_fit=False)
    if evaluation is None:
        raise ValueError(f"{row['id']}: autoplan cannot evaluate the layout {cfg}")
    plan = evaluation.plan
    ranges = [(s.first_block, s.end_block) for s in plan.stages]
    stack = row_stack(row)
    kwargs = {"stack": stack} if _takes_stack() else {}
    acts = memory_model.block_act_bytes(prof, cfg, False, **kwargs)
    inflight = schedule_inflight(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.virtual_stages)
    worst = None
    for p in range(cfg.pp):
        mine = [k for k in range(cfg.num_stages) if k % cfg.pp == p]
        held, more = _rank_rows(cfg, p, [inflight[k] for k in mine])
        mem = memory_model.rank_memory(prof, cfg, gpu, job.dtype, [ranges[k] for k in mine],
                                       [inflight[k] for k in mine], acts=acts, held=held, **more, **kwargs)
        if worst is None or mem.total_bytes > worst.total_bytes:
            worst = mem
    assert worst is not None
    return worst, gpu


def memory_rows(rows: list[dict] | None = None) -> list[dict]:
    """Every row with its prediction: measured and predicted GiB, their ratio, the breakdown, flags."""
    out = []
    for row in load_rows() if rows is None else rows:
        mem, gpu = predict_memory(row)
        predicted = mem.total_bytes / GIB
        measured = float(row["measured_gib"])
        capacity = gpu.mem_bytes / GIB
        flags = []
        if predicted < UNDER_RATIO * measured:
            flags.append("UNDER")
        if predicted > capacity:
            flags.append("FALSE-OOM")
        terms = {name[:-6]: getattr(mem, name) / GIB for name in TERMS}
        out.append({"id": row["id"], "stack": row_stack(row), "model": row["model"]["spec"],
                    "gpu": gpu.name,
                    "capacity_gib": capacity, "measured_gib": measured, "predicted_gib": predicted,
                    "ratio": predicted / measured, "terms_gib": terms, "flags": flags,
                    "features": [_feature(f, row_stack(row)) for f in row.get("features", [])], "assumed": sorted(row.get("assumed", {})),
                    "from_config": sorted(row.get("from_config", {})),
                    "measured_what": row["measured_what"].split(":")[0],
                    "allocated_ratio": ((mem.total_bytes - mem.allowance_bytes) / GIB / measured
                                        if row["measured_what"].startswith("max allocated") else None)})
    return out


def gate_failures(rows: list[dict]) -> list[str]:
    """Why the gate fails, one line a row: any FALSE-OOM; an UNDER not in KNOWN_UNDER; a KNOWN_UNDER
    row that is no longer under (its entry must come off)."""
    out = []
    for r in rows:
        known = r["id"] in KNOWN_UNDER
        if "FALSE-OOM" in r["flags"]:
            out.append(f"{r['id']}: predicted {r['predicted_gib']:.1f} GiB > {r['capacity_gib']:.1f} GiB on a run that trained")
        if "UNDER" in r["flags"] and not known:
            out.append(f"{r['id']}: predicted {r['predicted_gib']:.1f} GiB < {UNDER_RATIO} x measured {r['measured_gib']:.1f} GiB")
        if known and "UNDER" not in r["flags"]:
            out.append(f"{r['id']}: no longer under-predicted; remove it from KNOWN_UNDER")
    return out


def _feature(name: str, stack: str | None) -> str:
    """A run's feature as the table names it: what the model leaves out, or what part it counts."""
    if name == "torch.compile (layers)" and stack_memory(stack).compiled_layers:
        return f"{name} (counted: what selective recompute saves; not: its transients)"
    return name


def format_table(rows: list[dict]) -> str:
    lines = [f"{'run':<44} {'stack':<24} {'measured':>8} {'predicted':>9} {'ratio':>6}  "
             f"{'largest terms (GiB)':<46} flags / assumed"]
    for r in rows:
        top = sorted(r["terms_gib"].items(), key=lambda kv: -kv[1])[:3]
        terms = ", ".join(f"{k[:5]} {v:.1f}" for k, v in top)
        extra = " ".join(r["flags"]) or "ok"
        if r["ratio"] > OVER_TARGET:
            extra += " (over +15%)"
        if r.get("allocated_ratio") is not None:
            extra += f" (max allocated; alloc {r['allocated_ratio']:.2f})"
        lines.append(f"{r['id']:<44} {str(r['stack']):<24} {r['measured_gib']:>8.1f} {r['predicted_gib']:>9.1f} "
                     f"{r['ratio']:>6.2f}  {terms:<46} {extra}; assumed: {', '.join(r['assumed']) or '-'}"
                     + (f"; from config: {', '.join(r['from_config'])}" if r.get("from_config") else "")
                     + (f"; not modelled: {', '.join(r['features'])}" if r["features"] else ""))
    for why in gate_failures(rows):
        lines.append(f"GATE: {why}")
    for r in rows:
        if r["id"] in KNOWN_UNDER:
            lines.append(f"known UNDER {r['id']}: {KNOWN_UNDER[r['id']]}")
    ratios = [r["ratio"] for r in rows]
    if ratios:
        under = sum("UNDER" in r["flags"] for r in rows)
        oom = sum("FALSE-OOM" in r["flags"] for r in rows)
        within = sum(UNDER_RATIO <= x <= OVER_TARGET for x in ratios)
        lines.append(f"{len(rows)} rows: ratio median {float(np.median(ratios)):.2f}, min {min(ratios):.2f}, "
                     f"max {max(ratios):.2f}; within -5%/+15%: {within}; UNDER: {under}; FALSE-OOM: {oom}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="rows to check (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="exit 1 on any UNDER or FALSE-OOM row")
    parser.add_argument("--json", type=Path, help="write every row as JSON")
    args = parser.parse_args(argv)
    if not args.data.exists():
        print(f"error: {args.data} does not exist; pass --data with a published_memory.json", file=sys.stderr)
        return 2
    rows = memory_rows(load_rows(args.data))
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    bad = gate_failures(rows)
    if args.check and bad:
        print(f"FAIL: {len(bad)} rows fail the memory gate:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
