"""`--reduce-dtype bfloat16`: FSDP reduces gradients in bf16 (MixedPrecisionPolicy's reduce_dtype).
The plan says so, the cost model prices half the reduce-scatter's bytes, the runtime's reduce-scatters
carry bf16 and train like the fp32 reduction, the exports write it, and what cannot take it is refused
in one line before anything runs."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from _dist import run_ranks

import autoplan
from autoplan.cli import main

MODEL = "llama:num_layers=4,hidden_size=64,num_heads=4,num_kv_heads=2,vocab_size=256,max_seq_len=64"


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_suggest_reduce_dtype_bf16_then_run(tmp_path):
    """The user's path: `autoplan suggest --zero 3 --reduce-dtype bfloat16 --out p.json`, then
    `autoplan run p.json` on 4 gloo ranks."""
    plan_path = tmp_path / "p.json"
    suggest = subprocess.run([sys.executable, "-m", "autoplan", "suggest", "--model", MODEL, "--cluster", "1x4xcpu",
                              "--global-batch", "16", "--seq-len", "64", "--zero", "3", "--reduce-dtype", "bfloat16",
                              "--out", str(plan_path)], capture_output=True, text=True, timeout=240)
    assert suggest.returncode == 0, suggest.stderr[-800:]
    plan = json.loads(plan_path.read_text())
    assert plan["reduce_dtype"] == "bfloat16" and plan["zero"] == 3 and plan["job"]["dtype"] == "bfloat16"
    assert any("gradients reduced in bf16" in note for note in plan["notes"]), plan["notes"]
    run = subprocess.run([sys.executable, "-m", "autoplan", "run", str(plan_path), "--nproc", "4", "--steps", "2"],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and "step 1" in run.stdout, run.stderr[-800:]


def _reduce_run(rank, world_size, plans):
    """Each plan trained 3 steps; the dtypes every reduce-scatter carried, the losses, the gradients'
    dtype after the step."""
    import torch.distributed as dist

    from autoplan.runtime import partition

    # torch 2.13's FSDP2 reduce-scatters through dist.reduce_scatter_single (DefaultReduceScatter).
    original = dist.reduce_scatter_single
    out = []
    for plan in plans:
        carried = set()

        def recording(*args, _carried=carried, **kwargs):
            _carried.add(str(kwargs["input"].dtype if "input" in kwargs else args[1].dtype))
            return original(*args, **kwargs)

        dist.reduce_scatter_single = recording
        try:
            pm = partition(MODEL, plan, device="cpu")
            optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-2)
            template = pm.output_template
            losses = []
            for step in range(3):
                batch = pm.source.batch(step, 0, plan.job.global_batch, plan.job.seq_len, template.shape,
                                        template.dtype)
                loss = pm.step(*batch[0], target=batch[1])
                optimizer.step()
                losses.append(float(loss))
            grads = sorted({str(p.grad.dtype) for p in pm.parameters() if p.grad is not None})
            pm.zero_grad()
        finally:
            dist.reduce_scatter_single = original
        out.append({"carried": sorted(carried), "losses": losses, "grads": grads})
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_bf16_reduction_carries_bf16_and_trains_like_fp32_reduction():
    """The same plan from `autoplan.suggest` with the reduce dtype fp32 and bf16, on 4 gloo ranks:
    the reduce-scatters carry what the plan says, the gradients kept are fp32 either way, and the
    losses agree up to bf16 rounding of the gradient sums."""
    fp32 = autoplan.suggest(MODEL, "1x4xcpu", global_batch=16, seq_len=64, top=1, tp=1, pp=1, zero=3)[0]
    bf16 = dataclasses.replace(fp32, reduce_dtype="bfloat16")
    results = run_ranks(_reduce_run, 4, [fp32, bf16], timeout_s=280)
    for res in results.values():
        as_fp32, as_bf16 = res
        assert as_fp32["carried"] == ["torch.float32"] and as_bf16["carried"] == ["torch.bfloat16"]
        assert as_fp32["grads"] == as_bf16["grads"] == ["torch.float32"]
        assert as_bf16["losses"] == pytest.approx(as_fp32["losses"], rel=2e-2)
        assert as_bf16["losses"][0] == pytest.approx(as_fp32["losses"][0], rel=1e-6)  # same first forward


def test_bf16_reduction_halves_the_priced_reduce_scatter_and_its_buffers():
    """The cost model: the same pinned plan with bf16 reduction spends less on exposed FSDP
    communication (its reduce-scatters move half the bytes) and holds fewer bytes for the gradient
    being reduced; everything else is the same."""
    pins = dict(tp=1, pp=1, dp=16, micro_batch_size=1, schedule="1f1b", recompute="full", zero=3)
    fp32 = autoplan.suggest("llama3-70b", "2x8xH100-80GB", global_batch=64, seq_len=4096, top=1, **pins)[0]
    bf16 = autoplan.suggest("llama3-70b", "2x8xH100-80GB", global_batch=64, seq_len=4096, top=1,
                            reduce_dtype="bfloat16", **pins)[0]
    assert bf16.reduce_dtype == "bfloat16" and fp32.reduce_dtype == "float32"
    exposed = [p.predicted.breakdown["fsdp_comm_exposed_s"] for p in (fp32, bf16)]
    assert exposed[1] < exposed[0]
    assert bf16.predicted.step_time_s < fp32.predicted.step_time_s
    assert bf16.predicted.breakdown["compute_s"] == pytest.approx(fp32.predicted.breakdown["compute_s"])
    assert bf16.predicted.peak_memory_bytes < fp32.predicted.peak_memory_bytes


def test_reduce_scatter_bytes_are_the_reduce_dtype():
    import numpy as np

    from autoplan.cluster import parse_cluster
    from autoplan.cost.comm import fsdp_unit_times_s

    cluster = parse_cluster("4x8xH100-80GB").without_curves()
    ranks = list(range(0, 32, 8))
    params = np.array([1e9])
    _, fp32 = fsdp_unit_times_s(cluster, ranks, [0], params, 2.0, 4.0)
    _, bf16 = fsdp_unit_times_s(cluster, ranks, [0], params, 2.0, 2.0)
    assert bf16[0] == pytest.approx(fp32[0] / 2, rel=1e-3)


@pytest.mark.parametrize("args, expected", [
    (["--zero", "1", "--reduce-dtype", "bfloat16"], "pin --zero 2 or 3"),
    (["--reduce-dtype", "bfloat16"], "pin --zero 2 or 3"),
    (["--zero", "3", "--reduce-dtype", "bfloat16", "--dtype", "float32"], "needs --dtype bfloat16"),
])
def test_reduce_dtype_refusals_are_one_line(args, expected, capsys):
    code = main(["suggest", "--model", MODEL, "--cluster", "1x4xcpu", "--global-batch", "16", "--seq-len", "64",
                 *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and expected in err and "\n" not in err and "Traceback" not in err


def test_a_plan_file_with_bf16_reduction_and_zero_1_is_refused_before_spawning(tmp_path, capsys):
    plan = autoplan.suggest(MODEL, "1x4xcpu", global_batch=16, seq_len=64, top=1, zero=1)[0]
    data = plan.to_dict()
    data["reduce_dtype"] = "bfloat16"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    code = main(["run", str(path), "--nproc", "4", "--steps", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "reduce_dtype bfloat16 needs FSDP" in err and "\n" not in err


def _llama_8b(**pins):
    return autoplan.suggest("llama3-8b", "2x8xH100-80GB", global_batch=512, seq_len=4096, top=1, zero=3, tp=1,
                            dp_replicate=1, **pins)[0]


def test_exports_write_the_bf16_reduction():
    """Megatron-LM's torch FSDP2 (pp 1) reduces the bf16 parameters' gradients in bf16 whatever the flags:
    exact for a bf16-reduce plan, a difference for an fp32 one; its distributed optimizer (what an
    FSDP plan with pp > 1 is written as) takes --grad-reduce-in-bf16. DeepSpeed's
    communication_data_type is the plan's reduce dtype; torchtitan 0.3.0 reduces in fp32 only."""
    from autoplan.report.export import ExportError, export_plan

    plan = _llama_8b(pp=1, reduce_dtype="bfloat16")
    megatron = export_plan(plan, "megatron")
    assert "--use-torch-fsdp2" in megatron.text and "--grad-reduce-in-bf16" not in megatron.text
    fp32 = export_plan(_llama_8b(pp=1), "megatron", allow_approx=True)
    assert any(d.startswith("gradients reduced in fp32") for d in fp32.differences)
    piped = export_plan(_llama_8b(pp=2, reduce_dtype="bfloat16"), "megatron", allow_approx=True).text
    assert "--use-distributed-optimizer" in piped and "--grad-reduce-in-bf16" in piped
    assert '"communication_data_type": "bf16"' in export_plan(plan, "deepspeed", allow_approx=True).text
    assert '"communication_data_type": "fp32"' in export_plan(_llama_8b(pp=1), "deepspeed", allow_approx=True).text
    # torchtitan 0.3.0 reduces in float32 only: said, and refused without --allow-approx.
    with pytest.raises(ExportError, match="mixed_precision_reduce"):
        export_plan(plan, "torchtitan")
    assert any("mixed_precision_reduce" in d for d in export_plan(plan, "torchtitan", allow_approx=True).differences)


