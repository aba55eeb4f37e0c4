"""Step times kept aside from the fit: torchtitan's Llama 3.1 H100 tables, priced at their stated layouts.

    python benchmarks/heldout_step_ratios.py [--only ID,...] [--json out.json]

Issue 40, item 4 names terms the held-out published runs show: interleaving's gain, ring context
parallelism's cost, FSDP's exposure at scale. The rows of benchmarks/data/published_memory.json that
carry `tokens_per_s_per_gpu` (torchtitan's benchmarks/llama3_h100_202412_torchtitan.md at 820504e,
Tables 1-6: the throughput printed beside each measured peak; docs/published-memory.md cites every row)
are priced here with the step-time model as `autoplan.published.predict` prices a shared row (the
row's stack, the shipped calibrations, every stated dimension pinned). Nothing here is fitted: the
fit reads only benchmarks/data/megatron_sc21_table1.json and modern_runs.json.

Most of these runs used torch.compile, Float8 linears or async TP, which the model does not price
(it prices bf16 eager layers), so their absolute ratios say little. The comparisons below pair rows of
one table that share those features, so what differs between the two is the term named:

- interleaving's gain: Table 5, Interleaved 1F1B against 1F1B (405B, pp 8);
- ring context parallelism: Tables 2 and 6, CP k at k times the sequence against CP 1, the same
  tokens per GPU;
- FSDP at scale: Tables 1 and 3, 128 GPUs against 8 (Llama 3.1 8B; the eager rows are bf16 and
  priced in absolute terms too).

Each comparison prints the published ratio of throughputs, the predicted one and their quotient
(predicted / published, 1.00 = the term is right). About a minute, most of it profiling the models.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from validate_memory import DATA, load_rows, row_config  # noqa: E402

from autoplan.published import PublishedRun, predict  # noqa: E402

COMPARISONS = [
    # (what, numerator row, denominator row)
    ("interleaving's gain (405B, pp 8, v 2)", "tt_h100_l31_405b_fsdp8_tp8_pp8_interleaved1f1b",
     "tt_h100_l31_405b_fsdp8_tp8_pp8_1f1b"),
    ("ring CP 2 / CP 1 (8B, 64K / 32K)", "tt_h100_l31_8b_fsdp4_cp2_64k", "tt_h100_l31_8b_fsdp8_cp1_32k"),
    ("ring CP 4 / CP 1 (8B, 128K / 32K)", "tt_h100_l31_8b_fsdp2_cp4_128k", "tt_h100_l31_8b_fsdp8_cp1_32k"),
    ("ring CP 8 / CP 1 (8B, 256K / 32K)", "tt_h100_l31_8b_fsdp1_cp8_256k", "tt_h100_l31_8b_fsdp8_cp1_32k"),
    ("ring CP 2 / CP 1 (405B, 64K / 32K)", "tt_h100_l31_405b_fsdp4_cp2_tp8_pp8_64k",
     "tt_h100_l31_405b_fsdp8_cp1_tp8_pp8_32k"),
    ("ring CP 4 / CP 1 (405B, 128K / 32K)", "tt_h100_l31_405b_fsdp2_cp4_tp8_pp8_128k",
     "tt_h100_l31_405b_fsdp8_cp1_tp8_pp8_32k"),
    ("ring CP 8 / CP 1 (405B, 256K / 32K)", "tt_h100_l31_405b_fsdp1_cp8_tp8_pp8_256k",
     "tt_h100_l31_405b_fsdp8_cp1_tp8_pp8_32k"),
    ("FSDP 128 / 8 GPUs (8B, eager)", "tt_h100_l31_8b_fsdp128", "tt_h100_l31_8b_fsdp8"),
    ("FSDP 128 / 8 GPUs (8B, compile + Float8)", "tt_h100_l31_8b_fsdp128_compile_fp8", "tt_h100_l31_8b_fsdp8_compile_fp8"),
]
"""Pairs of rows of one table that share every feature the model does not price."""


def heldout_run(row: dict) -> PublishedRun:
    """The row as a published step-time run: its stated layout pinned, its throughput as a step time
    (the tokens of one step over the GPUs, divided by tokens per second per GPU)."""
    cfg = row_config(row)
    num_gpus = row["nodes"] * row["gpus_per_node"]
    step_s = row["global_batch"] * row["seq"] / num_gpus / row["tokens_per_s_per_gpu"]
    pins = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return PublishedRun(id=row["id"], source=row["source"], regime="held out", model=row["model"]["spec"],
                        cluster=f"{row['nodes']}x{row['gpus_per_node']}x{row['cluster_kind']}", seq_len=row["seq"],
                        global_batch=row["global_batch"], published_step_s=step_s, pins=pins, stack=row["stack"],
                        published=f"{row['tokens_per_s_per_gpu']:,} TPS/GPU")


def heldout_rows(rows: list[dict]) -> list[dict]:
    """Every row with a published throughput: published and predicted tokens per second per GPU."""
    out = []
    for row in rows:
        if "tokens_per_s_per_gpu" not in row:
            continue
        run = heldout_run(row)
        prediction = predict(run)
        tokens_per_gpu = row["global_batch"] * row["seq"] / (row["nodes"] * row["gpus_per_node"])
        out.append({"id": row["id"], "features": row.get("features", []), "published_tps": row["tokens_per_s_per_gpu"],
                    "predicted_tps": tokens_per_gpu / prediction.step_s, "predicted_step_s": prediction.step_s,
                    "published_step_s": run.published_step_s,
                    "breakdown_s": dict(prediction.plan.predicted.breakdown)})
    return out


def comparisons(table: list[dict]) -> list[dict]:
    """`COMPARISONS` whose two rows are both in `table`: published and predicted throughput ratios."""
    by_id = {r["id"]: r for r in table}
    out = []
    for what, top, bottom in COMPARISONS:
        if top not in by_id or bottom not in by_id:
            continue
        published = by_id[top]["published_tps"] / by_id[bottom]["published_tps"]
        predicted = by_id[top]["predicted_tps"] / by_id[bottom]["predicted_tps"]
        out.append({"what": what, "rows": [top, bottom], "published": published, "predicted": predicted,
                    "quotient": predicted / published})
    return out


def format_report(table: list[dict], pairs: list[dict]) -> str:
    lines = [f"{'run':46s} {'published':>10s} {'predicted':>10s} {'pred/pub':>8s}  features (not priced)"]
    for r in table:
        lines.append(f"{r['id']:46s} {r['published_tps']:>10,.0f} {r['predicted_tps']:>10,.0f} "
                     f"{r['predicted_tps'] / r['published_tps']:>8.2f}  {', '.join(r['features']) or '-'}")
    lines.append("")
    lines.append(f"{'comparison (throughput ratio)':46s} {'published':>10s} {'predicted':>10s} {'quotient':>8s}")
    for c in pairs:
        lines.append(f"{c['what']:46s} {c['published']:>10.3f} {c['predicted']:>10.3f} {c['quotient']:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="rows (default: %(default)s)")
    parser.add_argument("--only", help="comma-separated row ids to price (default: every row with a throughput)")
    parser.add_argument("--json", type=Path, help="write the rows and comparisons as JSON")
    args = parser.parse_args(argv)
    if not args.data.exists():
        print(f"error: {args.data} does not exist; pass --data with a published_memory.json", file=sys.stderr)
        return 2
    rows = load_rows(args.data)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {r["id"] for r in rows}
        if unknown:
            print(f"error: no row {sorted(unknown)[0]!r} in {args.data}; --only takes ids from it", file=sys.stderr)
            return 2
        rows = [r for r in rows if r["id"] in wanted]
    table = heldout_rows(rows)
    pairs = comparisons(table)
    print(format_report(table, pairs))
    if args.json:
        args.json.write_text(json.dumps({"rows": table, "comparisons": pairs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
