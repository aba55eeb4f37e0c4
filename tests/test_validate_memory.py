"""The memory gate on published measured peaks (issue 40): every collected run predicted at no less than
0.95 x its measured peak and none declared out of memory (benchmarks/validate_memory.py,
benchmarks/data/published_memory.json, docs/published-memory.md); the stacks' activation accounting
(cost/memory_stacks.py [Note: memory per stack]); and a collected run through `autoplan.suggest`."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import autoplan
from autoplan import models as zoo
from autoplan.cost.config import ParallelConfig
from autoplan.cost.memory import block_act_bytes
from autoplan.cost.memory_stacks import dense_llama_ffn, loss_backward_factor, stack_saved_bytes
from autoplan.graph.profile import profile_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import validate_memory as vm  # noqa: E402

GIB = 2**30


def _cfg(**fields) -> ParallelConfig:
    base = {"tp": 1, "pp": 1, "dp": 1, "micro_batch_size": 1, "num_microbatches": 1, "schedule": "1f1b"}
    return ParallelConfig(**{**base, **fields})


@pytest.fixture(scope="module")
def rows():
    return vm.memory_rows()


def test_every_collected_peak_passes_the_gate(rows):
    assert len(rows) >= 8
    assert vm.gate_failures(rows) == [], "\n" + vm.format_table(rows)
    assert not any("FALSE-OOM" in r["flags"] for r in rows)


def test_the_table_names_what_it_assumed(rows):
    table = vm.format_table(rows)
    for r in rows:
        assert r["id"] in table
    assert "assumed: recompute, seq" in table  # torchtitan's Table 1 does not state its sequence


def test_the_prediction_never_reads_the_measured_figure():
    row = next(r for r in vm.load_rows() if r["id"] == "tt_h100_l31_8b_fsdp8")
    changed = {**copy.deepcopy(row), "measured_gib": 1.0}
    assert vm.predict_memory(row)[0].total_bytes == vm.predict_memory(changed)[0].total_bytes


def test_the_gate_fails_on_an_under_prediction_and_a_false_oom(tmp_path):
    row = next(r for r in vm.load_rows() if r["id"] == "tt_h100_l31_8b_fsdp8")
    under = {**copy.deepcopy(row), "id": "under", "measured_gib": 200.0}
    small = {**copy.deepcopy(row), "id": "small-gpu", "gpu_mem_gb": 40}
    checked = vm.memory_rows([under, small])
    assert checked[0]["flags"] == ["UNDER"] and "FALSE-OOM" in checked[1]["flags"]
    assert len(vm.gate_failures(checked)) == 2
    data = tmp_path / "rows.json"
    data.write_text(json.dumps({"rows": [under]}))
    assert vm.main(["--data", str(data), "--check"]) == 1
    assert vm.main(["--data", str(tmp_path / "missing.json")]) == 2


def test_a_known_under_row_that_is_fixed_fails_the_gate(rows):
    fixed = [{**r, "flags": []} if r["id"] in vm.KNOWN_UNDER else r for r in rows]
    assert any("remove it from KNOWN_UNDER" in line for line in vm.gate_failures(fixed))


def test_float8_all_gather_is_stated_where_torchtitan_turned_it_on():
    """torchtitan 9dec370 all-gathers Float8 weights only where FSDP shards over dp_shard > 1
    (torchtitan/float8.py), and its 405B config asks for it: each 405B row names the feature exactly
    when its FSDP degree (dp / cp) is above 1, and says why in `assumed`. Under pp that decides whether a
    rank holds its stage's weights in float8 or bf16 all step (the CP 8 row's reason in KNOWN_UNDER)."""
    rows = [r for r in vm.load_rows() if r["id"].startswith("tt_h100_l31_405b")]
    assert len(rows) == 6
    for r in rows:
        on = r["dp"] // r["cp"] > 1
        assert ("float8 all-gather" in r["features"]) == on, r["id"]
        assert r["assumed"]["float8_all_gather"].startswith("on:" if on else "off:"), r["id"]


def _llama_profile(spec: str = "llama3-8b", seq: int = 256):
    model = zoo.build_model(spec)
    info = {k: v for k, v in zoo.model_info(spec).items() if isinstance(v, int)}
    prof, _ = profile_model(model, zoo.example_inputs(spec, 1, seq), loss_fn=zoo.lm_loss,
                            example_target=zoo.example_targets(spec, 1, seq), model_name=spec, info=info)
    return prof


def test_torchtitan_layer_bytes_follow_its_source():
    """Per token of a Llama 3 8B layer (h 4096, d_kv 1024, f 14336, 32 heads) in bf16, torchtitan:
    the norms' inputs and outputs 4 x 2 h, q, repeated k and v, SDPA's output and its contiguous copy
    5 x 2 h, the log-sum-exp 4 x 32, SwiGLU's four tensors 8 f."""
    prof = _llama_profile()
    layer = next(b for b in prof.blocks if b.kind == "layer")
    h, d_kv, f = 4096, 1024, 14336
    assert dense_llama_ffn(prof, layer) == f
    tokens = prof.batch_size * prof.seq_len
    none = stack_saved_bytes("torchtitan", prof, layer, _cfg(recompute="none"))
    assert none == tokens * (8 * h + 10 * h + 4 * 32 + 8 * f)
    selective = stack_saved_bytes("torchtitan", prof, layer, _cfg(recompute="selective"))
    assert selective == tokens * (2 * h + 2 * (h + d_kv + f) + 2 * h + 4 * 32 + 2 * h)
    head = next(b for b in prof.blocks if b.kind == "head")
    assert stack_saved_bytes("torchtitan", prof, head, _cfg()) == tokens * (4 * 128256 + 2 * h)
    assert loss_backward_factor("torchtitan", 1) == 2 and loss_backward_factor("torchtitan", 8) == 3


