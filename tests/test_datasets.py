"""Real training data (autoplan/runtime/launcher/datasets.py): each on-disk format read back token for token,
the order a pure function of (data, seq_len, seed, step) in any process, epochs wrapping, the identity a
resume is checked against, and every user mistake as one line."""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from autoplan.runtime.launcher.datasets import DatasetError, open_dataset


def _windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    n = len(stream) // (seq_len + 1)
    return np.asarray(stream[: n * (seq_len + 1)], dtype=np.int64).reshape(n, seq_len + 1)


def _epoch_rows(ds, global_batch: int) -> np.ndarray:
    """The rows (ids + the last target) of the first num_samples samples, in the order batch() gives them."""
    assert ds.num_samples % global_batch == 0
    rows = []
    for step in range(ds.num_samples // global_batch):
        ids, targets = ds.batch(step, global_batch)
        assert ids.dtype == targets.dtype == torch.int64
        assert ids.shape == targets.shape == (global_batch, ds.seq_len)
        assert torch.equal(ids[:, 1:], targets[:, :-1])  # targets are the ids shifted by one
        rows.append(torch.cat([ids, targets[:, -1:]], dim=1).numpy())
    return np.concatenate(rows)


def _check_epoch_is_a_permutation_of_the_windows(ds, stream: np.ndarray, global_batch: int) -> None:
    expected = _windows(stream, ds.seq_len)
    got = _epoch_rows(ds, global_batch)
    assert len(got) == len(expected) == ds.num_samples
    # every window exactly once, each token for token ...
    assert sorted(map(tuple, got)) == sorted(map(tuple, expected))
    # ... and shuffled (a fixed order would pass the line above)
    assert not np.array_equal(got, expected)


def _write_megatron(prefix: Path, docs: list[list[int]], dtype=np.uint16, code: int = 8) -> None:
    """Megatron-LM's layout written from its spec (megatron/core/datasets/indexed_dataset.py, _IndexWriter):
    the .bin is the sequences back to back; the .idx is header, version, dtype code, counts, lengths
    (int32), byte pointers (int64), document indices (int64, starting at 0, one sequence a document)."""
    itemsize = np.dtype(dtype).itemsize
    np.concatenate([np.asarray(d, dtype=dtype) for d in docs]).tofile(f"{prefix}.bin")
    lengths = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * itemsize
    doc_index = np.arange(len(docs) + 1, dtype=np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_index)))
        f.write(lengths.tobytes() + pointers.tobytes() + doc_index.tobytes())


def _docs(num_docs: int, seed: int = 0, vocab: int = 50257) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(1, 40))).tolist() for _ in range(num_docs)]


# --- each format read back token for token --------------------------------------------------------------------

def test_a_nanogpt_token_file_reads_back_as_shuffled_windows_of_the_stream(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 50257, 8 * 9 * 5 + 3).astype(np.uint16)  # 3 left over
    tokens.tofile(tmp_path / "train.bin")  # nanoGPT's prepare.py
    ds = open_dataset(str(tmp_path / "train.bin"), seq_len=8, seed=3)
    assert (ds.num_samples, ds.identity["tokens"], ds.identity["dtype"]) == (40, len(tokens), "uint16")
    assert ds.identity["format"] == "tokens"
    _check_epoch_is_a_permutation_of_the_windows(ds, tokens, global_batch=5)
    ds.check_vocab(50257)


def test_uint32_token_files_take_a_dtype_suffix_and_npy_files_carry_theirs(tmp_path):
    tokens = np.random.default_rng(2).integers(0, 151_000, 7 * 20).astype(np.uint32)  # a vocab over 65535
    tokens.tofile(tmp_path / "big.bin")
    ds = open_dataset(f"{tmp_path / 'big.bin'}:uint32", seq_len=6)
    assert ds.identity["dtype"] == "uint32" and ds.identity["path"] == str((tmp_path / "big.bin").resolve())
    _check_epoch_is_a_permutation_of_the_windows(ds, tokens, global_batch=4)
    ds.check_vocab(151_936)

    np.save(tmp_path / "docs.npy", tokens.astype(np.int32).reshape(20, 7))  # a 2-D array reads row after row
    ds = open_dataset(str(tmp_path / "docs.npy"), seq_len=6)
    assert ds.identity["dtype"] == "int32"
    _check_epoch_is_a_permutation_of_the_windows(ds, tokens, global_batch=4)


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4)])
def test_a_megatron_indexed_dataset_reads_as_its_documents_concatenated(tmp_path, dtype, code):
    docs = _docs(60, vocab=50257 if code == 8 else 128_256)
    _write_megatron(tmp_path / "corpus_text_document", docs, dtype, code)
    stream = np.concatenate([np.asarray(d) for d in docs])
    prefix = tmp_path / "corpus_text_document"
    for spec in (prefix, f"{prefix}.bin", f"{prefix}.idx"):  # the prefix, or either of its two files
        ds = open_dataset(str(spec), seq_len=4)
        assert ds.identity["format"] == "megatron" and ds.identity["path"] == str(prefix.resolve())
        assert (ds.identity["tokens"], ds.identity["dtype"]) == (len(stream), np.dtype(dtype).name)
    rows = np.stack([ds.sample(i) for i in range(ds.num_samples)])
    assert sorted(map(tuple, rows)) == sorted(map(tuple, _windows(stream, 4)))  # windows cross documents


