"""Exact gradient clipping (issue 41 item 2): `pm.clip_grad_norm_(max_norm)` returns the global norm
`torch.nn.utils.clip_grad_norm_` returns on one process, and clips as it does, in every layout
(runtime/execution/clipping.py [Note: the global gradient norm]).

Through `autoplan.partition` on 2 gloo ranks at tp 2, tp 2 with sequence parallelism, pp 2 with a
tied embedding, dp 2 with ZeRO-1, FSDP (zero 3) and ep 2 (the zoo's mixture of experts): the
returned norm and the clipped gradients are compared (fp32) with torch's `clip_grad_norm_`
- on the partitioned model's own gradients, assembled into whole tensors, within 1e-6: the
  counting (each parameter once over tp, pp, dp, shards, experts and tied copies) is exact;
- on a single process's gradients (the same model, batch and micro-batches), within the tolerance
  the layouts' gradients themselves match one process (1e-5, tp 1e-4: reordered sums).
Then `autoplan suggest --out` / `autoplan run --clip-grad 1.0 --metrics`: the global norm of every
step is recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _dist import run_ranks

import autoplan
from autoplan.graph.aux_loss import aux_loss_scale, recording_aux_losses

LLAMA = "llama:num_layers=2,hidden_size=32,num_heads=4,num_kv_heads=2,vocab_size=64,max_seq_len=16"
GPT = "gpt:num_layers=2,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16"  # ties its head to the embedding
MOE = ("moe:num_layers=2,hidden_size=32,num_heads=4,num_kv_heads=2,ffn_hidden_size=48,vocab_size=64,max_seq_len=16,"
       "num_experts=4,experts_per_token=2,num_shared_experts=1")
GLOBAL_BATCH, MICRO_BATCH, SEQ, VOCAB = 8, 2, 16, 64
MAX_NORM = 1e-2  # below every layout's norm: the gradients are scaled


def _plan(spec: str, **pins):
    return autoplan.suggest(spec, "1x2xcpu", global_batch=GLOBAL_BATCH, seq_len=SEQ, dtype="fp32",
                            micro_batch_size=MICRO_BATCH, top=1, **pins)[0]


def _whole(pm, grads: dict) -> dict:
    """{name: (expert slice or None, full tensor)} of this rank's gradients: tp and FSDP shards
    gathered (collective), the experts' slices by their ep index; None gradients left out."""
    from torch.distributed.tensor import DTensor

    experts = {id(p) for p in pm.expert_params}
    out = {}
    for name, p in pm.named_parameters():
        g = grads[name]
        if g is None:
            continue
        full = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
        out[name] = (pm.layout.ep_index if id(p) in experts else None, full)
    return out


def _rank_job(rank: int, world_size: int, cases: dict) -> dict:
    out = {}
    for name, (spec, plan) in cases.items():
        pm = autoplan.partition(spec, plan, device="cpu")
        pm.make_optimizer(torch.optim.AdamW, lr=1e-3)  # ZeRO-1 / FSDP as `autoplan run` runs them
        template = pm.output_template
        inputs, target = pm.source.batch(0, 0, GLOBAL_BATCH, SEQ, template.shape, template.dtype)
        pm.step(*inputs, target=target)
        before = _whole(pm, {n: p.grad for n, p in pm.named_parameters()})
        norm = pm.clip_grad_norm_(MAX_NORM)
        after = _whole(pm, {n: p.grad for n, p in pm.named_parameters()})
        again = pm.clip_grad_norm_(MAX_NORM)  # the clipped gradients' norm: max_norm (torch's 1e-6 aside)
        out[name] = dict(norm=float(norm), again=float(again), before=before, after=after)
    return out


def _assemble(results: dict, name: str, key: str, ep: int) -> dict:
    """Whole tensors by name over the ranks (the copies of a tensor agree; experts concatenated)."""
    out, pieces = {}, {}
    for r in results.values():
        for n, (index, t) in r[name][key].items():
            if index is None:
                if n in out:
                    torch.testing.assert_close(t, out[n], rtol=0, atol=0, msg=lambda m, n=n: f"{name}: copies of {n}: {m}")
                out[n] = t
            else:
                pieces.setdefault(n, {})[index] = t
    for n, parts in pieces.items():
        assert sorted(parts) == list(range(ep)), (name, n, sorted(parts))
        out[n] = torch.cat([parts[i] for i in range(ep)])
    return out


def _reference(spec: str) -> tuple[float, dict, dict]:
    """One process: the gradients of the first batch over the plans' micro-batches, then torch's
    clip_grad_norm_: (norm, gradients before, gradients after) by name (tied: the first name)."""
    from autoplan.sources import parse_source

    source = parse_source(spec)
    torch.manual_seed(0)
    model = source.build("cpu")
    model.train()
    (ids, *_), target = source.batch(0, 0, GLOBAL_BATCH, SEQ, (GLOBAL_BATCH, SEQ, VOCAB), torch.float32)
    chunks = GLOBAL_BATCH // MICRO_BATCH
    for k in range(chunks):
        rows = slice(k * MICRO_BATCH, (k + 1) * MICRO_BATCH)
        loss = source.loss_fn(model(ids[rows]), target[rows]) / chunks
        with aux_loss_scale(1 / chunks), recording_aux_losses():
            loss.backward()
    before = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    after = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(norm), before, after


