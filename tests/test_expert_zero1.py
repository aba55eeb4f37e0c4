"""ZeRO-1 with expert parallelism (issue 31): the dense parameters' optimizer state split over the dp
group, the experts' over the replicas holding the same experts (runtime/parallel/optimizer.py, as Megatron-LM's
distributed optimizer uses its expert-data-parallel group). Through `autoplan.partition` on 4 gloo
ranks against one process: the loss, every gradient, and the parameters after two AdamW steps; and
through `autoplan suggest --ep 2 --zero 1 --out` / `autoplan run`: the losses of two steps."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _dist import run_ranks
from test_user_paths import _full

import autoplan
from autoplan.graph.aux_loss import aux_loss_scale, recording_aux_losses

SPEC = ("moe:num_layers=2,hidden_size=32,num_heads=4,num_kv_heads=2,ffn_hidden_size=48,vocab_size=64,max_seq_len=16,"
        "num_experts=4,experts_per_token=2,num_shared_experts=1")
GLOBAL_BATCH, MICRO_BATCH, SEQ, LR, STEPS = 8, 2, 16, 1e-3, 2  # LR: `autoplan run`'s


def _plan(**pins):
    return autoplan.suggest(SPEC, "1x4xcpu", global_batch=GLOBAL_BATCH, seq_len=SEQ, dtype="fp32",
                            micro_batch_size=MICRO_BATCH, top=1, **pins)[0]


def _whole(pm, plan, values: dict) -> dict:
    """{name: (ep index or None, full tensor)}: this rank's expert slices, and the dense parameters on
    dp rank 0 at tp index 0; collective (tp shards are gathered)."""
    experts = {id(p) for p in pm.expert_params}
    whole = [(n, id(p), _full(v)) for n, p, v in ((n, p, values[n]) for n, p in pm.named_parameters())]
    first = pm.layout.dp_index == 0 and pm.layout.tp_index == 0
    return {n: (pm.layout.ep_index, t) for n, i, t in whole if i in experts} | (
        {n: (None, t) for n, i, t in whole if i not in experts} if first else {})


def _rank_job(rank: int, world_size: int, plans: dict) -> dict:
    from autoplan.runtime.checkpoint import local_optimizer

    out = {}
    for name, plan in plans.items():
        pm = autoplan.partition(SPEC, plan, device="cpu")
        template = pm.output_template
        optimizer = pm.make_optimizer(torch.optim.AdamW, lr=LR)
        losses, grads = [], {}
        for step in range(STEPS):
            inputs, target = pm.source.batch(0, step, GLOBAL_BATCH, SEQ, template.shape, template.dtype)
            loss = pm.step(*inputs, target=target)
            losses.append(None if loss is None else float(loss))
            if step == 0:
                grads = _whole(pm, plan, {n: p.grad for n, p in pm.named_parameters()})
            optimizer.step()
        params = _whole(pm, plan, dict(pm.named_parameters()))
        state = local_optimizer(optimizer).state
        experts = {id(p) for p in pm.expert_params}
        held = {kind: sum(s["exp_avg"].numel() for p, s in state.items() if (id(p) in experts) == kind)
                for kind in (True, False)}
        total = {kind: sum(p.numel() for p in pm.parameters() if (id(p) in experts) == kind) for kind in (True, False)}
        out[name] = dict(losses=losses, grads=grads, params=params, held=held, total=total,
                         optimizer=type(optimizer).__name__, ep_index=pm.layout.ep_index,
                         where=(pm.layout.pp_index, pm.layout.tp_index))
    return out


def _reference(plan, spec: str = SPEC, vocab: int = 64) -> tuple[list[float], dict, dict]:
    """AdamW on one process over the plan's micro-batches: each step's loss (with the load-balancing
    term), the first step's gradients and the parameters after the last step."""
    from autoplan.sources import parse_source

    source = parse_source(spec)
    torch.manual_seed(0)
    model = source.build("cpu")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    chunks = GLOBAL_BATCH // MICRO_BATCH
    losses, grads = [], {}
    for step in range(STEPS):
        # the token ids first (a transformers source also feeds position ids, arange here: no cp)
        (ids, *_), target = source.batch(0, step, GLOBAL_BATCH, SEQ, (GLOBAL_BATCH, SEQ, vocab), torch.float32)
        total = 0.0
        for k in range(chunks):
            rows = slice(k * MICRO_BATCH, (k + 1) * MICRO_BATCH)
            loss = source.loss_fn(model(ids[rows]), target[rows]) / chunks
            with aux_loss_scale(1 / chunks), recording_aux_losses() as aux:
                loss.backward()
            total += loss.item() + sum(float(a) for a in aux)
        losses.append(total)
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _assemble(results: dict, name: str, key: str, ep: int) -> dict:
    """The full tensors of `key` over the ranks: experts' slices concatenated in ep order."""
    out, pieces = {}, {}
    for r in results.values():
        for n, (index, t) in r[name][key].items():
            if index is None:
                out[n] = t
            else:  # the ranks holding the same experts agree
                if index in pieces.get(n, {}):
                    torch.testing.assert_close(t, pieces[n][index], msg=lambda m, n=n: f"{name}: copies of {n}: {m}")
                pieces.setdefault(n, {})[index] = t
    assert pieces or ep == 1, f"{name}: no expert parameters were split"
    for n, parts in pieces.items():
        assert sorted(parts) == list(range(ep)), (name, n, sorted(parts))
        out[n] = torch.cat([parts[i] for i in range(ep)])
    return out