def test_no_published_prediction_reads_its_published_step():
    """autoplan/published.py [Note: the reduce dtype a published run implies] (issue 40): the
    Qwen3-235B FSDP row states no reduce dtype, so it takes the stack's default, fp32, although its
    fp32 traffic floor (a diagnostic, by hand below) exceeds its published step. The prediction is
    the same whatever published step the row carries."""
    import dataclasses

    from autoplan.published import STACK_REDUCE_DTYPE, fsdp_traffic_floor_s, load_runs, predict, run_settings

    runs = {r.id: r for r in load_runs()}
    qwen = runs["zoo_q235_tp2_ep8_fsdp"]
    experts_per_rank = 128 // 8 * 3 * 4096 * 1536  # 16 experts of gate, up, down
    by_hand = experts_per_rank * (2 + 2 + 4) * (1 - 1 / 32) * 94 * 4 / 50e9
    floor = fsdp_traffic_floor_s(qwen)
    assert by_hand == pytest.approx(17.6, rel=0.01) and floor > by_hand and floor >= qwen.published_step_s
    assert fsdp_traffic_floor_s(qwen, "bfloat16") == pytest.approx(floor * 6 / 8, rel=1e-9)
    assert STACK_REDUCE_DTYPE == "float32" and "reduce_dtype" not in qwen.pins
    priced = predict(qwen)
    assert priced.plan.reduce_dtype == "float32"
    assert ("reduce", "fp32", "assumed: stack default") in run_settings(qwen, priced.plan)
    for published in (0.5 * qwen.published_step_s, 100.0):
        moved = predict(dataclasses.replace(qwen, published_step_s=published))
        assert moved.step_s == priced.step_s and moved.plan.reduce_dtype == "float32"