def _torch_clip(grads: dict) -> tuple[float, dict]:
    """torch.nn.utils.clip_grad_norm_ on one process over these gradients."""
    params = {}
    for n, g in grads.items():
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params[n] = p
    norm = torch.nn.utils.clip_grad_norm_(params.values(), MAX_NORM)
    return float(norm), {n: p.grad for n, p in params.items()}


CASES = {
    "tp2": (LLAMA, dict(tp=2, pp=1, dp=1)),
    "tp2-sp": (LLAMA, dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    "pp2-tied": (GPT, dict(tp=1, pp=2, dp=1)),
    "dp2-zero1": (LLAMA, dict(tp=1, pp=1, dp=2, zero=1)),
    "dp2-zero3": (LLAMA, dict(tp=1, pp=1, dp=2, zero=3)),
    "ep2": (MOE, dict(tp=1, pp=1, dp=2, ep=2)),
}


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_clip_grad_norm_equals_torch_on_one_process_in_every_layout():
    cases = {name: (spec, _plan(spec, **pins)) for name, (spec, pins) in CASES.items()}
    assert cases["tp2-sp"][1].sequence_parallel and cases["dp2-zero3"][1].zero == 3 and cases["ep2"][1].ep == 2
    results = run_ranks(_rank_job, 2, cases, timeout_s=380, pg_timeout_s=120)
    references = {spec: _reference(spec) for spec in {spec for spec, _ in cases.values()}}
    for name, (spec, plan) in cases.items():
        ref_norm, ref_before, ref_after = references[spec]
        assert ref_norm > 10 * MAX_NORM, (name, ref_norm)  # the clip scales the gradients
        norms = [r[name]["norm"] for r in results.values()]
        assert norms[0] == norms[1], (name, norms)  # every rank returns the same norm
        before = _assemble(results, name, "before", plan.ep)
        after = _assemble(results, name, "after", plan.ep)
        # the partitioned model's gradients under their first names (a tied copy is the same tensor)
        assert set(ref_before) <= set(before), (name, set(ref_before) - set(before))
        before = {n: before[n] for n in ref_before}
        after = {n: after[n] for n in ref_before}
        # exact counting: torch's clip on these very gradients
        torch_norm, torch_after = _torch_clip(before)
        assert norms[0] == pytest.approx(torch_norm, rel=1e-6), (name, norms[0], torch_norm)
        for n in before:
            torch.testing.assert_close(after[n], torch_after[n], rtol=1e-6, atol=1e-12,
                                       msg=lambda m, n=n, name=name: f"{name}: clipped grad {n}: {m}")
        assert results[0][name]["again"] == pytest.approx(MAX_NORM, rel=1e-4), name
        # and a single process's norm and clipped gradients, within the layouts' gradient tolerance
        rtol = 1e-4 if plan.tp > 1 else 1e-5
        assert norms[0] == pytest.approx(ref_norm, rel=rtol), (name, norms[0], ref_norm)
        scale = max(float(g.abs().max()) for g in ref_after.values())
        for n in ref_after:
            torch.testing.assert_close(after[n], ref_after[n], rtol=rtol, atol=rtol * scale,
                                       msg=lambda m, n=n, name=name: f"{name}: clipped grad {n} vs one process: {m}")


def test_clip_grad_norm_refuses_a_max_norm_that_is_not_positive():
    plan = autoplan.suggest(LLAMA, "1x1xcpu", global_batch=GLOBAL_BATCH, seq_len=SEQ, dtype="fp32",
                            micro_batch_size=MICRO_BATCH, top=1)[0]
    pm = autoplan.partition(LLAMA, plan, device="cpu")
    for bad in (0, -1.0, "1", True):
        with pytest.raises(ValueError, match="max_norm must be a number above 0"):
            pm.clip_grad_norm_(bad)


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_run_with_clip_grad_records_the_global_norm_of_every_step(tmp_path):
    plan_path, metrics = tmp_path / "p.json", tmp_path / "m.jsonl"
    made = _cli("suggest", "--model", LLAMA, "--cluster", "1x2xcpu", "--global-batch", "8", "--seq-len", "16", "--dtype", "fp32",
                "--tp", "2", "--pp", "1", "--dp", "1", "--out", str(plan_path))
    assert made.returncode == 0, made.stderr
    ran = _cli("run", str(plan_path), "--nproc", "2", "--steps", "2", "--clip-grad", "1.0", "--metrics", str(metrics))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["grad_norm"] > 0 and r["clip_grad"] == 1.0, r
    assert "grad norm" in ran.stdout, ran.stdout
    bad = _cli("run", str(plan_path), "--nproc", "2", "--steps", "1", "--clip-grad", "0")
    assert bad.returncode == 2 and "--clip-grad" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
