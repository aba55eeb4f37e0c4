"""Every plan runs, through what a user runs: the matrix of model sources x layouts.

Plans come from `autoplan.suggest` (the public API) with a layout pinned; each of 4 gloo ranks
builds its stages with `autoplan.partition(spec, plan)` and trains through `.step` (the public
API), with the source's defaults (its own synthetic batch, its default loss). The loss and every
gradient are compared with a single-process reference: the whole model built on the CPU with the
same name-keyed initial values, run over the same micro-batches (gradient accumulation, so batch
statistics such as BatchNorm's see the same rows), fp32 within 1e-5 relative (tp within 1e-4).
The ZeRO-1 and FSDP layouts (zero 3, HSDP, zero 2 with tp) also take one AdamW step and compare the
parameters; the bf16 layout checks
that the loss falls over 3 steps on one batch.

A layout a model cannot take (tp for a conv net) must be refused by `suggest` in one line; the
test asserts it is, and says which. docs/status.md's table is this matrix.
"""

from __future__ import annotations

import gc
import math
from pathlib import Path

import pytest
import torch
from _dist import run_ranks

import autoplan
from autoplan.graph.aux_loss import aux_loss_scale, recording_aux_losses

ROOT = Path(__file__).resolve().parent.parent

MODELS = {
    "zoo-gpt": ("gpt:num_layers=4,hidden_size=64,num_heads=4,vocab_size=256,max_seq_len=64", 32),
    "zoo-llama": ("llama:num_layers=4,hidden_size=64,num_heads=4,num_kv_heads=2,vocab_size=256,max_seq_len=64", 32),
    # A mixture of experts with shared experts, capacity dropping and the load-balancing loss.
    "zoo-moe": ("moe:num_layers=4,hidden_size=64,num_heads=4,num_kv_heads=2,ffn_hidden_size=96,vocab_size=256,"
                "max_seq_len=64,num_experts=4,experts_per_token=2,num_shared_experts=1", 32),
    # examples/custom_model.py's classes at test size (the example itself: tests/test_export.py, test_faults.py).
    "model-file": (str(ROOT / "tests/user_models/small_custom.py") + ":build", 32),
    "convnet": (str(ROOT / "tests/user_models/convnet.py") + ":build", None),
    # transformers models from tiny configs with their defaults, but dropout 0 where a config turns it
    # on (a pipeline cannot draw the masks a single process draws).
    "hf-gpt2": ("hf:gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=256,n_positions=64,resid_pdrop=0,embd_pdrop=0,"
                "attn_pdrop=0", 32),
    "hf-llama": ("hf:llama:num_hidden_layers=4,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
                 "intermediate_size=128,vocab_size=256,max_position_embeddings=64", 32),
    "hf-bert": ("hf:bert:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,"
                "vocab_size=256,max_position_embeddings=64,hidden_dropout_prob=0,attention_probs_dropout_prob=0", 32),
    "hf-vit": ("hf:vit:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,image_size=32,"
               "patch_size=8", None),
    "hf-t5": ("hf:t5:num_layers=2,num_decoder_layers=2,d_model=64,d_kv=16,num_heads=4,d_ff=128,vocab_size=256,"
              "dropout_rate=0", 32),
    "hf-mixtral": ("hf:mixtral:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
                   "intermediate_size=128,vocab_size=256,max_position_embeddings=64,num_local_experts=4,"
                   "num_experts_per_tok=2", 32),
}

LAYOUTS = {
    "pp2-1f1b": dict(tp=1, pp=2, dp=2, schedule="1f1b", zero=0),
    "pp4-zb-h1": dict(tp=1, pp=4, dp=1, schedule="zb-h1"),
    "dp2-zero1": dict(tp=1, pp=2, dp=2, zero=1),
    "tp2": dict(tp=2, pp=1, dp=2),
    "tp2-pp2": dict(tp=2, pp=2, dp=1),
    "bf16": dict(tp=1, pp=2, dp=2, dtype="bf16"),
    "zero3-pp2": dict(tp=1, pp=2, dp=2, zero=3),
}
EXTENDED_LAYOUTS = {
    "hsdp": dict(tp=1, pp=1, dp=4, zero=3, dp_replicate=2),
    "zero2-tp2": dict(tp=2, pp=1, dp=2, zero=2),
}
"""Run for every model by the extended suite (`pytest -m extended`); the default suite runs them on the
zoo (tests/test_runtime_fsdp.py) and through `autoplan suggest` -> `autoplan run`."""
SHARDED = ("dp2-zero1", "zero3-pp2", "hsdp", "zero2-tp2")
"""Layouts whose optimizer is sharded (ZeRO-1, FSDP): one AdamW step is compared with the plain one."""
GLOBAL_BATCH = 8
MICRO_BATCH = 2
REFUSED = {("convnet", "tp2"), ("convnet", "tp2-pp2"), ("convnet", "zero2-tp2"), ("hf-gpt2", "zero2-tp2")}
"""(model, layout) that suggest must refuse: no tensor-parallel layout (a conv net has no column- and
row-parallel linear pair); FSDP with tp over a fused q/k/v projection (GPT-2's c_attn)."""


