"""fp16 plans run with a dynamic loss scale (runtime/parallel/precision.py [Note: fp16 loss scaling]): the plan
`autoplan suggest --dtype fp16 --out` writes is what `autoplan run` trains; a step's gradients match
an fp32 reference within fp16's tolerance; an overflow on any rank skips the step everywhere and
halves the scale."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _dist import make_plan
from test_runtime_multiproc import GPT, _data
from test_runtime_precision import _reference

from autoplan import models as zoo
from autoplan.cli import main
from autoplan.graph.profile import model_fingerprint
from autoplan.graph.trace import trace_model
from autoplan.runtime.parallel.precision import LossScaler

TINY = "gpt:num_layers=2,hidden_size=64,num_heads=4,vocab_size=256,max_seq_len=32"


def test_an_fp16_plan_from_suggest_trains_and_its_scale_halves_on_an_overflow_of_another_rank(tmp_path, monkeypatch,
                                                                                           capfd):
    plan = tmp_path / "p.json"
    assert main(["suggest", "--model", TINY, "--cluster", "1x2xA100-80GB", "--global-batch", "4", "--seq-len", "32",
                 "--dtype", "fp16", "--pp", "2", "--out", str(plan)]) == 0
    assert json.loads(plan.read_text())["job"]["dtype"] == "float16"
    # Rank 1 (the last stage) alone gets a NaN gradient at step 2; rank 0, which prints, must skip too.
    monkeypatch.setenv("AUTOPLAN_FAULT", "nan@1:2")
    metrics = tmp_path / "m.jsonl"
    capfd.readouterr()
    assert main(["run", str(plan), "--steps", "6", "--metrics", str(metrics)]) == 0
    out, err = capfd.readouterr()
    assert "no CUDA here: the A100-SXM4-80GB plan runs as 2 CPU ranks with gloo" in err or torch.cuda.is_available()
    assert "step 2  skipped: gradient overflow at loss scale 32768; the scale is now 16384" in out, out
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(6))
    assert [r["loss_scale"] for r in records] == [32768.0] * 3 + [16384.0] * 3
    assert records[2]["skipped"] == "gradient overflow" and records[2]["loss"] is None
    losses = [r["loss"] for r in records if r["loss"] is not None]
    assert len(losses) == 5 and all(abs(loss) < 100 for loss in losses)
    assert losses[-1] < losses[0] - 0.05, losses  # AdamW at lr 1e-3 on one repeated batch distribution


def test_an_fp16_step_gives_fp32_gradients_within_fp16_tolerance():
    from autoplan.runtime import partition

    model = zoo.build_model(GPT, device="meta")
    ids, tgt = _data(64, 8)
    traced = trace_model(model, (ids[:2],))
    plan = make_plan(GPT, model_fingerprint(model), traced.block_names, pp=1, dtype="float16")
    pm = partition(GPT, plan, device="cpu")
    loss = pm.step(ids, target=tgt)
    assert pm.executor.grad_scale == pm.loss_scaler.scale == 2.0**15  # the backward was scaled
    ref_loss, ref_grads = _reference(GPT, plan, torch.float32)
    assert float(loss) == pytest.approx(ref_loss, rel=5e-3)
    assert {p.dtype for _, p in pm.named_parameters()} == {torch.float32}  # the masters
    assert {p.dtype for s in pm.stages.values() for p in s.params} == {torch.float16}  # the working copies
    assert not pm.nonfinite_stages()
    for name, p in pm.named_parameters():
        # Unscaled (a missed 1 / 2**15 would be off by 4 orders), and within fp16's 2**-11 rounding
        # compounded over 4 layers: 2 % of the largest element.
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=2e-2, atol=2e-2 * scale, msg=lambda m, n=name: f"{n}: {m}")


def test_fp16_clipping_reads_the_unscaled_gradients_and_a_non_finite_norm_is_returned_as_such():
    """Issue 41 item 2: under fp16 the global norm is the unscaled gradients' (pm.step unscales
    before it returns), equal to torch's clip_grad_norm_ over the same fp32 master gradients, and
    a non-finite gradient gives a non-finite norm (`autoplan run` then skips the step)."""
    from autoplan.runtime import partition

    model = zoo.build_model(GPT, device="meta")
    ids, tgt = _data(64, 8)
    traced = trace_model(model, (ids[:2],))
    plan = make_plan(GPT, model_fingerprint(model), traced.block_names, pp=1, dtype="float16")
    pm = partition(GPT, plan, device="cpu")
    pm.step(ids, target=tgt)
    assert pm.loss_scaler.scale == 2.0**15
    _, ref_grads = _reference(GPT, plan, torch.float32)
    mine = {n: p.grad.detach().clone() for n, p in pm.named_parameters() if p.grad is not None}
    # the fp32 reference's norm over the same parameters (a tied weight once, under its first name)
    ref_norm = float(torch.linalg.vector_norm(torch.stack([ref_grads[n].norm() for n in mine])))
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in mine.values()]
    for p, g in zip(params, mine.values()):
        p.grad = g.clone()
    max_norm = ref_norm / 4  # below the norm: the gradients are scaled
    torch_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    norm = float(pm.clip_grad_norm_(max_norm))
    assert norm == pytest.approx(torch_norm, rel=1e-6)
    assert norm == pytest.approx(ref_norm, rel=2e-2)  # unscaled: a missed 1 / 2**15 is off by 4 orders
    for (name, p), expected in zip(((n, p) for n, p in pm.named_parameters() if p.grad is not None), params):
        torch.testing.assert_close(p.grad, expected.grad, rtol=1e-6, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    next(p for _, p in pm.named_parameters() if p.grad is not None).grad[0].fill_(float("inf"))
    assert not math.isfinite(float(pm.clip_grad_norm_(max_norm)))


def test_the_loss_scale_backs_off_on_overflow_grows_after_good_steps_and_stops_at_one():
    scaler = LossScaler(8.0, growth_interval=3)
    scaler.update(overflow=True)
    assert scaler.scale == 4.0 and scaler.good_steps == 0
    for _ in range(2):
        scaler.update(overflow=False)
    assert scaler.scale == 4.0
    scaler.update(overflow=False)
    assert scaler.scale == 8.0 and scaler.good_steps == 0
    for _ in range(5):
        scaler.update(overflow=True)
    assert scaler.scale == 1.0 and scaler.at_minimum  # an overflow at 1 is a non-finite gradient
    grads = [torch.full((3,), 6.0), torch.full((2,), -2.0)]
    LossScaler(2.0).unscale_(grads)
    assert grads[0].tolist() == [3.0] * 3 and grads[1].tolist() == [-1.0] * 2
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert (restored.scale, restored.good_steps) == (1.0, 0)


@pytest.mark.extended
def test_a_resumed_fp16_run_goes_on_at_its_loss_scale(tmp_path, monkeypatch, capfd):
    plan = tmp_path / "p.json"
    assert main(["suggest", "--model", TINY, "--cluster", "1x2xA100-80GB", "--global-batch", "4", "--seq-len", "32",
                 "--dtype", "fp16", "--pp", "2", "--out", str(plan)]) == 0
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    monkeypatch.setenv("AUTOPLAN_FAULT", "nan@0:1")
    assert main(["run", str(plan), "--steps", "3", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"]) == 0
    monkeypatch.delenv("AUTOPLAN_FAULT")
    assert main(["run", str(plan), "--steps", "5", "--checkpoint-dir", str(ckpt), "--resume",
                 "--metrics", str(metrics)]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["step"], r["loss_scale"]) for r in records] == [(3, 16384.0), (4, 16384.0)]


def test_the_loss_scale_never_grows_past_what_the_fp16_loss_gradient_can_hold():
    """The gradient handed to the fp16 loss is the scale itself: at 2**16 (> 65504) it is inf on
    every step, so growth stops at 2**15 ([Note: fp16 loss scaling])."""
    scaler = LossScaler(growth_interval=1)
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 2.0**15
    assert torch.isfinite(torch.tensor(scaler.scale, dtype=torch.float16))
    assert not torch.isfinite(torch.tensor(scaler.scale * scaler.growth_factor, dtype=torch.float16))
