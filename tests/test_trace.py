"""Tracing: blocks, cuts, tracer fallbacks, and sub-graphs that recompose to the model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoplan import models as zoo
from autoplan.cli import main
from autoplan.graph.grouping import find_layer_container
from autoplan.graph.profile import profile_model
from autoplan.graph.trace import extract_submodule, trace_model
from autoplan.graph.trace_errors import TraceError
from tests import models
from tests.models import IntCrossingModel, ShapeBranchModel, SkipModel, Untraceable, ValueCheckModel


def _ids(shape=(2, 16), vocab=64, device="cpu"):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0)).to(device)


def test_blocks_are_embedding_layers_norm_head():
    traced = trace_model(SkipModel(), (_ids(),))
    assert traced.tracer == "fx"
    assert traced.block_names == ["embedding", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head"]
    assert traced.layer_container == "layers"


def test_zoo_layer_container_is_found():
    assert find_layer_container(zoo.build_model("llama3-8b:num_layers=3")) == "layers"


def test_skip_connection_over_two_blocks_is_on_every_cut_it_crosses():
    with torch.device("meta"):
        model = SkipModel()
    profile, _ = profile_model(model, (_ids(device="meta"),), dtype=torch.float32)
    crossing = {c.index: sorted(t.name for t in c.tensors) for c in profile.cuts}
    # The embedding output `emb` is produced in block 0 and used after layer 2 (block 3).
    assert crossing[0] == ["emb"]
    assert crossing[1] == ["emb", "layers_0"]
    assert crossing[2] == ["emb", "layers_1"]
    assert crossing[3] == ["add"]
    hidden_bytes = 2 * 16 * 32 * 4
    assert profile.cuts[1].num_bytes == 2 * hidden_bytes
    assert profile.blocks[1].output_bytes == 2 * hidden_bytes


def test_non_tensor_crossing_makes_cut_illegal():
    model = IntCrossingModel()
    profile, _ = profile_model(model, (torch.randn(2, 5, 16),), dtype=torch.float32)
    assert not any(c.legal for c in profile.cuts[1:])
    assert "not a tensor" in profile.cuts[1].reason
    assert profile.legal_cuts() == [c.index for c in profile.cuts if c.legal]


def test_fx_failure_falls_back_to_export():
    traced = trace_model(ShapeBranchModel(), (_ids(),))
    assert traced.tracer == "export"
    assert "fx failed" in traced.note
    assert traced.block_names[1:5] == ["layers.0", "layers.1", "layers.2", "layers.3"]


def test_export_failure_falls_back_to_module_boundaries():
    traced = trace_model(ValueCheckModel(), (_ids(),))
    assert traced.tracer == "modules"
    assert "fx failed" in traced.note and "export failed" in traced.note
    assert "registration order" in traced.note
    assert traced.block_names == ["embedding", "layers.0", "layers.1", "layers.2", "head"]


def test_untraceable_model_says_what_to_do():
    """Value-dependent control flow and nothing to cut at: the line names the model's own line."""
    with pytest.raises(TraceError, match="reads a tensor's value") as info:
        trace_model(Untraceable(), (torch.randn(2, 8),))
    message = str(info.value)
    line = next(i for i, text in enumerate(Path(models.__file__).read_text().splitlines(), 1)
                if "if x.sum() > 0 else" in text)
    assert f"models.py:{line} in forward" in message and "torch.where" in message, message
    assert "\n" not in message


_USER_FILE = Path(__file__).parent / "user_models" / "branchy.py"


def _line_of(text: str) -> int:
    return next(i for i, line in enumerate(_USER_FILE.read_text().splitlines(), 1) if text in line)


@pytest.mark.parametrize(("builder", "code", "what", "fix"), [
    ("build", "y.sum() > 0:", "reads a tensor's value", "torch.where(cond, a, b)"),
    ("build_mask", "x[x > 0]", "shape depends on its values", "instead of x[mask]"),
])
def test_cli_value_dependent_model_is_one_line_naming_its_line_and_the_fix(capsys, builder, code, what, fix):
    """Issue 29, item 10: the refusal was `DataDependentOutputException: aten._local_scalar_dense.default`."""
    code_rc = main(["suggest", "--model", f"{_USER_FILE}:{builder}", "--cluster", "1x2xH100-80GB",
                    "--global-batch", "4"])
    err = capsys.readouterr().err
    assert code_rc == 2 and err.count("\n") == 1 and err.startswith("autoplan: error: the model "), err
    assert what in err and f"branchy.py:{_line_of(code)} " in err and fix in err, err
    assert "DataDependent" not in err and "_local_scalar_dense" not in err


