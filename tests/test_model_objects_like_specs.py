"""A transformers model passed as an object plans and runs as its `hf:` spec does (issue 41 item 8;
sources/hf_object.py [Note: transformers objects as hf: sources]): `autoplan.suggest(model, ...)`
gives the spec's plan at cp 2, ep 2 and ep 2 x expert tp 2, and `autoplan.partition(model,
plan).step` on gloo ranks gives the loss of the object itself on one process, with the object's
own weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dist import run_ranks

import autoplan

transformers = pytest.importorskip("transformers")

_SIZES = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
              vocab_size=128, max_position_embeddings=64)
_MOE = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=64)}
SEQ_LEN, GLOBAL_BATCH = 16, 4


def _spec(kind: str) -> str:
    fields = {**_SIZES, **_MOE.get(kind, {})}
    return f"hf:{kind}:" + ",".join(f"{k}={v}" for k, v in fields.items())


def _model(kind: str) -> torch.nn.Module:
    """The object, with weights of its own (seeded, so every rank builds the same)."""
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                                 "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
                                 "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM)}[kind]
    torch.manual_seed(1234)
    return model_class(config_class(**_SIZES, **_MOE.get(kind, {})))


def _suggest(model, cluster: str, **pins):
    return autoplan.suggest(model, cluster, global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, dtype="fp32", top=1,
                            **pins)[0]


LAYOUTS = {  # name: (model, cluster, pins)
    "llama-cp2": ("llama", "1x2xcpu", dict(cp=2)),
    "qwen2-cp2": ("qwen2", "1x2xcpu", dict(cp=2)),
    "mixtral-ep2": ("mixtral", "1x2xcpu", dict(ep=2)),
    "mixtral-ep2-etp2": ("mixtral", "1x4xcpu", dict(tp=2, dp=2, pp=1, ep=2, expert_tp=2)),
    "qwen2-moe-cp2-ep2": ("qwen2_moe", "1x4xcpu", dict(cp=2, ep=2, dp=4, tp=1, pp=1)),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_an_object_is_planned_as_its_hf_spec(name):
    kind, cluster, pins = LAYOUTS[name]
    of_object, of_spec = _suggest(_model(kind), cluster, **pins), _suggest(_spec(kind), cluster, **pins)
    assert of_object.model == type(_model(kind)).__name__
    for key, value in pins.items():
        assert getattr(of_object, key) == value
    assert dataclasses.replace(of_object, model=of_spec.model) == of_spec


def test_example_inputs_without_positions_keep_cp_off_in_one_line():
    ids = torch.zeros(1, SEQ_LEN, dtype=torch.long)
    with pytest.raises(ValueError, match="its example inputs give no position_ids; pass LlamaForCausalLM without "
                                         "example_inputs") as info:
        _suggest(_model("llama"), "1x2xcpu", cp=2, example_inputs=(ids,))
    assert "\n" not in str(info.value)
    positions = torch.arange(SEQ_LEN).unsqueeze(0)  # given with the positions, cp is offered
    assert _suggest(_model("llama"), "1x2xcpu", cp=2, example_inputs=(ids, None, positions)).cp == 2


def test_an_object_its_config_does_not_rebuild_is_planned_as_given():
    model = _model("llama")
    model.lm_head = torch.nn.Linear(_SIZES["hidden_size"], 100, bias=False)  # a head the config does not record
    with pytest.raises(ValueError, match=r"LlamaForCausalLM is not the model its config builds \('lm_head.weight': "
                                         r"\(100, 32\) here, \(128, 32\) from the config\); pass example_inputs"):
        _suggest(model, "1x2xcpu")
    ids = torch.zeros(1, SEQ_LEN, dtype=torch.long)
    plan = _suggest(model, "1x2xcpu", example_inputs=(ids,))  # a plain module, as before
    assert plan.model == "LlamaForCausalLM" and plan.cp == 1


def _batch(seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, _SIZES["vocab_size"], (GLOBAL_BATCH, SEQ_LEN), generator=gen)
    target = torch.randint(0, _SIZES["vocab_size"], (GLOBAL_BATCH, SEQ_LEN), generator=gen)
    return ids, target


def _rank_losses(rank: int, world_size: int, cases: dict) -> dict:
    ids, target = _batch()
    positions = torch.arange(SEQ_LEN).expand(GLOBAL_BATCH, SEQ_LEN)
    out = {}
    for name, (kind, plan) in cases.items():
        pm = autoplan.partition(_model(kind), plan, device="cpu")
        inputs = (ids, None, positions) if "position_ids" in pm.input_names else (ids,)
        loss = pm.step(*inputs, target=target)
        out[name] = None if loss is None else float(loss)
    return out


def _reference_loss(kind: str) -> float:
    """The object's own forward (transformers' attention, its mask) on one process, mean cross entropy."""
    ids, target = _batch()
    with torch.no_grad():
        logits = _model(kind)(ids).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_objects_at_cp2_and_ep2_give_the_single_process_loss():
    cases = {name: (LAYOUTS[name][0], _suggest(_model(LAYOUTS[name][0]), LAYOUTS[name][1], **LAYOUTS[name][2]))
             for name in ("llama-cp2", "mixtral-ep2")}
    assert cases["llama-cp2"][1].cp == 2 and cases["mixtral-ep2"][1].ep == 2
    results = run_ranks(_rank_losses, 2, cases, timeout_s=240, pg_timeout_s=120)
    for name, (kind, _) in cases.items():
        reference = _reference_loss(kind)
        losses = [r[name] for r in results.values() if r[name] is not None]
        assert losses and all(loss == pytest.approx(reference, rel=1e-6) for loss in losses), (name, losses, reference)


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(300)
def test_an_object_at_ep2_by_expert_tp2_gives_the_single_process_loss():
    kind, cluster, pins = LAYOUTS["mixtral-ep2-etp2"]
    cases = {"mixtral-ep2-etp2": (kind, _suggest(_model(kind), cluster, **pins))}
    results = run_ranks(_rank_losses, 4, cases, timeout_s=240, pg_timeout_s=120)
    losses = [r["mixtral-ep2-etp2"] for r in results.values() if r["mixtral-ep2-etp2"] is not None]
    assert losses and all(loss == pytest.approx(_reference_loss(kind), rel=1e-5) for loss in losses)
