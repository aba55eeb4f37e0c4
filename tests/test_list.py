"""`autoplan list models|clusters|gpus` (autoplan/commands/listing.py) through the CLI: every row comes
from the table `--model` / `--cluster` read, so every listed name is accepted where it is used; the
Blackwell and MI325X entries carry their datasheet figures (issue 29, item 9)."""

from __future__ import annotations

import json

import pytest

from autoplan import models as zoo
from autoplan.cli import main
from autoplan.cluster.devices import GPUS, get_gpu
from autoplan.cluster.spec import PRESETS as CLUSTER_PRESETS
from autoplan.cluster.spec import parse_cluster


def _rows(what: str, capsys) -> list[dict]:
    assert main(["list", what, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_models_lists_every_zoo_preset_with_its_parameter_count(capsys):
    rows = _rows("models", capsys)
    assert [r["name"] for r in rows] == list(zoo.PRESETS)
    by_name = {r["name"]: r for r in rows}
    # Published counts: GPT-2 small (tied embeddings) 124,439,808 and Llama 3 8B 8,030,261,248 (the
    # Hugging Face checkpoints' totals), Mixtral 8x7B 46,702,792,704 (its model card: 46.7B).
    assert by_name["gpt2-small"]["num_params"] == 124_439_808
    assert by_name["llama3-8b"]["num_params"] == 8_030_261_248
    assert by_name["mixtral-8x7b"]["num_params"] == 46_702_792_704
    assert (by_name["mixtral-8x7b"]["num_experts"], by_name["mixtral-8x7b"]["experts_per_token"]) == (8, 2)
    for row in rows:
        spec = zoo.parse_model_spec(row["name"])  # every listed name is a --model the zoo accepts
        assert (row["family"], row["num_layers"], row["default_seq_len"]) == (
            spec.family, spec.config.num_layers, spec.config.max_seq_len)
        assert row["sources"] == list(zoo.PRESET_SOURCES[row["name"]])


def test_a_layer_extrapolated_count_is_the_built_models(capsys):
    """The listing counts one- and two-layer models and extends linearly; a whole model built on meta
    gives the same total (a small MoE and a GPT with tied embeddings)."""
    from autoplan.commands.listing import _num_params

    for spec in ("moe:num_layers=5,hidden_size=64,num_heads=4,num_kv_heads=2,ffn_hidden_size=96,vocab_size=256,"
                 "num_experts=4,experts_per_token=2", "gpt:num_layers=7,hidden_size=64,num_heads=4,vocab_size=300"):
        config = zoo.parse_model_spec(spec).config
        assert _num_params(config) == sum(p.numel() for p in zoo.build_model(config).parameters())


def test_clusters_lists_every_preset_and_each_parses(capsys):
    rows = _rows("clusters", capsys)
    assert [r["name"] for r in rows] == list(CLUSTER_PRESETS)
    for row in rows:
        for nodes in (1, 2):
            cluster = parse_cluster(row["name"] if nodes == 1 else f"{nodes}x{row['name']}")
            assert (cluster.num_nodes, cluster.gpus_per_node, cluster.gpu.name) == (
                nodes, row["gpus_per_node"], row["gpu"])
            assert cluster.intra_node.bw_gbps == row["intra_node"]["bw_gbps"]
    by_name = {r["name"]: r for r in rows}
    # DGX B200 and GB200 NVL72: NVLink 5 at 1.8 TB/s both ways per GPU; NVL72's domain is 72 GPUs
    assert (by_name["dgx-b200"]["gpus_per_node"], by_name["dgx-b200"]["intra_node"]["bw_gbps"]) == (8, 900)
    assert (by_name["gb200-nvl72"]["gpus_per_node"], by_name["gb200-nvl72"]["gpu"]) == (72, "GB200")
    assert by_name["mi325x-8"]["gpu"] == "MI325X"


def test_gpus_lists_the_datasheet_table_with_sources(capsys):
    rows = _rows("gpus", capsys)
    assert [r["name"] for r in rows] == [*GPUS, "cpu"]
    by_name = {r["name"]: r for r in rows}
    # dense peaks, from the datasheets the table cites (sparse figures halved)
    assert by_name["B200-SXM-180GB"]["peak_tflops"]["bf16"] == 2250
    assert by_name["GB200"]["peak_tflops"]["bf16"] == 2500
    assert by_name["MI325X"]["peak_tflops"]["bf16"] == by_name["MI300X"]["peak_tflops"]["bf16"] == 1307.4
    assert by_name["MI325X"]["mem_bytes"] == 256 * 2**30 and by_name["MI325X"]["mem_bw_gbps"] == 6000
    for name in ("B200-SXM-180GB", "GB200", "MI325X"):
        assert "2024" in by_name[name]["source"]
    for row in rows[:-1]:
        assert row["source"] and row["peak_tflops"]["fp32"] <= min(row["peak_tflops"].values()) + 1e-9
        for alias in row["aliases"]:
            assert get_gpu(alias).name == row["name"]
        assert parse_cluster(f"1x8x{row['name']}").gpu.name == row["name"]


@pytest.mark.parametrize("what, expected", [("models", "llama3.1-405b"), ("clusters", "gb200-nvl72"),
                                            ("gpus", "B200-SXM-180GB")])
def test_the_tables_print(what, expected, capsys):
    assert main(["list", what]) == 0
    out = capsys.readouterr().out
    assert expected in out
    if what == "models":
        assert "405.85B" in out and "8 (top 2)" in out


def test_a_plan_on_the_nvl72_preset_uses_its_72_gpu_nvlink_domain():
    """A listed preset plans: tensor parallelism over 72 GPUs stays on NVLink (one node)."""
    import autoplan

    plans = autoplan.suggest("gpt:num_layers=2,hidden_size=64,num_heads=2,vocab_size=128,max_seq_len=64",
                             "gb200-nvl72", global_batch=72, seq_len=64, top=1)
    assert plans[0].num_gpus == 72 and plans[0].cluster_obj().num_nodes == 1
