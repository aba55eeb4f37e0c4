"""`autoplan list models|clusters|gpus`: the built-in model presets, cluster presets and GPU types,
read from the tables the planner itself uses (models/presets.py `PRESETS`, cluster/spec.py `PRESETS`,
cluster/devices.py `GPUS`), so the list cannot drift from what `--model` and `--cluster` accept.

Rows are plain dicts (`model_rows`, `cluster_rows`, `gpu_rows`): `--json` prints them as they are,
the tables format them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["cluster_rows", "gpu_rows", "model_rows", "register"]

ConsoleFactory = Callable[..., "Console"]

_WHAT = ("models", "clusters", "gpus")


def register(subparsers: argparse._SubParsersAction, console_factory: ConsoleFactory) -> None:
    """Add the `list` subcommand; it sets `func(args) -> int`."""
    p = subparsers.add_parser(
        "list", help="list the built-in model presets, cluster presets and GPU types",
        description="models: the zoo presets --model takes (family, parameters, shape, default sequence length); "
                    "clusters: the presets --cluster takes (NxPRESET for N nodes); gpus: the GPU types a cluster "
                    "spec names (NODESxGPUSxTYPE), with their datasheet figures and source.")
    p.add_argument("what", choices=_WHAT, help="which table")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=lambda args: cmd_list(args, console_factory))


def cmd_list(args: argparse.Namespace, console_factory: ConsoleFactory) -> int:
    rows = {"models": model_rows, "clusters": cluster_rows, "gpus": gpu_rows}[args.what]()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table, footer = {"models": _models_table, "clusters": _clusters_table, "gpus": _gpus_table}[args.what](rows)
    console = console_factory()
    console.print(table)
    console.print(footer)
    return 0


# ---- rows ------------------------------------------------------------------------------------

def _num_params(config: Any) -> int:
    """Parameters of a zoo model, counted on the meta device from its real module (tied weights
    once): the model with one layer and with two, extended linearly, since every layer is alike.
    Exact, and milliseconds where building a 126-layer model is seconds."""
    import dataclasses

    from autoplan import models as zoo

    one, two = (sum(p.numel() for p in zoo.build_model(dataclasses.replace(config, num_layers=n)).parameters())
                for n in (1, 2))
    return one + (config.num_layers - 1) * (two - one)


def model_rows() -> list[dict[str, Any]]:
    """One row per zoo preset, in the zoo's order."""
    from autoplan import models as zoo

    rows = []
    for name, config in zoo.PRESETS.items():
        info = zoo.model_info(name)
        rows.append({
            "name": name,
            "family": info["family"],
            "num_params": _num_params(config),
            "num_layers": info["num_layers"],
            "hidden_size": info["hidden_size"],
            "num_heads": info["num_heads"],
            "num_kv_heads": info["num_kv_heads"],
            "ffn_hidden_size": info["ffn_hidden_size"],
            "vocab_size": info["vocab_size"],
            "num_experts": info["num_experts"],
            "experts_per_token": info["experts_per_token"],
            # A zoo model's --seq-len defaults to its own context (sources/base.py default_seq_len).
            "default_seq_len": info["max_seq_len"],
            "sources": list(zoo.PRESET_SOURCES.get(name, ())),
        })
    return rows


def cluster_rows() -> list[dict[str, Any]]:
    """One row per cluster preset (one node of it; NxPRESET gives N)."""
    from autoplan.cluster.spec import PRESETS

    rows = []
    for name, make in PRESETS.items():
        cluster = make(1)
        group = cluster.groups[0]
        rows.append({
            "name": name,
            "gpus_per_node": group.gpus_per_node,
            "gpu": group.gpu.name,
            "intra_node": {"kind": cluster.intra_node.kind, "bw_gbps": cluster.intra_node.bw_gbps,
                           "latency_us": cluster.intra_node.latency_s * 1e6,
                           "measured_curves": bool(cluster.intra_node.curves)},
            "inter_node": {"kind": cluster.inter_node.kind, "bw_gbps": cluster.inter_node.bw_gbps,
                           "latency_us": cluster.inter_node.latency_s * 1e6,
                           "measured_curves": bool(cluster.inter_node.curves)},
        })
    return rows