def _check(plans: dict) -> None:
    results = run_ranks(_rank_job, 4, plans, timeout_s=170, pg_timeout_s=60)
    for name, plan in plans.items():
        ref_losses, ref_grads, ref_params = _reference(plan)
        losses = [r[name]["losses"] for r in results.values() if None not in r[name]["losses"]]
        assert losses and all(lo == pytest.approx(ref_losses, rel=1e-5) for lo in losses), (name, losses, ref_losses)
        grads, params = (_assemble(results, name, key, plan.ep) for key in ("grads", "params"))
        assert set(grads) == set(ref_grads) == set(params), (name, set(ref_grads) ^ set(grads))
        scale = max(float(g.abs().max()) for g in ref_grads.values())
        rtol = 1e-4 if plan.tp > 1 else 1e-5  # tp's reordered sums
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=rtol, atol=rtol * scale,
                                       msg=lambda m, n=n, name=name: f"{name}: grad {n}: {m}")
        for n, p in params.items():  # two AdamW steps of lr each: the same update (Adam's m / sqrt(v)
            # amplifies tp's rounding where a gradient is near zero)
            torch.testing.assert_close(p, ref_params[n], rtol=1e-5, atol=(1e-2 if plan.tp > 1 else 1e-3) * LR,
                                       msg=lambda m, n=n, name=name: f"{name}: param {n}: {m}")
        if plan.zero != 1:
            continue
        # The state: the dense parameters' split over all dp ranks, the experts' over the ranks
        # holding the same experts: the dp / ep replicas, and under tp (expert tp 1: whole experts on
        # every tp rank, each computing its own tokens) their tp ranks too, Megatron-LM's
        # expert-data-parallel group (one rank: all of its experts' state).
        for r in results.values():
            assert r[name]["optimizer"] == "ZeroOneOptimizer", name
        for where in {r[name]["where"] for r in results.values()}:  # each (pp, tp) coordinate's dp group
            ranks = [r[name] for r in results.values() if r[name]["where"] == where]
            dense = [r["held"][False] for r in ranks]
            assert sum(dense) == ranks[0]["total"][False] and all(dense), (name, dense)
        for stage in {r[name]["where"][0] for r in results.values()}:
            for index in range(plan.ep if plan.ep > 1 else 0):
                group = [r[name] for r in results.values() if r[name]["where"][0] == stage
                         and r[name]["ep_index"] == index]
                shares = [g["held"][True] for g in group]
                assert sum(shares) == group[0]["total"][True] and all(shares), (name, index, shares)


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_zero_1_with_ep_2_matches_a_single_process_and_splits_the_expert_state_over_the_expert_replicas():
    """ep 2 x dp 4: two ep groups, so each expert's state is split over the 2 replicas holding it."""
    plan = _plan(tp=1, pp=1, dp=4, ep=2, zero=1)
    assert (plan.ep, plan.zero, plan.dp) == (2, 1, 4)
    _check({"ep2-zero1": plan})


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(300)
def test_zero_1_with_ep_4_and_with_tp_2_match_a_single_process():
    """ep = dp (each rank owns its experts' whole state), ep 2 x tp 2 (each tp rank's dp group) and
    ep 2 x pp 2 (each pipeline rank's experts)."""
    _check({"ep4-zero1": _plan(tp=1, pp=1, dp=4, ep=4, zero=1), "ep2-tp2-zero1": _plan(tp=2, pp=1, dp=2, ep=2, zero=1),
            "ep2-pp2-zero1": _plan(tp=1, pp=2, dp=2, ep=2, zero=1)})


def suggest_and_run(tmp_path, *pins: str, spec: str = SPEC, vocab: int = 64) -> dict:
    """`autoplan suggest ... --out`, then `autoplan run --nproc 4`: the plan, after checking that the
    printed losses are those of one process."""
    plan_file = tmp_path / "plan.json"
    result = subprocess.run([sys.executable, "-m", "autoplan", "suggest", "--model", spec, "--cluster", "1x4xcpu",
                             "--global-batch", str(GLOBAL_BATCH), "--seq-len", str(SEQ), "--dtype", "fp32",
                             "--micro-batch-size", str(MICRO_BATCH), *pins, "--out", str(plan_file)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    run = subprocess.run([sys.executable, "-m", "autoplan", "run", str(plan_file), "--nproc", "4", "--steps", str(STEPS)],
                         capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [float(line.split()[3]) for line in run.stdout.splitlines() if line.startswith("step ")]
    losses, _, _ = _reference(autoplan.Plan.load(plan_file), spec, vocab)
    assert printed == pytest.approx(losses, abs=2e-4), (printed, losses)
    return json.loads(plan_file.read_text())


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(200)
def test_suggest_then_run_ep_2_zero_1_prints_the_single_process_losses(tmp_path):
    plan = suggest_and_run(tmp_path, "--dp", "4", "--ep", "2", "--zero", "1")
    assert (plan["ep"], plan["zero"], plan["dp"]) == (2, 1, 4)


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["hf-mixtral", "hf-qwen2-moe", "hf-deepseek-v3"])
def test_suggest_then_run_transformers_moe_at_ep_2_zero_1_prints_the_single_process_losses(model, tmp_path):
    """Transformers' routed experts under the distributed optimizer: two AdamW steps through
    `autoplan run` print the losses of one process."""
    from test_expert_parallel_routed import MODELS

    plan = suggest_and_run(tmp_path, "--dp", "4", "--ep", "2", "--zero", "1", spec=MODELS[model], vocab=128)
    assert (plan["ep"], plan["zero"], plan["dp"]) == (2, 1, 4)
