"""Context parallelism for attention SDPA cannot compute: Gemma 2's soft-capped logits, the sliding
windows of Gemma 2/3 and GPT-OSS (alternating with full layers), and GPT-OSS's attention sinks,
through autoplan's attention operator (models/windowed_attention.py), which the cp runtime calls
per local chunk with the chunk's true position (runtime/parallel/context.py). Each window (6 tokens) is
shorter than the sequence (32) and than a rank's share of it, and crosses the chunk boundaries.

Plans from `autoplan suggest --cp 2 ... --out p.json`, run by `autoplan.partition(spec, "p.json").step`
on 4 gloo ranks (and one through `autoplan run`), against a single-process reference of the whole
model: loss and every gradient (the helpers of tests/test_context_parallel_models.py). The operator
itself is checked against transformers' own eager attention, values and gradients."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _cli import run_main
from _dist import run_ranks
from _rank_compare import assert_ranks_match_reference
from test_context_parallel_models import SEQ_LEN, _rank_job
from test_user_paths import GLOBAL_BATCH, MICRO_BATCH, _reference

import autoplan
from autoplan.sources import parse_source

_HF = ("num_hidden_layers=2,hidden_size=32,num_attention_heads=4,num_key_value_heads=2,intermediate_size=64,"
       "vocab_size=128,max_position_embeddings=64,head_dim=8,sliding_window=6")
MODELS = {
    # sliding then full layers (layer_types), soft-capped logits (default 50; 2 here, so it bites)
    "gemma2": f"hf:gemma2:{_HF},attn_logit_softcapping=2.0",
    # both layers sliding (its default pattern: 5 sliding, then 1 full), rotary per layer kind
    "gemma3": f"hf:gemma3_text:{_HF}",
    # alternating sliding / full layers, a sink per head, routed experts (no capacity)
    "gpt-oss": f"hf:gpt_oss:{_HF},num_local_experts=4,num_experts_per_tok=2",
}
LAYOUTS = {"cp2": ["--tp", "1", "--cp", "2", "--dp", "4", "--pp", "1"],
           "cp2-pp2": ["--tp", "1", "--cp", "2", "--dp", "2", "--pp", "2"],
           "cp2-tp2": ["--tp", "2", "--cp", "2", "--dp", "2", "--pp", "1"]}  # the operator on DTensor heads


def _suggest(spec: str, layout: str, out: Path) -> Path:
    result = run_main("suggest", "--model", spec, "--cluster", "1x4xcpu", "--global-batch", str(GLOBAL_BATCH),
                      "--seq-len", str(SEQ_LEN), "--micro-batch-size", str(MICRO_BATCH), "--dtype", "fp32",
                      *LAYOUTS[layout], *(["--ep", "1"] if "gpt_oss" in spec else []), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["cp"] == 2
    return out


def _check(cases: dict, tmp_path: Path) -> None:
    """`cases`: name -> (model, layout); each planned by the CLI, run on 4 ranks, checked."""
    planned = {name: (MODELS[model], str(_suggest(MODELS[model], layout, tmp_path / f"{name}.json")))
               for name, (model, layout) in cases.items()}
    results = run_ranks(_rank_job, 4, planned, timeout_s=500, pg_timeout_s=120)
    for name, (spec, path) in planned.items():
        plan = autoplan.Plan.load(path)
        inputs, target = results[0][name]["batch"]
        model, ref_loss, ref_grads = _reference(spec, plan, inputs, target)
        assert_ranks_match_reference(name, results, model, ref_loss, ref_grads, rtol=1e-4 if plan.tp > 1 else 1e-5)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_gemma2_and_gpt_oss_at_cp2_and_cp2_pp2_match_a_single_process(tmp_path):
    _check({"gemma2-cp2": ("gemma2", "cp2"), "gpt-oss-cp2-pp2": ("gpt-oss", "cp2-pp2")}, tmp_path)


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(600)
def test_gpt_oss_at_cp2_tp2_matches_a_single_process(tmp_path):
    """cp inside tp: the operator's cp call on this rank's heads and their sinks (context.py `_windowed_by_hook`)."""
    _check({"gpt-oss-cp2-tp2": ("gpt-oss", "cp2-tp2")}, tmp_path)


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_every_family_at_cp2_and_cp2_pp2_matches_a_single_process(tmp_path):
    _check({"gemma2-cp2-pp2": ("gemma2", "cp2-pp2"), "gemma3-cp2": ("gemma3", "cp2"),
            "gemma3-cp2-pp2": ("gemma3", "cp2-pp2"), "gpt-oss-cp2": ("gpt-oss", "cp2")}, tmp_path)


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(300)
def test_gemma3_at_cp2_through_autoplan_run(tmp_path):
    path = _suggest(MODELS["gemma3"], "cp2", tmp_path / "p.json")
    run = subprocess.run([sys.executable, "-m", "autoplan", "run", str(path), "--steps", "2"], capture_output=True,
                         text=True, timeout=280)
    assert run.returncode == 0 and "step 1" in run.stdout, run.stderr[-2000:]


@pytest.mark.parametrize("model", list(MODELS))
def test_the_attention_is_transformers_own_eager_attention(model):
    """Logits and every gradient of the model built for cp (autoplan's operator) equal those of the
    same weights under transformers' eager attention (the soft-capping, window and sinks written
    out there as a mask and a softmax), and the window and sinks change the result (they bite)."""
    source = parse_source(MODELS[model])
    built = source.build("cpu")
    config = source.config
    assert config._attn_implementation == "autoplan_causal" and "sliding_attention" in config.layer_types
    config._attn_implementation = "eager"
    eager = type(built)(config)
    eager.load_state_dict(built.state_dict())
    torch.manual_seed(0)
    for layer in (*built.model.layers, *eager.model.layers):
        if hasattr(layer.self_attn, "sinks"):  # initialized to zero: make them differ per head
            layer.self_attn.sinks.data = torch.linspace(-1.0, 1.0, layer.self_attn.sinks.numel())
    ids = torch.randint(0, 128, (2, SEQ_LEN))
    logits = built(ids).logits
    reference = eager(ids).logits
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    (reference * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    for (name, p), q in zip(built.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5 * float(q.grad.abs().max()), msg=name)
    config.sliding_window = SEQ_LEN
    wide = type(built)(config)
    wide.load_state_dict(eager.state_dict())
    assert not torch.allclose(wide(ids).logits, reference, atol=1e-3)


def test_attention_with_a_window_softcap_and_sinks_matches_its_math_at_any_offset():
    """The operator at a query offset (a cp chunk against the keys from its window's first) equals
    the same rows of the whole sequence's attention; and its gradients the written-out math's (float64)."""
    from autoplan.models.windowed_attention import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(3, dtype=torch.float64, requires_grad=True)
    options = dict(scale=0.7, window=5, softcap=3.0)

    def math(q, k, v, sinks):
        n = q.shape[-2]
        s = 3.0 * torch.tanh(q @ k.transpose(-2, -1) * 0.7 / 3.0)
        i, j = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
        s = s.masked_fill(~((j <= i) & (j > i - 5)), float("-inf"))
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
        return s.softmax(-1)[..., :-1] @ v

    whole = attention(q, k, v, sinks=sinks, **options)
    torch.testing.assert_close(whole, math(q, k, v, sinks))
    # rows 10..15 against keys 6..15 (the window's first key of row 10 is 6)
    part = attention(q[:, :, 10:], k[:, :, 6:], v[:, :, 6:], sinks=sinks, offset=4, **options)
    torch.testing.assert_close(part, whole[:, :, 10:])
    grad = torch.randn_like(whole)
    ours = torch.autograd.grad((whole * grad).sum(), (q, k, v, sinks))
    theirs = torch.autograd.grad((math(q, k, v, sinks) * grad).sum(), (q, k, v, sinks))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)
    small = [t[:1, :2, :7, :3].detach().requires_grad_() for t in (q, k, v)] + [sinks[:2].detach().requires_grad_()]
    assert torch.autograd.gradcheck(lambda *a: attention(*a[:3], sinks=a[3], **options), tuple(small))


def test_attention_in_blocks_of_queries_equals_one_block(monkeypatch):
    """Queries taken a few rows at a time, each block over only the keys it sees (the scores a
    block writes out are bounded), give the values and gradients of one block."""
    from autoplan.models import windowed_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 13, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(3, dtype=torch.float64, requires_grad=True)
    options = dict(sinks=sinks, window=4, softcap=2.0, offset=5)

    def run():
        out = windowed_attention.attention(q[:, :, 5:], k, v, **options)
        return out, torch.autograd.grad((out * out).sum(), (q, k, v, sinks))

    whole, whole_grads = run()
    monkeypatch.setattr(windowed_attention, "_BLOCK_SCORES", 2 * 3 * 13 * 3)
    assert len(list(windowed_attention._blocks(q[:, :, 5:], k, True, 4, 5))) == 3
    blocked, blocked_grads = run()
    torch.testing.assert_close(blocked, whole)
    for a, b in zip(blocked_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b)


def _check_tp2(name: str) -> None:
    """tp 2 on 2 gloo ranks: q and o hold this rank's 2 of 4 heads, and the loss and every gradient
    (the sinks' included, each rank's heads' share summed) equal the single process's."""
    from test_tp_attention_families import _tp2_job

    spec = MODELS[name]
    plan = autoplan.suggest(spec, "1x2xcpu", global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, tp=2, pp=1, dp=1,
                            dtype="fp32", micro_batch_size=MICRO_BATCH, top=1, **({"ep": 1} if "gpt_oss" in spec else {}))[0]
    assert plan.tp == 2 and not any("whole on every tp rank" in note for note in plan.notes), plan.notes
    results = run_ranks(_tp2_job, 2, spec, plan, timeout_s=600, pg_timeout_s=120)
    for rank, out in results.items():
        assert out["shapes"]["model.layers.0.self_attn.q_proj.weight"] == ((16, 32), (32, 32)), rank
        assert out["shapes"]["model.layers.0.self_attn.o_proj.weight"] == ((32, 16), (32, 32)), rank
    inputs, target = results[0]["batch"]
    model, ref_loss, ref_grads = _reference(spec, plan, inputs, target)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    same = {n: next(m for m, q in model.named_parameters(remove_duplicate=False) if q is p)
            for n, p in model.named_parameters(remove_duplicate=False)}
    for rank, out in results.items():
        assert out["loss"] == pytest.approx(ref_loss, rel=1e-4), (rank, out["loss"], ref_loss)
        # a tied head and token table (Gemma 2) is one tensor under two names, listed once
        assert set(out["grads"]) <= set(ref_grads) and all(n in out["grads"] or same[n] in out["grads"]
                                                            for n in ref_grads), sorted(set(out["grads"]) ^ set(ref_grads))
        for n, g in out["grads"].items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-4 * scale, msg=f"{rank}: {n}")


def test_tp2_profiles_shard_the_attention():
    """The layout the profile records (what suggest prices) leaves no attention whole, and prices
    autoplan's operator as attention (torch's SDPA FLOP count, heads split under tp)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    profile = autoplan.profile(MODELS["gpt-oss"], seq_len=SEQ_LEN)
    layout = profile.extra["tensor_parallel"]
    assert layout["replicated"] == {} and not layout["note"] and layout["divides"]["num_heads"] == 4, layout
    assert profile.extra["context_parallel"]["allowed"], profile.extra["context_parallel"]
    ops = {(op.name, op.phase): op for block in profile.blocks for op in block.ops if op.kind == "attention"}
    shape = (profile.batch_size, 4, SEQ_LEN, 8)
    assert set(ops) == {("attention", "fwd"), ("attention_backward", "bwd")}, ops
    assert ops["attention", "fwd"].flops == sdpa_flop_count(shape, shape, shape)
    assert ops["attention_backward", "bwd"].flops == sdpa_backward_flop_count(shape, shape, shape, shape)
    assert all(op.tp == "sharded" for op in ops.values())


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["gpt-oss", "gemma2"])  # sinks, a parameter per head; soft-capping
def test_tp2_shards_the_attention_and_matches_one_process(name):
    _check_tp2(name)


def test_cp_is_offered_for_soft_capping_windows_and_sinks_and_refused_in_one_line_for_two_sided_windows():
    for spec in MODELS.values():
        source = parse_source(spec)
        assert source.context_parallel_refusal(source.build("meta")) is None, spec
    result = run_main("suggest", "--model", MODELS["gemma3"] + ",use_bidirectional_attention=true",
                      "--cluster", "1x4xcpu", "--global-batch", "8", "--seq-len", "32", "--cp", "2")
    assert result.returncode == 2 and "use_bidirectional_attention=true" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