def gpu_rows() -> list[dict[str, Any]]:
    """One row per GPU type of the datasheet table, then `cpu` (this machine, one rank)."""
    from autoplan.cluster.devices import GPUS, aliases, cpu_device

    rows = []
    for gpu in [*GPUS.values(), cpu_device()]:
        rows.append({
            "name": gpu.name,
            "aliases": list(aliases(gpu.name)),
            "peak_tflops": {key: flops / 1e12 for key, flops in gpu.peak_flops.items()},
            "mem_bytes": gpu.mem_bytes,
            "mem_bw_gbps": gpu.mem_bw_bytes_per_s / 1e9,
            "source": gpu.source,
        })
    return rows


# ---- tables ----------------------------------------------------------------------------------

def _models_table(rows: list[dict[str, Any]]):
    from rich.table import Table

    from autoplan.report.tables import fmt_count

    table = Table(title="model presets (--model NAME, or NAME:key=value,... to change a field)")
    for column in ("name", "family", "parameters", "layers", "hidden", "heads (kv)", "ffn", "vocab", "experts",
                   "default seq len"):
        table.add_column(column, justify="left" if column in ("name", "family") else "right")
    for r in rows:
        experts = f"{r['num_experts']} (top {r['experts_per_token']})" if r["num_experts"] else "-"
        table.add_row(r["name"], r["family"], fmt_count(r["num_params"]), str(r["num_layers"]), str(r["hidden_size"]),
                      f"{r['num_heads']} ({r['num_kv_heads']})", str(r["ffn_hidden_size"]), str(r["vocab_size"]),
                      experts, str(r["default_seq_len"]))
    footer = ("other forms: gpt:|llama:|moe:num_layers=..,hidden_size=..,num_heads=.. (any size), "
              "path/to/file.py:function, hf:PATH or hf:MODEL_TYPE:key=value,...")
    return table, footer


def _link(link: dict[str, Any]) -> str:
    return f"{link['kind']} {link['bw_gbps']:g} GB/s" + (" (curves)" if link["measured_curves"] else "")


def _clusters_table(rows: list[dict[str, Any]]):
    from rich.table import Table

    table = Table(title="cluster presets (--cluster NAME for one node, NxNAME for N)")
    for column in ("name", "node", "within a node", "between nodes"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["name"], f"{r['gpus_per_node']} x {r['gpu']}", _link(r["intra_node"]), _link(r["inter_node"]))
    footer = ("bandwidths per GPU per direction; (curves): measured-style bus bandwidth curves, else alpha-beta; "
              "any NODESxGPUSxTYPE works too (e.g. 4x8xB200), or a YAML file")
    return table, footer


def _gpus_table(rows: list[dict[str, Any]]):
    from rich.table import Table

    from autoplan.report.tables import fmt_bytes

    table = Table(title="GPU types (peak dense TFLOP/s; the cost model applies its efficiencies on top)")
    for column in ("name", "bf16", "fp16", "fp32", "memory", "bandwidth", "aliases", "source"):
        table.add_column(column, justify="right" if column in ("bf16", "fp16", "fp32", "memory", "bandwidth")
                         else "left", overflow="fold")
    for r in rows:
        peak = r["peak_tflops"]
        table.add_row(r["name"], *(f"{peak[k]:g}" if k in peak else "-" for k in ("bf16", "fp16", "fp32")),
                      fmt_bytes(r["mem_bytes"]), f"{r['mem_bw_gbps']:g} GB/s", ", ".join(r["aliases"]) or "-",
                      r["source"])
    footer = "cpu: this machine, shared by the ranks of a node (1x4xcpu: four ranks)"
    return table, footer