def test_a_datasets_directory_reads_its_input_ids_concatenated(tmp_path):
    datasets = pytest.importorskip("datasets")
    docs = _docs(40, seed=5)
    # three shards: three memory-mapped Arrow files, one stream with windows across their boundaries
    datasets.Dataset.from_dict({"text": ["..."] * 40, "input_ids": docs}).save_to_disk(str(tmp_path / "tok"),
                                                                                       num_shards=3)
    stream = np.concatenate([np.asarray(d) for d in docs])
    ds = open_dataset(str(tmp_path / "tok"), seq_len=5, seed=1)
    assert ds.identity["format"] == "hf-datasets" and ds.identity["tokens"] == len(stream)
    assert len(ds._stream.parts) == 3
    rows = np.stack([ds.sample(i) for i in range(ds.num_samples)])
    assert sorted(map(tuple, rows)) == sorted(map(tuple, _windows(stream, 5)))
    # a shuffled selection saved as such reads in its own row order
    view = datasets.Dataset.from_dict({"input_ids": docs}).shuffle(seed=0).select(range(10))
    view.save_to_disk(str(tmp_path / "view"))
    ds = open_dataset(str(tmp_path / "view"), seq_len=5)
    assert ds.identity["tokens"] == sum(len(docs[i]) for i in view._indices.column(0).to_pylist())


# --- order: a pure function of (data, seq_len, seed, step) ------------------------------------------------------

_IN_ANOTHER_PROCESS = """
import json, sys
from autoplan.runtime.launcher.datasets import open_dataset
ds = open_dataset(sys.argv[1], seq_len=16, seed=7)
print(json.dumps({"identity": ds.identity,
                  "batches": [ds.batch(step, 6)[0].tolist() for step in (0, 1, 13, 40)]}))
"""


def test_batches_are_the_same_in_another_process_and_after_a_resume(tmp_path):
    np.random.default_rng(3).integers(0, 50257, 17 * 50).astype(np.uint16).tofile(tmp_path / "t.bin")
    path = str(tmp_path / "t.bin")
    ds = open_dataset(path, seq_len=16, seed=7)
    straight = {step: ds.batch(step, 6) for step in range(45)}  # through epochs 0 .. 5
    resumed = open_dataset(path, seq_len=16, seed=7)  # a resumed run opens the data afresh at step 40
    for step in (40, 13, 0, 44):
        assert all(torch.equal(a, b) for a, b in zip(resumed.batch(step, 6), straight[step]))
    clone = pickle.loads(pickle.dumps(ds))  # sent to a rank as what to open, not as the tokens
    assert len(pickle.dumps(ds)) < 1000 and torch.equal(clone.batch(13, 6)[0], straight[13][0])
    out = subprocess.run([sys.executable, "-c", _IN_ANOTHER_PROCESS, path], capture_output=True, text=True,
                         timeout=120, check=True)
    other = json.loads(out.stdout)
    assert other["identity"] == ds.identity
    assert other["batches"] == [straight[step][0].tolist() for step in (0, 1, 13, 40)]
    # another seed is another order of the same windows
    assert not torch.equal(open_dataset(path, seq_len=16, seed=8).batch(0, 6)[0], straight[0][0])