def test_the_traceable_rewrite_the_refusal_advises_is_planned(capsys):
    assert main(["suggest", "--model", f"{_USER_FILE}:build_where", "--cluster", "1x2xH100-80GB",
                 "--global-batch", "4"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("tracer", ["fx", "export", "modules"])
def test_every_tracer_names_the_line_that_reads_a_value(tracer):
    from autoplan.sources import parse_source

    source = parse_source(f"{_USER_FILE}:build")
    with pytest.raises(ValueError) as info:
        profile_model(source.build(), source.example_inputs(2), tracer=tracer)
    assert f"branchy.py:{_line_of('y.sum() > 0:')} " in str(info.value), str(info.value)


def test_a_value_read_outside_any_layer_is_named_from_the_line_fx_recorded(capsys):
    """fx traces `.item()` in the top-level forward as a node; it fails only when the profile runs it,
    where the traceback holds no frame of the model's: the line comes from the traced node."""
    user_file = Path(__file__).parent / "user_models" / "value_in_forward.py"
    line = next(i for i, text in enumerate(user_file.read_text().splitlines(), 1) if "max().item()" in text)
    assert main(["suggest", "--model", f"{user_file}:build", "--cluster", "1x2xcpu", "--global-batch", "4"]) == 2
    err = capsys.readouterr().err
    assert f"value_in_forward.py:{line} in forward" in err and "reads a tensor's value" in err, err
    assert err.count("\n") == 1


def test_tracing_does_not_import_inductor():
    """fx's `record_stack_traces` imported torch._inductor on every trace (0.6 s of CPU of a warm
    suggest); the tracer records the model's line itself."""
    code = ("import sys, torch; from autoplan import models as zoo; from autoplan.graph.trace import trace_model\n"
            "model = zoo.build_model('gpt:num_layers=2,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16')\n"
            "traced = trace_model(model, (torch.zeros(2, 16, dtype=torch.long),))\n"
            "assert traced.tracer == 'fx', traced.tracer\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._inductor')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def test_user_leaf_modules_become_blocks():
    model = zoo.build_model("gpt:num_layers=2,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16")
    traced = trace_model(model, (_ids(),), leaf_modules=["layers.*.attention", "layers.*.mlp"])
    assert traced.block_names[1:5] == ["layers.0.attention", "layers.0.mlp", "layers.1.attention", "layers.1.mlp"]


def test_unknown_leaf_module_is_an_error():
    with pytest.raises(TraceError, match="matches no module"):
        trace_model(SkipModel(), (_ids(),), leaf_modules=["layers.*.nope"])


@pytest.mark.parametrize("model_factory", [SkipModel, ShapeBranchModel, ValueCheckModel])
def test_block_submodules_recompose_to_the_model(model_factory):
    """Running the blocks one after another, passing crossing tensors, equals the model."""
    torch.manual_seed(0)
    model = model_factory()
    x = _ids()
    traced = trace_model(model, (x,))
    env = dict(zip(traced.input_names, (x,), strict=True))
    for i in range(traced.num_blocks):
        sub, inputs, outputs = extract_submodule(traced, i, i)
        results = sub(*[env[n] for n in inputs])
        env.update(zip(outputs, results, strict=True))
        # Parameter names are the model's own.
        names = {n for n, _ in sub.named_parameters()}
        assert names <= {n for n, _ in model.named_parameters()}
    torch.testing.assert_close(env[outputs[-1]], model(x))


def test_block_parameters_partition_the_model():
    model = SkipModel()
    traced = trace_model(model, (_ids(),))
    seen: list[str] = []
    for i in range(traced.num_blocks):
        sub, _, _ = extract_submodule(traced, i, i)
        seen += [n for n, _ in sub.named_parameters()]
    assert sorted(seen) == sorted(n for n, _ in model.named_parameters())
