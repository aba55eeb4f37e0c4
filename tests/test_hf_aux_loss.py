"""A transformers MoE model built with `output_router_logits=true` trains on transformers' own loss:
cross entropy plus `router_aux_loss_coef` times its routers' load-balancing loss (sources/hf.py,
[Note: HF auxiliary losses]). Its output holds `aux_loss` before `logits`; the source once took the
scalar for the logits (a squared error against a scalar target). Planned with `autoplan suggest
... --out`, run on 4 gloo ranks with `autoplan.partition`, and compared with one process whose loss
is the model's own `model(ids, labels=...)` loss, micro-batch by micro-batch."""

from __future__ import annotations

import pytest
import test_expert_parallel
import torch
from _dist import run_ranks
from test_expert_parallel import check_against_reference
from test_expert_parallel_routed import LAYOUTS, MODELS, _rank_job, _suggest
from test_user_paths import GLOBAL_BATCH

import autoplan
from autoplan.sources import parse_source

SPEC = MODELS["hf-mixtral"] + ",output_router_logits=true"


def _transformers_reference(spec: str, plan, inputs, target):
    """Loss and gradients of the whole model over the plan's micro-batches, the loss being what
    transformers computes with labels (cross entropy + router_aux_loss_coef * aux_loss)."""
    model = parse_source(spec).build("cpu")
    model.train()
    rows = plan.micro_batch_size
    chunks = GLOBAL_BATCH // rows
    total = 0.0
    for k in range(chunks):
        part = [x[k * rows:(k + 1) * rows] if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in inputs]
        labels = target[k * rows:(k + 1) * rows]
        # autoplan's targets are already each position's next token: given as `shift_labels`, which
        # transformers' causal LM loss takes as they are (with `labels` alone it shifts them again).
        out = model(*part, labels=labels, shift_labels=labels)
        assert out.aux_loss is not None and float(out.aux_loss.detach()) > 0
        loss = out.loss / chunks
        loss.backward()
        total += loss.item()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    return model, total, grads


def _check(layouts: list[str], tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(test_expert_parallel, "_reference", _transformers_reference)
    files = {name: tmp_path / f"{name}.json" for name in layouts}
    for name, path in files.items():
        _suggest(SPEC, LAYOUTS[name], path)
    results = run_ranks(_rank_job, 4, SPEC, {n: str(f) for n, f in files.items()}, timeout_s=500, pg_timeout_s=120)
    for name, path in files.items():
        check_against_reference(SPEC, name, autoplan.Plan.load(path), results)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_hf_mixtral_router_aux_loss_at_dp4_ep2_and_cp2_matches_transformers_loss(tmp_path, monkeypatch):
    """pp 1, dp 4, ep 2: the routers run on each rank's tokens before the exchange. cp 2 x ep 2: each
    rank routes its chunks of every sequence, and the loss's share of picks per expert is summed over
    the cp group (sources/hf_loss.py `balance_loss`), so the ranks' losses average to transformers'."""
    _check(["ep2", "cp2-ep2"], tmp_path, monkeypatch)


@pytest.mark.extended
@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_hf_mixtral_router_aux_loss_under_pp2_and_tp2_matches_transformers_loss(tmp_path, monkeypatch):
    """pp 2: the aux loss is computed on the last stage from every layer's router logits, carried
    over the cut; tp 2 with expert tp 1."""
    _check(["ep2-pp2", "ep2-tp2"], tmp_path, monkeypatch)


def test_scalar_outputs_are_never_taken_for_the_logits():
    """The default loss's logits by name, else by shape: a scalar (a loss) is skipped."""
    from autoplan.sources import first_tensor

    logits = torch.zeros(2, 3, 5)
    assert first_tensor((torch.tensor(1.0), logits)) is logits
    assert first_tensor({"aux": torch.tensor(1.0), "scores": logits}) is logits
    assert first_tensor((torch.tensor(2.0),)).dim() == 0  # nothing else: the scalar it is


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_hf_moe_source_loss_is_transformers_loss_with_labels(model_type):
    """One process: the source's loss on the model's output is transformers' own loss with labels
    (router_aux_loss_coef * aux_loss included), the balance loss computed again from the router
    logits (`balance_loss`) equal to transformers' `load_balancing_loss_func`."""
    spec = MODELS["hf-qwen2-moe"] + ",output_router_logits=true"
    if model_type == "qwen3_moe":  # no shared expert
        spec = spec.replace("hf:qwen2_moe:", "hf:qwen3_moe:").replace(",shared_expert_intermediate_size=64", "")
    if model_type == "mixtral":
        spec = SPEC
    source = parse_source(spec)
    model = source.build("cpu")
    inputs, target = source.batch(0, 0, 2, 16, (2, 16, 128), torch.float32)
    with torch.no_grad():
        out = model(*inputs, labels=target, shift_labels=target)
        assert float(out.aux_loss) > 0
        assert float(source.loss_fn(model(*inputs), target)) == pytest.approx(float(out.loss), rel=1e-6)


def test_balance_loss_is_transformers_switch_loss():
    """`balance_loss` over several layers' router logits is transformers' `load_balancing_loss_func`."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from autoplan.sources.hf_loss import balance_loss

    torch.manual_seed(0)
    logits = tuple(torch.randn(48, 8, requires_grad=True) for _ in range(3))
    ours, theirs = balance_loss(logits, 8, 2), load_balancing_loss_func(logits, 8, 2)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
    grads = torch.autograd.grad(ours, logits)
    for g, h in zip(grads, torch.autograd.grad(theirs, logits), strict=True):
        torch.testing.assert_close(g, h)