def test_epochs_wrap_each_a_new_permutation_and_a_batch_may_straddle_two(tmp_path):
    tokens = np.arange(11 * 30, dtype=np.uint16)  # 30 windows of 10 + 1
    tokens.tofile(tmp_path / "t.bin")
    ds = open_dataset(str(tmp_path / "t.bin"), seq_len=10, seed=0)
    assert ds.num_samples == 30
    starts = [int(ds.batch(step, 7)[0][row, 0]) // 11 for step in range(9) for row in range(7)]  # 63 samples
    epoch0, epoch1, epoch2 = starts[:30], starts[30:60], starts[60:]
    assert sorted(epoch0) == sorted(epoch1) == list(range(30))  # each epoch sees every window once
    assert epoch0 != epoch1  # in another order
    assert len(set(epoch2)) == 3
    # step 4's 7 rows are samples 28 .. 34: two of epoch 0 and five of epoch 1
    ids = ds.batch(4, 7)[0]
    assert [int(x) // 11 for x in ids[:, 0]] == epoch0[28:] + epoch1[:5]


def test_the_identity_is_json_and_tells_other_data_apart_but_not_a_moved_copy(tmp_path):
    tokens = np.random.default_rng(4).integers(0, 50257, 3 << 20).astype(np.uint16)  # 6 MiB: past both MiBs read
    tokens.tofile(tmp_path / "a.bin")
    first = open_dataset(str(tmp_path / "a.bin"), seq_len=64, seed=1).identity
    assert json.loads(json.dumps(first)) == first
    assert set(first) == {"format", "path", "tokens", "dtype", "fingerprint", "seq_len", "seed"}
    (tmp_path / "copy").mkdir()
    tokens.tofile(tmp_path / "copy" / "a.bin")
    moved = open_dataset(str(tmp_path / "copy" / "a.bin"), seq_len=64, seed=1).identity
    assert moved["fingerprint"] == first["fingerprint"] and moved["path"] != first["path"]
    edited = tokens.copy()
    edited[-1] ^= 1  # the last token
    edited.tofile(tmp_path / "b.bin")
    assert open_dataset(str(tmp_path / "b.bin"), seq_len=64, seed=1).identity["fingerprint"] != first["fingerprint"]
    longer = np.concatenate([tokens[:-5], tokens[-1:]])
    longer.tofile(tmp_path / "c.bin")
    assert open_dataset(str(tmp_path / "c.bin"), seq_len=64, seed=1).identity["fingerprint"] != first["fingerprint"]


# --- every user mistake is one line ---------------------------------------------------------------------------

def _error(spec, **kwargs) -> str:
    kwargs.setdefault("seq_len", 8)
    with pytest.raises(DatasetError) as info:
        open_dataset(str(spec), **kwargs)
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, ValueError)
    return message


def test_missing_empty_short_and_odd_sized_token_files_are_one_line_each(tmp_path):
    assert "no such file or directory" in _error(tmp_path / "nope.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    assert "0 tokens, fewer than one sample of seq_len + 1 = 9" in _error(tmp_path / "empty.bin")
    np.arange(8, dtype=np.uint16).tofile(tmp_path / "short.bin")
    assert "8 tokens, fewer than one sample of seq_len + 1 = 9; use more data or a shorter seq_len" in _error(
        tmp_path / "short.bin")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    assert "3 bytes is not a whole number of uint16 tokens (2 bytes each)" in _error(tmp_path / "odd.bin")
    np.arange(1, 11, dtype=np.uint16).tofile(tmp_path / "ten.bin")
    assert "5 tokens, fewer than one sample of seq_len + 1 = 6" in _error(f"{tmp_path / 'ten.bin'}:uint32", seq_len=5)
    np.save(tmp_path / "f.npy", np.zeros(100))
    assert "holds float64 values, not integer token ids" in _error(tmp_path / "f.npy")
    assert "must be an integer >= 1" in _error(tmp_path / "ten.bin", seq_len=0)


def test_uint32_tokens_read_as_uint16_are_refused_with_the_fix(tmp_path):
    np.random.default_rng(0).integers(1, 50257, 1000).astype(np.uint32).tofile(tmp_path / "t.bin")
    assert f"read it as {tmp_path / 't.bin'}:uint32" in _error(tmp_path / "t.bin")
    assert open_dataset(f"{tmp_path / 't.bin'}:uint32", seq_len=8).identity["dtype"] == "uint32"


def test_bad_megatron_indexes_are_one_line_each(tmp_path):
    prefix = tmp_path / "c"
    _write_megatron(prefix, _docs(10))
    good = (tmp_path / "c.idx").read_bytes()
    (tmp_path / "c.idx").write_bytes(b"NOTANIDX\x00" + good[9:])
    assert "not a Megatron-LM index (starts b'NOTANIDX\\x00'" in _error(prefix)
    (tmp_path / "c.idx").write_bytes(good[:9] + struct.pack("<Q", 2) + good[17:])
    assert "Megatron-LM index version 2" in _error(prefix)
    (tmp_path / "c.idx").write_bytes(good[:17] + b"\x07" + good[18:])
    assert "holds float32 values (dtype code 7), not integer token ids" in _error(prefix)
    (tmp_path / "c.idx").write_bytes(good[:-8])
    assert "the index is truncated" in _error(prefix)
    (tmp_path / "c.idx").write_bytes(good)
    (tmp_path / "c.bin").write_bytes((tmp_path / "c.bin").read_bytes()[:-2])
    assert "the .bin and the .idx do not belong together" in _error(f"{prefix}.bin")
    (tmp_path / "c.bin").unlink()
    assert "c.bin: no such file (a Megatron-LM dataset is PREFIX.bin + PREFIX.idx)" in _error(f"{prefix}.idx")


def test_datasets_directories_without_input_ids_or_of_several_splits_are_one_line(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["a b"], "label": [0]}).save_to_disk(str(tmp_path / "raw"))
    assert "no input_ids column (its columns: text, label)" in _error(tmp_path / "raw")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": [[1]]})}).save_to_disk(
        str(tmp_path / "dd"))
    assert f"a DatasetDict of splits train; pass one split's directory, e.g. {tmp_path / 'dd' / 'train'}" in _error(
        tmp_path / "dd")
    (tmp_path / "plain").mkdir()
    assert "not one written by datasets' Dataset.save_to_disk" in _error(tmp_path / "plain")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    assert "needs the datasets package: pip install 'autoplan[data]'" in _error(tmp_path / "raw")