def test_default_stack_keeps_the_profiled_bytes():
    """autoplan's own runtime (no stack, the default `flash`, any stack not listed) is counted from the
    profile, so tests/test_memory_model.py's bound on the runtime's measured peaks still holds."""
    prof = _llama_profile(seq=128)
    for cfg in (_cfg(recompute="selective"), _cfg(tp=2, recompute="none", sequence_parallel=True)):
        base = block_act_bytes(prof, cfg)
        assert np.array_equal(base, block_act_bytes(prof, cfg, stack="flash"))
        assert np.array_equal(base, block_act_bytes(prof, cfg, stack="megatron-lm-2021"))
        assert not np.array_equal(base, block_act_bytes(prof, cfg, stack="torchtitan"))
    gpt = _llama_profile("gpt2-small", 64)
    assert all(dense_llama_ffn(gpt, b) is None for b in gpt.blocks)


def test_a_collected_run_is_not_refused_by_suggest():
    """Trainy's torchtitan run of Llama 3.1 8B on 32 H200 (docs/published-memory.md), every dimension
    pinned: suggest plans it, and within its GPU, at no less than 0.95 x the measured peak."""
    row = next(r for r in vm.load_rows() if r["id"] == "trainy_h200_l31_8b_fsdp32")
    plans = autoplan.suggest(
        row["model"]["spec"], f"{row['nodes']}x{row['gpus_per_node']}x{row['cluster_kind']}",
        global_batch=row["global_batch"], seq_len=row["seq"], stack=row["stack"], top=1,
        tp=row["tp"], pp=row["pp"], dp=row["dp"], cp=row["cp"], zero=row["zero"], micro_batch_size=row["mbs"],
        recompute=row["recompute"])
    assert plans, "suggest refused a layout that trained"
    plan = plans[0]
    assert (plan.tp, plan.pp, plan.dp, plan.zero, plan.micro_batch_size) == (1, 1, 32, 3, 2)
    assert plan.fits
    peak = plan.predicted.peak_memory_bytes / GIB
    assert vm.UNDER_RATIO * row["measured_gib"] <= peak <= 141


def test_megatron_lm_2023_layer_and_loss_follow_its_source():
    """Megatron-LM of 2023 (the Llama 2 7B rows of pull request #482): Megatron-Core's per-layer count plus two
    one-byte dropout masks of the hidden shape (its default --hidden-dropout 0.1), whole on every tp rank without
    sequence parallelism and split with it; its loss keeps the fp32 softmax over the vocabulary split by tp and the
    output projection's input, and its backward holds half the softmax's bytes more."""
    prof = _llama_profile("llama2-7b", 128)
    layer = next(b for b in prof.blocks if b.kind == "layer")
    head = next(b for b in prof.blocks if b.kind == "head")
    tokens, h, vocab = prof.batch_size * prof.seq_len, 4096, 32000
    for cfg in (_cfg(), _cfg(tp=2), _cfg(tp=2, sequence_parallel=True)):
        core = stack_saved_bytes("megatron-core", prof, layer, cfg)
        masks = 2 * h * tokens / (cfg.tp if cfg.sequence_parallel else 1)
        assert stack_saved_bytes("megatron-lm-2023", prof, layer, cfg) == core + masks
    assert stack_saved_bytes("megatron-lm-2023", prof, head, _cfg(tp=2)) == tokens * (2 * h + 4 * vocab / 2)
    assert stack_saved_bytes("megatron-lm-2023", prof, head, _cfg(tp=2, sequence_parallel=True)) == \
        tokens * (2 * h + 4 * vocab) / 2
    assert loss_backward_factor("megatron-lm-2023", 8) == 0.5


def test_megatron_rows_compare_max_allocated(rows):
    """The Megatron-LM rows measured max allocated: the table says so and prints the prediction without the
    allowance beside the total."""
    mlm = [r for r in rows if r["stack"] == "megatron-lm-2023"]
    assert len(mlm) == 4
    for r in mlm:
        assert r["measured_what"] == "max allocated" and r["allocated_ratio"] < r["ratio"]
        assert vm.UNDER_RATIO <= r["ratio"] <= vm.OVER_TARGET
    assert "(max allocated; alloc " in vm.format_table(mlm)