def _plans(spec: str, seq_len: int | None, layouts: dict):
    plans, refused = {}, {}
    for name, pins in layouts.items():
        pins = dict(pins)
        dtype = pins.pop("dtype", "fp32")
        if "experts" in spec:  # whole experts on every rank: the reference comparison is of full tensors
            pins.setdefault("ep", 1)  # (expert parallelism has its own numerics tests: tests/test_expert_parallel.py)
        try:
            plans[name] = autoplan.suggest(spec, "1x4xcpu", global_batch=GLOBAL_BATCH, seq_len=seq_len, dtype=dtype,
                                           micro_batch_size=MICRO_BATCH, top=1, **pins)[0]
        except ValueError as exc:
            refused[name] = str(exc)
    return plans, refused


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()


def _rank_job(rank: int, world_size: int, spec: str, plans: dict) -> dict:
    """Each layout's loss and gradients (full tensors, by name) on this rank."""
    out = {}
    for name, plan in plans.items():
        pm = autoplan.partition(spec, plan, device="cpu")
        template = pm.output_template
        inputs, target = pm.source.batch(0, 0, plan.job.global_batch, plan.job.seq_len, template.shape,
                                         template.dtype)
        optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)
        losses = []
        for _ in range(3 if name == "bf16" else 1):
            loss = pm.step(*inputs, target=target)
            if name == "bf16" or name in SHARDED:
                optimizer.step()
            losses.append(None if loss is None else float(loss))
        grads = {n: _full(p.grad) for n, p in pm.named_parameters() if p.grad is not None}
        params = {n: _full(p) for n, p in pm.named_parameters()} if name in SHARDED else {}
        if pm.layout.dp_index or pm.layout.tp_index:  # whole tensors (gathered collectively): one copy is enough
            grads, params = {}, {}
        out[name] = dict(losses=losses, grads=grads, params=params,
                         batch=(inputs, target) if rank == 0 else None)
        del pm, optimizer  # the layouts run one after another: free this one's model and state first
        gc.collect()
    return out


def _reference(spec: str, plan, inputs, target):
    """Loss and gradients of the whole model over the plan's micro-batches, one process."""
    from autoplan.sources import parse_source

    source = parse_source(spec)
    torch.manual_seed(0)
    # Built as the runtime builds its stages: every source's `build` initializes by name through
    # the source's `init_weights` with the model's ties kept (sources/base.py's to_empty_keeping_ties).
    model = source.build("cpu")
    model.train()
    rows = plan.micro_batch_size
    chunks = GLOBAL_BATCH // rows
    total = 0.0

    def rows_of(value, k):
        return value[k * rows:(k + 1) * rows] if isinstance(value, torch.Tensor) and value.dim() > 0 else value

    for k in range(chunks):
        loss = source.loss_fn(model(*[rows_of(x, k) for x in inputs]), rows_of(target, k)) / chunks
        # Auxiliary losses (MoE load balancing) scaled as the loss is, and part of the loss reported.
        with aux_loss_scale(1 / chunks), recording_aux_losses() as aux:
            loss.backward()
        total += loss.item() + sum(float(a) for a in aux)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    return model, total, grads


def _merged(results: dict, layout: str, key: str) -> dict:
    merged = {}
    for r in sorted(results):
        merged.update(results[r][layout][key])
    return merged


def _check_model(model_name: str, layouts: dict) -> None:
    spec, seq_len = MODELS[model_name]
    _check_spec(spec, seq_len, layouts, {layout for (m, layout) in REFUSED if m == model_name and layout in layouts})