def test_a_published_row_that_states_pure_bf16_is_priced_with_bf16_reduction():
    """llm-foundry rows whose precision says `PURE` (Composer's FSDP mixed precision: parameters,
    gradient reduction and buffers in bf16) state their reduce dtype; `DEFAULT` rows state nothing
    about it and keep the stack's fp32."""
    from autoplan.published import load_runs, run_settings

    runs = {r.id: r for r in load_runs()}
    assert runs["mpt_a100_70b_2k_64g"].pins["reduce_dtype"] == "bfloat16"
    assert ("reduce", "bf16", "stated") in run_settings(runs["mpt_a100_70b_2k_64g"])
    assert "reduce_dtype" not in runs["mpt_a100_7b_2k_8g"].pins


@pytest.mark.export
def test_megatron_lm_parses_the_bf16_reduction(tmp_path):
    """Megatron-LM's arguments (the recorded core_v0.16.1 flags) take the export's --grad-reduce-in-bf16."""
    from test_export_megatron import _parse, _sourced_args

    from autoplan.report.export import export_plan

    plan = _llama_8b(pp=2, reduce_dtype="bfloat16")
    ns = _parse(_sourced_args(export_plan(plan, "megatron", allow_approx=True).text, tmp_path))
    assert ns.grad_reduce_in_bf16 and ns.bf16
