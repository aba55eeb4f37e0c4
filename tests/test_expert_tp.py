"""Expert tensor parallelism (`--expert-tp` = tp, runtime/parallel/expert_tp.py [Note: expert tp]): plans from
`autoplan.suggest` with `expert_tp` pinned, run by `autoplan.partition(...).step` on 4 gloo ranks,
against a single-process reference of the whole model: the loss and every gradient, the experts'
slices (by ep index along the experts, by tp index along their hidden units, each half of a fused
projection alike) put back together."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _dist import run_ranks
from test_expert_parallel import reference_and_slices
from test_user_paths import GLOBAL_BATCH, MICRO_BATCH, _full

import autoplan
from autoplan.graph.expert_hidden import hidden_axes
from autoplan.graph.experts import is_routed_experts

SPEC = ("moe:num_layers=4,hidden_size=64,num_heads=4,num_kv_heads=2,ffn_hidden_size=96,vocab_size=256,max_seq_len=64,"
        "num_experts=4,experts_per_token=2,num_shared_experts=1")
DROPLESS = SPEC + ",dropless=true"
MIXTRAL = ("hf:mixtral:num_hidden_layers=2,hidden_size=64,intermediate_size=96,num_attention_heads=4,"
           "num_key_value_heads=2,num_local_experts=4,num_experts_per_tok=2,vocab_size=256,max_position_embeddings=128")
SEQ_LEN = 32
LAYOUTS = {
    # every expert on every rank, its hidden units split over tp 2 (Megatron's ETP = TP, EP 1)
    "etp2-ep1": (SPEC, dict(tp=2, pp=1, dp=2, ep=1, expert_tp=2)),
    # ep groups of 2 replicas at each tp index, each expert's hidden units split over the tp pair
    "etp2-ep2": (SPEC, dict(tp=2, pp=1, dp=2, ep=2, expert_tp=2)),
    "etp2-ep2-dropless": (DROPLESS, dict(tp=2, pp=1, dp=2, ep=2, expert_tp=2)),
    "etp2-ep2-zero3": (DROPLESS, dict(tp=2, pp=1, dp=2, ep=2, expert_tp=2, zero=3)),
    "etp2-ep2-zero1": (SPEC, dict(tp=2, pp=1, dp=2, ep=2, expert_tp=2, zero=1)),
    "mixtral-etp2-ep2": (MIXTRAL, dict(tp=2, pp=1, dp=2, ep=2, expert_tp=2)),
    "etp2-pp2": (DROPLESS, dict(tp=2, pp=2, dp=1, ep=1, expert_tp=2, schedule="1f1b")),
    # zero-bubble's split backward (the all-reduce of the inputs' gradients in the B pass), and cp
    "etp2-pp2-zb": (DROPLESS, dict(tp=2, pp=2, dp=1, ep=1, expert_tp=2, schedule="zb-h1")),
    "etp2-cp2": (DROPLESS, dict(tp=2, pp=1, dp=2, cp=2, ep=1, expert_tp=2)),
}


def _collect(pm, rank: int) -> dict:
    """One step: the loss; the dense gradients of (dp 0, tp 0); every rank's expert slices by (ep
    index, tp index)."""
    plan, template = pm.plan, pm.output_template
    inputs, target = pm.source.batch(0, 0, plan.job.global_batch, plan.job.seq_len, template.shape, template.dtype)
    loss = pm.step(*inputs, target=target)
    experts = {id(p) for p in pm.expert_params}
    grads, slices = {}, {}
    for n, p in pm.named_parameters():
        g = _full(p.grad)  # collective for tp and FSDP shards
        if id(p) in experts:
            slices[n] = ((pm.layout.ep_index, pm.layout.tp_index), g)
        elif pm.layout.dp_index == 0 and pm.layout.tp_index == 0:
            grads[n] = g
    return dict(loss=None if loss is None else float(loss), grads=grads, slices=slices,
                batch=(inputs, target) if rank == 0 else None)


def _rank_job(rank: int, world_size: int, cases: dict) -> dict:
    return {name: _collect(autoplan.partition(spec, plan, device="cpu"), rank) for name, (spec, plan) in cases.items()}


def _whole(model, name: str, parts: dict[tuple[int, int], torch.Tensor], ep: int, etp: int) -> torch.Tensor:
    """An experts parameter from its (ep index, tp index) slices."""
    path, _, leaf = name.rpartition(".")
    module = model.get_submodule(path)
    where = hidden_axes(module, path, etp, is_routed_experts(module))[leaf]
    by_ep = []
    for e in range(ep):
        slices = [parts[(e, t)] for t in range(etp)]
        halves = [torch.cat([s.chunk(where.chunks, where.axis)[c] for s in slices], where.axis)
                  for c in range(where.chunks)]
        by_ep.append(torch.cat(halves, where.axis))
    return torch.cat(by_ep, 0)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_expert_tp_matches_a_single_process_reference():
    cases = {name: (spec, autoplan.suggest(spec, "1x4xcpu", global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, dtype="fp32",
                                           micro_batch_size=MICRO_BATCH, top=1, **pins)[0])
             for name, (spec, pins) in LAYOUTS.items()}
    for name, (_, plan) in cases.items():
        assert (plan.expert_tp, plan.ep, plan.expert_token_split) == (2, LAYOUTS[name][1]["ep"], 1), name
    results = run_ranks(_rank_job, 4, cases, timeout_s=550, pg_timeout_s=120)
    for name, (spec, plan) in cases.items():
        model, ref_grads, grads, pieces = reference_and_slices(spec, name, plan, results)
        for n, parts in pieces.items():
            assert sorted(parts) == [(e, t) for e in range(plan.ep) for t in range(plan.expert_tp)], (name, n)
            grads[n] = _whole(model, n, parts, plan.ep, plan.expert_tp)
        assert set(grads) == set(ref_grads), (name, set(ref_grads) ^ set(grads))
        scale = max(float(g.abs().max()) for g in ref_grads.values())
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-4 * scale,
                                       msg=lambda m, n=n, name=name: f"{name}: {n}: {m}")


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_suggest_expert_tp_then_run(tmp_path):
    """The user's path with their defaults (bf16): `autoplan suggest --tp 2 --ep 2 --expert-tp 2 --out
    p.json`, then `autoplan run p.json` on 4 gloo ranks; the plan says the layout."""
    plan_path = tmp_path / "p.json"
    suggest = subprocess.run([sys.executable, "-m", "autoplan", "suggest", "--model", DROPLESS, "--cluster", "1x4xcpu",
                              "--global-batch", "8", "--seq-len", "32", "--tp", "2", "--ep", "2", "--expert-tp", "2",
                              "--out", str(plan_path)], capture_output=True, text=True, timeout=240)
    assert suggest.returncode == 0, suggest.stderr[-800:]
    plan = json.loads(plan_path.read_text())
    assert (plan["expert_tp"], plan["ep"], plan["tp"]) == (2, 2, 2)
    assert any("expert tp 2" in note for note in plan["notes"]), plan["notes"]
    run = subprocess.run([sys.executable, "-m", "autoplan", "run", str(plan_path), "--nproc", "4", "--steps", "2"],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and "step 1" in run.stdout, run.stderr[-800:]


def _save(rank: int, world_size: int, cases: dict, root: str) -> dict:
    """Two AdamW steps of each plan, then a checkpoint; this rank's expert slices (whole over FSDP)
    by (ep index, tp index)."""
    from autoplan.runtime import checkpoint as ckpt

    out = {}
    for name, (spec, plan) in cases.items():
        pm = autoplan.partition(spec, plan, device="cpu")
        template = pm.output_template
        optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
        for step in range(2):
            inputs, target = pm.source.batch(0, step, plan.job.global_batch, plan.job.seq_len, template.shape,
                                             template.dtype)
            pm.step(*inputs, target=target)
            optimizer.step()
        experts = {id(p) for p in pm.expert_params}
        slices = {n: ((pm.layout.ep_index, pm.layout.tp_index), _full(p).detach().clone())
                  for n, p in pm.named_parameters() if id(p) in experts}
        path = ckpt.save_checkpoint(f"{root}/{name}", 2, pm, optimizer)
        out[name] = dict(path=str(path), slices=slices)
    return out


def _restore(rank: int, world_size: int, cases: dict, path: str) -> dict:
    """The checkpoint restored into each plan: this rank's expert slices, whole over FSDP."""
    from autoplan.runtime import checkpoint as ckpt

    out = {}
    for name, (spec, plan) in cases.items():
        pm = autoplan.partition(spec, plan, device="cpu")
        optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
        ckpt.restore(ckpt.load_checkpoint(path), pm, optimizer, strict=True)
        experts = {id(p) for p in pm.expert_params} or {id(p) for n, p in pm.named_parameters() if ".experts." in n}
        out[name] = {n: ((pm.layout.ep_index, pm.layout.tp_index), _full(p).detach().clone())
                     for n, p in pm.named_parameters() if id(p) in experts}
    torch.distributed.barrier()
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(500)
def test_an_expert_tp_checkpoint_holds_every_expert_whole_and_restores_under_other_layouts(tmp_path):
    """Saved at tp 2 x ep 2 x expert tp 2 (FSDP for the zoo's dropless experts; ZeRO-1 for transformers'
    Mixtral, whose gate_up_proj is fused): the checkpoint holds each experts parameter whole, every
    rank's slice in place (each half of the fused projection in its half); restored at expert tp 1
    (ep 2 folded over tp x dp) and without any expert split, every rank reads its own part."""
    from autoplan.runtime.checkpoint import load_checkpoint

    def plan(spec, **pins):
        return autoplan.suggest(spec, "1x4xcpu", global_batch=8, seq_len=16, dtype="fp32", top=1, **pins)[0]

    saved = {"zoo-zero3": (DROPLESS, plan(DROPLESS, tp=2, pp=1, dp=2, ep=2, expert_tp=2, zero=3)),
             "mixtral-zero1": (MIXTRAL, plan(MIXTRAL, tp=2, pp=1, dp=2, ep=2, expert_tp=2, zero=1))}
    results = run_ranks(_save, 4, saved, str(tmp_path), timeout_s=250, pg_timeout_s=60)
    for name, (spec, _) in saved.items():
        model = autoplan.sources.parse_source(spec).build("meta") if spec.startswith("hf:") else None
        model = model if model is not None else autoplan.models.build_model(spec)
        pieces: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
        for r in results.values():
            for n, (key, t) in r[name]["slices"].items():
                pieces.setdefault(n, {})[key] = t
        ckpt = load_checkpoint(results[0][name]["path"])
        assert pieces
        for n, parts in pieces.items():
            torch.testing.assert_close(ckpt.params[n], _whole(model, n, parts, 2, 2), msg=f"{name}: {n}")
        targets = {"etp1-ep2": (spec, plan(spec, tp=2, pp=1, dp=2, ep=2, zero=1)),
                   "plain": (spec, plan(spec, tp=1, pp=1, dp=4, ep=1, zero=0))}
        restored = run_ranks(_restore, 4, targets, results[0][name]["path"], timeout_s=250, pg_timeout_s=60)
        for target, (_, tplan) in targets.items():
            for r in restored.values():
                assert r[target], (name, target)
                for n, ((ep_index, _), value) in r[target].items():
                    whole = ckpt.params[n]
                    if tplan.ep > 1:  # expert tp 1: position (dp, tp) holds experts position mod ep
                        rows = whole.shape[0] // tplan.ep
                        whole = whole[ep_index * rows:(ep_index + 1) * rows]
                    torch.testing.assert_close(value, whole, msg=f"{name} -> {target}: {n}")


def test_experts_whose_hidden_axis_cannot_be_told_are_refused_in_one_line(tmp_path, capsys):
    """Experts as wide as the model (ffn 64 = hidden 64): `suggest --expert-tp 2` refuses in one line,
    and so does `run` of such a plan before spawning anything."""
    from autoplan.cli import main

    square = SPEC.replace("ffn_hidden_size=96", "ffn_hidden_size=64")
    args = ["suggest", "--model", square, "--cluster", "1x4xcpu", "--global-batch", "8", "--seq-len", "32",
            "--tp", "2"]
    assert main([*args, "--expert-tp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--expert-tp 2: expert tp cannot tell which axis" in err and "use --expert-tp 1" in err and "\n" not in err
    plan_path = tmp_path / "p.json"
    assert main([*args, "--out", str(plan_path)]) == 0
    data = json.loads(plan_path.read_text())
    data["expert_tp"] = 2
    plan_path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["run", str(plan_path), "--nproc", "4", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "expert tp cannot tell which axis" in err and "\n" not in err and "Traceback" not in err


def test_expert_tp_pins_are_checked_before_the_search(capsys):
    from autoplan.cli import main

    base = ["suggest", "--cluster", "1x4xcpu", "--global-batch", "8", "--seq-len", "32"]
    assert main([*base, "--model", SPEC, "--tp", "2", "--expert-tp", "4"]) == 2
    assert "must be 1 or the attention's --tp" in capsys.readouterr().err
    assert main([*base, "--model", "llama:num_layers=2,hidden_size=64,num_heads=4,vocab_size=256,max_seq_len=64",
                 "--tp", "2", "--expert-tp", "2"]) == 2
    assert "needs a mixture-of-experts model" in capsys.readouterr().err
    # ep must divide dp under expert tp = tp (the positions are the replicas), dp pinned or not
    assert main([*base, "--model", SPEC, "--tp", "2", "--dp", "2", "--ep", "4", "--expert-tp", "2"]) == 2
    assert "ep 4 must divide dp = 2 under expert tp 2" in capsys.readouterr().err
    assert main([*base, "--model", SPEC, "--tp", "2", "--pp", "2", "--ep", "2", "--expert-tp", "2"]) == 2
    assert "--ep 2 must divide dp under --expert-tp 2" in capsys.readouterr().err


def test_the_cost_model_prices_expert_tp():
    """On 2 x 8 H100 at tp 8: expert tp 8 keeps 1/8 of every expert's weights per GPU (ep 1) or
    1/(ep x 8) of them, gives each GPU the same expert FLOPs as expert tp 1 with ep (tp splits the work
    either way), and pays an all-reduce of the partial outputs; with ep 2 its all-to-all carries every
    token of the replica from each tp rank, over two nodes, which makes it slow, as it is."""
    from autoplan.cost.config import ParallelConfig
    from autoplan.cost.memory import expert_params, param_counts

    model = ("moe:num_layers=8,hidden_size=2048,num_heads=16,num_kv_heads=8,ffn_hidden_size=1408,vocab_size=32000,"
             "max_seq_len=4096,num_experts=64,experts_per_token=8,dropless=true")
    plans = {name: autoplan.suggest(model, "2x8xH100-80GB", global_batch=256, seq_len=4096, top=1, tp=8, **pins)[0]
             for name, pins in {"ep1": dict(ep=1), "etp8": dict(ep=1, expert_tp=8), "ep2": dict(ep=2),
                                "ep2-etp8": dict(ep=2, expert_tp=8)}.items()}
    profile = autoplan.api.suggest_with_stats(model, "2x8xH100-80GB", global_batch=256, seq_len=4096, top=1,
                                              tp=8, ep=1)[1].profile
    experts = sum(expert_params(profile))
    held = {name: float(param_counts(profile, ParallelConfig.of_plan(p)).sum()) for name, p in plans.items()}
    assert held["ep1"] - held["etp8"] == pytest.approx(experts * (1 - 1 / 8), rel=1e-6)
    assert held["ep1"] - held["ep2-etp8"] == pytest.approx(experts * (1 - 1 / 16), rel=1e-6)
    assert plans["etp8"].predicted.peak_memory_bytes < plans["ep1"].predicted.peak_memory_bytes
    assert plans["etp8"].predicted.breakdown["ep_comm_s"] > 0  # the all-reduce of the partial outputs
    assert plans["etp8"].predicted.hardware_tflops_per_gpu * plans["etp8"].predicted.step_time_s == pytest.approx(
        plans["ep2"].predicted.hardware_tflops_per_gpu * plans["ep2"].predicted.step_time_s, rel=0.02)
    assert plans["ep2-etp8"].predicted.breakdown["ep_comm_s"] > 10 * plans["ep2"].predicted.breakdown["ep_comm_s"]