def _check_spec(spec: str, seq_len: int | None, layouts: dict, expected_refused: set[str]) -> None:
    plans, refused = _plans(spec, seq_len, layouts)
    assert set(refused) == expected_refused, f"refused: {refused}"
    for message in refused.values():
        assert "\n" not in message and "tp" in message, message
    results = run_ranks(_rank_job, 4, spec, plans, timeout_s=600, pg_timeout_s=120)
    inputs, target = results[0][next(iter(plans))]["batch"]
    for layout, plan in plans.items():
        losses = [loss for r in results for loss in results[r][layout]["losses"][:1] if loss is not None]
        assert losses, f"{layout}: no rank returned a loss"
        if layout == "bf16":
            curve = next(results[r][layout]["losses"] for r in results if results[r][layout]["losses"][0] is not None)
            assert all(math.isfinite(x) for x in curve) and curve[-1] < curve[0], f"bf16 loss did not fall: {curve}"
            continue
        model, ref_loss, ref_grads = _reference(spec, plan, inputs, target)
        rtol = 1e-4 if plan.tp > 1 else 1e-5
        for loss in losses:
            assert loss == pytest.approx(ref_loss, rel=rtol, abs=1e-6), f"{layout}: loss {loss} vs {ref_loss}"
        grads = _merged(results, layout, "grads")
        # A tied parameter is one tensor under two names; a stage holding both ends lists it once.
        same = {n: next(m for m, q in model.named_parameters(remove_duplicate=False) if q is p)
                for n, p in model.named_parameters(remove_duplicate=False)}
        missing = [n for n in ref_grads if n not in grads and same[n] not in grads]
        assert not missing and set(grads) <= set(ref_grads), f"{layout}: {missing[:5]}, {sorted(set(grads) - set(ref_grads))[:5]}"
        # rtol per element, and an atol of rtol times the largest gradient entry of the model: an
        # element near zero (a key bias's gradient is zero up to rounding) is compared at that scale.
        scale = max(float(g.abs().max()) for g in ref_grads.values())
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=rtol, atol=rtol * scale,
                                       msg=lambda m, n=name, lay=layout: f"{lay}: {n}: {m}")
        if layout in SHARDED:  # one AdamW step of the sharded optimizer equals the plain one
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            optimizer.step()
            reference = dict(model.named_parameters(remove_duplicate=False))
            for name, value in _merged(results, layout, "params").items():
                # Adam's first step moves each weight by about lr * sign(grad): exact where the gradient
                # is above rounding level, and never more than 2 lr apart where its sign is noise.
                expected = reference[name].detach()
                grad = ref_grads[name]
                clear = grad.abs() > rtol * scale
                torch.testing.assert_close(value[clear], expected[clear], rtol=1e-5, atol=1e-6)
                assert float((value - expected).abs().max()) <= 2e-3 + 1e-6, name


@pytest.mark.multiproc
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_every_layout_matches_a_single_process_reference(model_name):
    _check_model(model_name, LAYOUTS)


# transformers models inside a user's `file.py:build` (configs only, 256-token vocabularies, 64
# positions): tied heads (a reference built untied was off by 4e-4 for Gemma2, 5e-3 for OPT), and
# learned position tables smaller than the vocabulary (OPT, BART: tests/test_model_file_sources.py).
_SIZES = "vocab_size=256, max_position_embeddings=64"
MODEL_FILES = {
    "opt-file": ("OPTConfig", "OPTForCausalLM", f"num_hidden_layers=2, hidden_size=64, num_attention_heads=4, "
                 f"ffn_dim=128, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0, {_SIZES}"),
    "gemma2-file": ("Gemma2Config", "Gemma2ForCausalLM", f"num_hidden_layers=2, hidden_size=64, num_attention_heads=4, "
                    f"intermediate_size=128, num_key_value_heads=2, head_dim=16, {_SIZES}"),
    "bart-file": ("BartConfig", "BartForConditionalGeneration", f"encoder_layers=1, decoder_layers=1, d_model=64, "
                  f"encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_attention_heads=4, decoder_attention_heads=4, "
                  f"dropout=0.0, attention_dropout=0.0, {_SIZES}"),
}


def write_model_file(directory: Path, name: str) -> str:
    """`name`'s model file in `directory`, its example ids (2, 32) over the whole vocabulary: its spec."""
    config, model, kwargs = MODEL_FILES[name]
    path = directory / f"{name.replace('-', '_')}.py"
    path.write_text(f"import torch\nfrom transformers import {config}, {model}\n\n\ndef build():\n"
                    f"    return {model}({config}({kwargs})), (torch.randint(0, 256, (2, 32)),)\n")
    return f"{path}:build"


@pytest.mark.multiproc
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model_name", ["opt-file", "gemma2-file"])
def test_transformers_model_files_match_a_single_process_reference(model_name, tmp_path):
    layouts = {name: LAYOUTS[name] for name in ("pp2-1f1b", "tp2")}
    _check_spec(write_model_file(tmp_path, model_name), 32, layouts, set())


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_hsdp_and_fsdp_with_tp_match_a_single_process_reference(model_name):
    _check_model(model_name, EXTENDED_LAYOUTS)



@pytest.mark.extended
@pytest.mark.multiproc
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_every_plan_in_the_top_5_runs_through_autoplan_run(model_name, tmp_path):
    """Property: no plan that `suggest` returns is refused by `run`. Defaults throughout (bf16, the
    searched layout, the source's synthetic data); one step each, through the console script."""
    import subprocess
    import sys

    spec, seq_len = MODELS[model_name]
    plans = autoplan.suggest(spec, "1x4xcpu", global_batch=GLOBAL_BATCH, seq_len=seq_len, top=5)
    assert plans
    for k, plan in enumerate(plans):
        path = tmp_path / f"plan{k}.json"
        plan.save(path)
        proc = subprocess.run([sys.executable, "-m", "autoplan", "run", str(path), "--steps", "1"],
                              capture_output=True, text=True, timeout=600)
        layout = f"tp {plan.tp} pp {plan.pp} dp {plan.dp} {plan.schedule} v{plan.virtual_stages} {plan.recompute}"
        assert proc.returncode == 0 and "step 0" in proc.stdout, f"plan {k} ({layout}): {proc.stderr.strip()[-500:]}"
