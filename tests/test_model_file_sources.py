"""A user's model file (`file.py:build`, run on meta) as a source: its token ids are drawn over the
vocabulary of the embedding they index (not below a smaller position table), for the example
inputs and for the batches `autoplan run` trains on; and its `build` keeps the ties the model had."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_user_paths import write_model_file

from autoplan.sources import parse_source

POSITIONS = 64 + 2  # OPT's and BART's learned position tables: max_position_embeddings + an offset of 2


@pytest.mark.parametrize("model_name", ["opt-file", "bart-file"])
def test_ids_span_the_vocabulary_of_the_embedding_they_feed(model_name, tmp_path):
    source = parse_source(write_model_file(tmp_path, model_name))
    (ids,) = source.example_inputs(8, 32, device="cpu")
    assert int(ids.max()) >= POSITIONS, f"example ids stay below the position table: max {int(ids.max())}"
    assert int(ids.max()) < 256
    # What `autoplan run` trains on (runtime/launcher/training.py: `source.batch` every step).
    (batch_ids,), target = source.batch(0, 3, 8, 32, (8, 32, 256), torch.float32)
    assert POSITIONS <= int(batch_ids.max()) < 256 and int(target.max()) < 256


def test_ids_span_a_table_the_model_indexes_itself(tmp_path):
    """`table[ids]` beside a smaller position `nn.Embedding`: the table bounds the ids."""
    path = tmp_path / "own_lookup.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "class Model(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.table, self.pos, self.out = nn.Parameter(torch.randn(100, 8)), nn.Embedding(16, 8), nn.Linear(8, 100)\n\n"
        "    def forward(self, ids):\n"
        "        return self.out(self.table[ids] + self.pos(torch.arange(ids.shape[1])))\n\n\n"
        "def build():\n"
        "    return Model(), (torch.randint(0, 100, (2, 16)),)\n")
    (ids,) = parse_source(f"{path}:build").example_inputs(8, 16, device="cpu")
    assert 16 <= int(ids.max()) < 100


@pytest.mark.parametrize("model_name", ["opt-file", "gemma2-file", "bart-file"])
def test_a_model_files_tied_head_stays_tied_when_built(model_name, tmp_path):
    model = parse_source(write_model_file(tmp_path, model_name)).build("cpu")
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head is embedding
    assert embedding.device.type == "cpu" and float(embedding.detach().std()) > 0  # initialized, not left empty


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_autoplan_run_trains_a_model_file_over_its_whole_vocabulary(tmp_path):
    """suggest -> run on 2 gloo ranks: ids up to 255 index the token table on every stage."""
    spec, out = write_model_file(tmp_path, "opt-file"), tmp_path / "p.json"
    suggest = subprocess.run([sys.executable, "-m", "autoplan", "suggest", "--model", spec, "--cluster", "1x2xcpu",
                              "--global-batch", "4", "--seq-len", "32", "--pp", "2", "--out", str(out)],
                             capture_output=True, text=True, timeout=240)
    assert suggest.returncode == 0, suggest.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "autoplan", "run", str(out), "--steps", "1"],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and "step 0" in run.stdout, run.stderr[-2000:]
    plan = json.loads(out.read_text())
    (ids,), _ = parse_source(plan["model"]).batch(0, 0, plan["job"]["global_batch"], 32, (4, 32, 256), torch.float32)
    assert int(ids.max()) >= POSITIONS


@pytest.mark.parametrize("spec", [
    "gpt:num_layers=2,hidden_size=64,num_heads=4,vocab_size=256,max_seq_len=64",
    "hf:gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=256,n_positions=64",
    "opt-file",
])
def test_every_sources_build_keeps_the_ties_it_had_on_meta(spec, tmp_path):
    from autoplan.sources import tied_parameter_names

    source = parse_source(write_model_file(tmp_path, spec) if spec.endswith("-file") else spec)
    on_meta = tied_parameter_names(source.build("meta"))
    assert on_meta and tied_parameter_names(parse_source(source.spec).build("cpu")) == on_meta
