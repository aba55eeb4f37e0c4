"""`hf:` specs read as what they are (issue 31), through the CLI a user runs: a model type's spec is
never read as a path however long it is, a path check never raises, and every field the config
class takes (declared, consumed into other fields, or read by the model's code) is accepted and
reaches the built model, while a field nothing takes is still refused in one line."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from autoplan.cli import main  # noqa: E402
from autoplan.sources import parse_source  # noqa: E402

pytestmark = pytest.mark.hf

# 300+ characters: longer than a file name may be (255), so reading it as a path raised
# `OSError: [Errno 36] File name too long`.
DEEPSEEK_V3 = ("hf:deepseek_v3:num_hidden_layers=2,hidden_size=64,intermediate_size=128,moe_intermediate_size=32,"
               "num_attention_heads=4,num_key_value_heads=4,vocab_size=256,n_routed_experts=4,num_experts_per_tok=2,"
               "n_shared_experts=1,first_k_dense_replace=1,q_lora_rank=32,kv_lora_rank=16,qk_rope_head_dim=8,"
               "qk_nope_head_dim=8,v_head_dim=16,max_position_embeddings=64,n_group=1,topk_group=1")
_DECODER = "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,intermediate_size=128," \
           "vocab_size=256,max_position_embeddings=64"
# head_dim 32 is not hidden_size / num_attention_heads (16), so the built projections show it took effect.
QWEN3_MOE_HEAD_DIM = f"hf:qwen3_moe:{_DECODER},moe_intermediate_size=32,num_experts=4,num_experts_per_tok=2,head_dim=32"
LLAMA_ROPE_THETA = f"hf:llama:{_DECODER},rope_theta=5000.0"
_LONG = "a" * 300
FALCON = "hf:falcon:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,vocab_size=256"


def _suggest(spec: str, out) -> int:
    return main(["suggest", "--model", spec, "--cluster", "1x2xcpu", "--global-batch", "4", "--seq-len", "16",
                 "--pp", "2", "--out", str(out)])


def test_a_long_model_type_spec_is_planned_not_read_as_a_path(tmp_path):
    assert len(DEEPSEEK_V3) > 255
    plan = tmp_path / "p.json"
    assert _suggest(DEEPSEEK_V3, plan) == 0
    assert json.loads(plan.read_text())["model"] == DEEPSEEK_V3


@pytest.mark.parametrize("spec, match", [
    (f"hf:{_LONG}", "is neither a model type nor an existing path"),
    (f"hf:./{_LONG}", "does not exist; hf: takes a local config.json"),  # nothing there: not "holds no config.json"
    (f"hf:{_LONG}.json", "does not exist; hf: takes a local config.json"),
    (f"{_LONG}.py:build", "does not exist"),
    ("hf:llama:num_hidden_layers=2,bogus_field=3", "no field 'bogus_field'"),
    ("hf:qwen3_moe:head_dimm=16", "no field 'head_dimm' \\(did you mean 'head_dim'\\?\\)"),
])
def test_specs_nothing_takes_get_one_line_errors(tmp_path, capsys, spec, match):
    assert _suggest(spec, tmp_path / "p.json") == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "\n" not in err and err.startswith("autoplan: error:"), err
    if spec.startswith("hf:"):
        assert len(err) < 400, err  # a 300-character name is clipped, not echoed whole
    with pytest.raises(ValueError, match=match):  # SourceError, or ModelSpecError for a file spec
        parse_source(spec)


def test_a_field_the_model_reads_reaches_the_built_model(tmp_path):
    """Qwen3MoeConfig declares no head_dim; the model reads it (getattr with a fallback)."""
    plan = tmp_path / "p.json"
    assert _suggest(QWEN3_MOE_HEAD_DIM, plan) == 0
    model = parse_source(json.loads(plan.read_text())["model"]).build()
    assert model.config.head_dim == 32
    assert model.model.layers[0].self_attn.q_proj.out_features == 4 * 32


def test_a_field_the_config_consumes_reaches_the_built_model(tmp_path):
    """transformers 5 folds rope_theta into rope_parameters and keeps no rope_theta attribute."""
    plan = tmp_path / "p.json"
    assert _suggest(LLAMA_ROPE_THETA, plan) == 0
    model = parse_source(json.loads(plan.read_text())["model"]).build("cpu")
    assert model.config.rope_parameters["rope_theta"] == 5000.0
    head_dim = 64 // 4
    assert model.model.rotary_emb.inv_freq[1].item() == pytest.approx(5000.0 ** (-2 / head_dim))


def test_a_model_with_lifted_tensor_constants_is_planned(tmp_path):
    """Falcon's attention indexes with a list (`x[..., [-2], :]`), which torch.export lifts as a
    tensor constant (`lifted_tensor_0`) that is neither a parameter nor a buffer: `suggest` ended in
    `KeyError: 'transformer.h.0.self_attention.lifted_tensor_0'`. Its 2-rank run is checked against a
    single process in tests/test_hf.py::test_two_ranks_match_a_single_process_build."""
    plan = tmp_path / "p.json"
    assert _suggest(FALCON, plan) == 0
    assert json.loads(plan.read_text())["pp"] == 2