def test_token_ids_outside_the_models_vocabulary_name_the_largest_and_the_fix(tmp_path):
    tokens = np.random.default_rng(6).integers(0, 1000, 5000).astype(np.uint16)
    tokens[1234] = 60_000
    tokens.tofile(tmp_path / "t.bin")
    ds = open_dataset(str(tmp_path / "t.bin"), seq_len=8)
    ds.check_vocab(60_001)
    with pytest.raises(DatasetError) as info:
        ds.check_vocab(32_000)
    assert "token id 60000 >= the model's vocabulary of 32000 (uint16 tokens); tokenize with a tokenizer of this " \
           "model's vocabulary, or read the file with the dtype it was written with (PATH:uint16 or " \
           "PATH:uint32)" in str(info.value)
    np.array([5, -3] * 10, dtype=np.int32).tofile(tmp_path / "neg.bin")
    with pytest.raises(DatasetError, match=r"token id -3 < 0"):
        open_dataset(f"{tmp_path / 'neg.bin'}:int32", seq_len=4).check_vocab(100)


# --- through `autoplan run --data` -----------------------------------------------------------------------------

LLAMA = "llama:num_layers=2,hidden_size=32,num_heads=4,num_kv_heads=2,vocab_size=64,max_seq_len=16"


@pytest.fixture
def one_rank_env(monkeypatch):
    """`autoplan run` in this process as the one rank of a torchrun job: no interpreter to start (each
    costs torch's import, seconds on a loaded machine); conftest.py tears the process group down."""
    from _dist import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.setenv(name, "0")
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "1")


def test_autoplan_run_data_trains_on_the_token_files_batches_and_refuses_ids_past_the_vocab(tmp_path, one_rank_env):
    from _cli import run_main

    import autoplan
    from autoplan.runtime.launcher.training import token_inputs

    plan_path, metrics = tmp_path / "p.json", tmp_path / "m.jsonl"
    made = run_main("suggest", "--model", LLAMA, "--cluster", "1x1xcpu", "--global-batch", "4", "--seq-len", "16",
                    "--dtype", "fp32", "--out", str(plan_path))
    assert made.returncode == 0, made.stderr
    np.random.default_rng(0).integers(0, 64, 17 * 40).astype(np.uint16).tofile(tmp_path / "train.bin")
    ran = run_main("run", str(plan_path), "--steps", "2", "--data", str(tmp_path / "train.bin"),
                   "--metrics", str(metrics))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 2
    # step 0's loss is the untrained model's on the dataset's batch 0, as one process computes it
    pm = autoplan.partition(LLAMA, autoplan.Plan.load(str(plan_path)), device="cpu", seed=0)
    ids, targets = open_dataset(str(tmp_path / "train.bin"), seq_len=16, seed=0).batch(0, 4)
    expected = pm.step(*token_inputs(pm.source.input_templates(), ids), target=targets)
    assert losses[0] == pytest.approx(float(expected), rel=1e-5)

    tokens = np.random.default_rng(0).integers(0, 64, 17 * 40).astype(np.uint16)
    tokens[100] = 64
    tokens.tofile(tmp_path / "big.bin")
    bad = run_main("run", str(plan_path), "--steps", "1", "--data", str(tmp_path / "big.bin"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert "token id 64 >= the model's vocabulary of 64" in bad.stderr, bad.stderr
