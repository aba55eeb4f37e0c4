"""Tokenized training data on disk, read as fixed windows of a token stream (`open_dataset`).

Three formats, told apart by what is on disk:

- a flat token file as nanoGPT's `data/*/prepare.py` writes it (`np.array(ids, dtype=np.uint16)
  .tofile("train.bin")`; karpathy/nanoGPT `data/openwebtext/prepare.py`, read back in `train.py:get_batch`
  with `np.memmap(path, dtype=np.uint16, mode="r")`). Raw bytes carry no dtype, so it is uint16 unless
  the path ends in a dtype suffix: `train.bin:uint32` (vocabularies over 65535), `:int32`, `:uint16`, ...
  A `.npy` file carries its dtype in its header and needs no suffix.
- Megatron-LM's indexed dataset, `PREFIX.bin` + `PREFIX.idx` (pass `PREFIX`, `PREFIX.bin` or
  `PREFIX.idx`). The index (NVIDIA/Megatron-LM `megatron/core/datasets/indexed_dataset.py` at commit
  93261d7033e00196131ba9596651c32d38dd264a, `_IndexWriter`/`_IndexReader`), little-endian:
  9 bytes `b"MMIDIDX\\x00\\x00"`, u64 version (1), u8 dtype code (`DType`: 1 uint8, 2 int8, 3 int16,
  4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), u64 sequence count S, u64 document count D, then
  int32[S] sequence lengths, int64[S] byte pointers into the .bin, int64[D] document indices (optionally
  int8[S] modes, multimodal only). Read here with numpy alone, no megatron import.
- a Hugging Face `datasets` directory written by `Dataset.save_to_disk` with an `input_ids` column of
  token-id lists (`datasets` is imported only for this format: `pip install 'autoplan[data]'`).

Samples. The documents are concatenated into one token stream, as nanoGPT's token files are (one
stream, documents separated by the EOT token its prepare.py appends) and as Megatron's GPTDataset
does (NVIDIA/Megatron-LM `megatron/core/datasets/gpt_dataset.py` at e668a4fea46a0251f07d80f45d6450f486cd8157:
samples of `sequence_length + 1` tokens over the concatenated documents, `add_extra_token_to_sequence`).
The stream is cut into `num_samples = tokens // (seq_len + 1)` non-overlapping windows (Megatron's
consecutive samples share one token; here they do not, which drops 1 token in seq_len + 1 and keeps
sample i at a fixed offset, i * (seq_len + 1)); the tail shorter than a window is never read. A window
gives `ids = w[:-1]` and `targets = w[1:]`.

Order. Epoch e visits the windows in the permutation drawn by `numpy.random.default_rng([seed, e])`;
row j of step k is sample `k * global_batch + j` of the endless sequence epoch 0, epoch 1, ... So the
batch of step k is a pure function of (data, seq_len, seed, k, global_batch): every rank and every run,
resumed or straight, reads the same rows. (numpy's Generator streams are stable within a numpy version;
NEP 19 allows them to change across versions, so a resume after a numpy upgrade may see another order.)

`identity` names the data for checkpoints (checkpoint/identity.py refuses a resume on other data): its
`fingerprint` is a sha256 of the token count, the dtype and the first and last MiB of token bytes: cheap
on a file of any size, it tells another file apart, not an edit in the middle of the same one.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

__all__ = ["DatasetError", "TokenDataset", "open_dataset"]

_RAW_DTYPES = {name: np.dtype(name) for name in ("uint8", "uint16", "int16", "uint32", "int32", "int64")}
_MEGATRON_HEADER = b"MMIDIDX\x00\x00"
# Megatron-LM's DType codes (indexed_dataset.py above): code -> numpy dtype.
_MEGATRON_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32",
                    8: "uint16"}
_FINGERPRINT_BYTES = 1 << 20
_VOCAB_SCAN_TOKENS = 1 << 26  # check_vocab reads every token of a stream up to this size ...
_VOCAB_SCAN_BLOCKS = 64       # ... else this many evenly spaced blocks of _VOCAB_BLOCK_TOKENS
_VOCAB_BLOCK_TOKENS = 1 << 20


class DatasetError(ValueError):
    """The data cannot be read as training tokens (one-line message naming the problem and the fix)."""


class _Stream:
    """Token arrays (memory-mapped) read as one concatenated stream; reads copy only what they return."""

    def __init__(self, parts: Sequence[np.ndarray]):  # at least one part, maybe empty, to give the dtype
        self.dtype = parts[0].dtype
        self.parts = [p for p in parts if len(p)]
        self.starts = [0]
        for p in self.parts:
            self.starts.append(self.starts[-1] + len(p))

    def __len__(self) -> int:
        return self.starts[-1]

    def read(self, start: int, count: int) -> np.ndarray:
        out = np.empty(count, dtype=np.int64)
        i, done = bisect.bisect_right(self.starts, start) - 1, 0
        while done < count:
            part, offset = self.parts[i], start + done - self.starts[i]
            n = min(count - done, len(part) - offset)
            out[done:done + n] = part[offset:offset + n]
            done, i = done + n, i + 1
        return out

    def raw_bytes(self, start: int, count: int) -> bytes:
        """Token bytes of [start, start + count) in the stream's dtype (for the fingerprint)."""
        return self.read(start, count).astype(self.dtype).tobytes()


class TokenDataset:
    """Windows of `seq_len + 1` tokens of a token stream, in a seeded per-epoch order (module docstring)."""

    def __init__(self, stream: _Stream, *, format: str, path: str, spec: str, seq_len: int, seed: int):
        self._stream, self.format, self.path, self._spec = stream, format, path, spec
        self.seq_len, self.seed = seq_len, seed
        self.num_tokens = len(stream)
        self.dtype = str(stream.dtype)
        self.num_samples = self.num_tokens // (seq_len + 1)
        if self.num_samples < 1:
            raise DatasetError(f"{path}: {self.num_tokens} tokens, fewer than one sample of seq_len + 1 = "
                               f"{seq_len + 1}; use more data or a shorter seq_len")
        self._perm: tuple[int, np.ndarray] | None = None
        self.identity = {"format": format, "path": path, "tokens": self.num_tokens, "dtype": self.dtype,
                         "fingerprint": self._fingerprint(), "seq_len": seq_len, "seed": seed}

    def __repr__(self) -> str:
        return (f"TokenDataset({self.format}: {self.path}, {self.num_tokens} {self.dtype} tokens, "
                f"{self.num_samples} samples of {self.seq_len} + 1)")

    def __reduce__(self):
        # Sent to another process as what to open, never as the tokens a memmap would pickle.
        return _reopen, (self._spec, self.seq_len, self.seed)

    def _fingerprint(self) -> str:
        n = self.num_tokens
        block = max(1, _FINGERPRINT_BYTES // self._stream.dtype.itemsize)
        h = hashlib.sha256(f"{n} {self.dtype}\n".encode())
        h.update(self._stream.raw_bytes(0, min(block, n)))
        h.update(self._stream.raw_bytes(max(0, n - block), min(block, n)))
        return h.hexdigest()

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            index_dtype = np.int32 if self.num_samples < 2**31 else np.int64  # half the memory when it fits
            order = np.arange(self.num_samples, dtype=index_dtype)
            np.random.default_rng([self.seed, epoch]).shuffle(order)
            self._perm = (epoch, order)
        return self._perm[1]

    def sample(self, index: int) -> np.ndarray:
        """The `seq_len + 1` tokens (int64) of sample `index` of the endless epoch-after-epoch order."""
        if index < 0:
            raise IndexError(f"sample {index} < 0")
        epoch, position = divmod(index, self.num_samples)
        window = int(self._permutation(epoch)[position])
        return self._stream.read(window * (self.seq_len + 1), self.seq_len + 1)

    def batch(self, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, targets), int64 [global_batch, seq_len], of training step `step`: row j is sample
        `step * global_batch + j`; targets are the ids shifted left by one token."""
        if step < 0 or global_batch < 1:
            raise ValueError(f"batch(step={step}, global_batch={global_batch}): step >= 0 and global_batch >= 1")
        first = step * global_batch
        rows = np.stack([self.sample(first + j) for j in range(global_batch)])
        windows = torch.from_numpy(rows)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def _scan_blocks(self):
        n = self.num_tokens
        if n <= _VOCAB_SCAN_TOKENS:
            for start in range(0, n, _VOCAB_BLOCK_TOKENS):
                yield self._stream.read(start, min(_VOCAB_BLOCK_TOKENS, n - start))
            return
        last = n - _VOCAB_BLOCK_TOKENS
        for b in range(_VOCAB_SCAN_BLOCKS):
            yield self._stream.read(last * b // (_VOCAB_SCAN_BLOCKS - 1), _VOCAB_BLOCK_TOKENS)

    def check_vocab(self, vocab_size: int) -> None:
        """DatasetError if a token id is < 0 or >= `vocab_size`: every token of a stream up to 64 Mi
        tokens, else 64 evenly spaced blocks of 1 Mi tokens (the first and the last included)."""
        lo, hi = 0, 0
        for block in self._scan_blocks():
            lo, hi = min(lo, int(block.min())), max(hi, int(block.max()))
        if lo < 0:
            raise DatasetError(f"{self.path}: token id {lo} < 0 in {self.dtype} tokens; token ids are 0 .. "
                               f"{vocab_size - 1}: read the file with the dtype it was written with")
        if hi >= vocab_size:
            raise DatasetError(
                f"{self.path}: token id {hi} >= the model's vocabulary of {vocab_size} ({self.dtype} tokens); "
                f"tokenize with a tokenizer of this model's vocabulary, or read the file with the dtype it "
                f"was written with ({_dtype_hint(self.format)})")


def _dtype_hint(format: str) -> str:
    if format == "tokens":
        return "PATH:uint16 or PATH:uint32"
    if format == "megatron":
        return "the dtype code in PREFIX.idx"
    return "the input_ids column's type"


def _reopen(spec: str, seq_len: int, seed: int) -> TokenDataset:
    return open_dataset(spec, seq_len=seq_len, seed=seed)


def open_dataset(path: str, *, seq_len: int, seed: int = 0) -> TokenDataset:
    """Open tokenized data for training windows of `seq_len` (+1 for the targets), checking it is
    readable and holds at least one window; a DatasetError (one line) otherwise. `path` is a token
    file (`train.bin`, `train.bin:uint32`, `train.npy`), a Megatron-LM prefix (`PREFIX`, `PREFIX.bin`
    or `PREFIX.idx` with both files present) or a `datasets.Dataset.save_to_disk` directory."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise DatasetError(f"seq_len {seq_len!r} must be an integer >= 1")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise DatasetError(f"seed {seed!r} must be an integer >= 0")
    spec = str(path)
    file, dtype_name = spec, None
    head, sep, tail = spec.rpartition(":")
    if sep and tail in _RAW_DTYPES:
        file, dtype_name = head, tail
    p = Path(file).expanduser()
    megatron = _megatron_prefix(p)
    if megatron is not None:
        if dtype_name is not None:
            raise DatasetError(f"{spec}: a Megatron-LM dataset's dtype is in its .idx; drop the :{dtype_name}")
        stream, shown = _open_megatron(megatron), str(megatron.resolve())
        fmt = "megatron"
    elif p.is_dir():
        if dtype_name is not None:
            raise DatasetError(f"{spec}: a datasets directory's dtype is its column's; drop the :{dtype_name}")
        stream, shown, fmt = _open_hf(p), str(p.resolve()), "hf-datasets"
    elif p.is_file():
        stream, shown, fmt = _open_token_file(p, dtype_name), str(p.resolve()), "tokens"
    else:
        raise DatasetError(f"{file}: no such file or directory (a token file, a Megatron-LM PREFIX of "
                           f"PREFIX.bin + PREFIX.idx, or a datasets.save_to_disk directory)")
    return TokenDataset(stream, format=fmt, path=shown, spec=spec, seq_len=seq_len, seed=seed)


def _open_token_file(p: Path, dtype_name: str | None) -> _Stream:
    if p.suffix == ".npy":
        if dtype_name is not None:
            raise DatasetError(f"{p}: a .npy file's dtype is in its header; drop the :{dtype_name}")
        try:
            tokens = np.load(p, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise DatasetError(f"{p}: not a readable .npy array ({_first_line(exc)})") from None
        if tokens.dtype.kind not in "iu":
            raise DatasetError(f"{p}: holds {tokens.dtype} values, not integer token ids")
        return _Stream([tokens.reshape(-1)])  # a C-order [docs, len] array read row after row
    dtype = _RAW_DTYPES[dtype_name or "uint16"]
    size = p.stat().st_size
    if size % dtype.itemsize:
        raise DatasetError(f"{p}: {size} bytes is not a whole number of {dtype} tokens ({dtype.itemsize} bytes "
                           f"each); give the dtype it was written with: PATH:uint16 or PATH:uint32")
    if size == 0:
        return _Stream([np.zeros(0, dtype=dtype)])
    tokens = np.memmap(p, dtype=dtype, mode="r")
    if dtype_name is None:
        _refuse_uint32_as_uint16(p, tokens)
    return _Stream([tokens])


def _refuse_uint32_as_uint16(p: Path, tokens: np.ndarray) -> None:
    """uint32 ids below 65536 read as uint16 interleave each id with a 0 (little-endian high half):
    training would run on garbage without a single out-of-vocabulary id, so it is refused here."""
    head = np.asarray(tokens[: 1 << 16])
    if len(head) >= 128 and not head[1::2].any() and head[0::2].any():
        raise DatasetError(f"{p}: every other uint16 token is 0, as uint32 tokens read as uint16 are; "
                           f"read it as {p}:uint32 (or {p}:uint16 if it really is uint16)")


def _megatron_prefix(p: Path) -> Path | None:
    """PREFIX when `p` is PREFIX, PREFIX.bin or PREFIX.idx and an .idx file is there."""
    prefix = p.with_suffix("") if p.suffix in (".bin", ".idx") else p
    idx = prefix.with_name(prefix.name + ".idx")
    if idx.is_file() and (p.suffix in (".bin", ".idx") or not p.exists()):
        return prefix
    return None


def _open_megatron(prefix: Path) -> _Stream:
    idx, bin_path = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
    if not bin_path.is_file():
        raise DatasetError(f"{bin_path}: no such file (a Megatron-LM dataset is PREFIX.bin + PREFIX.idx)")
    idx_size = idx.stat().st_size
    with open(idx, "rb") as f:
        header = f.read(34)
    expected = "a Megatron-LM index starts b'MMIDIDX\\x00\\x00', version 1"
    if len(header) < 34 or header[:9] != _MEGATRON_HEADER:
        raise DatasetError(f"{idx}: not a Megatron-LM index (starts {header[:9]!r}; {expected})")
    version, code, num_seqs, num_docs = struct.unpack("<QBQQ", header[9:])
    if version != 1:
        raise DatasetError(f"{idx}: Megatron-LM index version {version}; {expected}")
    if code not in _MEGATRON_DTYPES:
        raise DatasetError(f"{idx}: unknown dtype code {code} (Megatron-LM's DType codes are 1-8)")
    dtype = np.dtype(_MEGATRON_DTYPES[code])
    if dtype.kind not in "iu":
        raise DatasetError(f"{idx}: holds {dtype} values (dtype code {code}), not integer token ids")
    needed = 34 + num_seqs * (4 + 8) + num_docs * 8
    if idx_size < needed:
        raise DatasetError(f"{idx}: {idx_size} bytes, fewer than the {needed} its header's {num_seqs} sequences "
                           f"and {num_docs} documents need; the index is truncated")
    bin_size = bin_path.stat().st_size
    if bin_size % dtype.itemsize:
        raise DatasetError(f"{bin_path}: {bin_size} bytes is not a whole number of {dtype} tokens (the dtype "
                           f"code {code} in {idx.name}); the .bin and the .idx do not belong together")
    num_tokens = bin_size // dtype.itemsize
    if num_seqs:
        lengths = np.memmap(idx, dtype="<i4", mode="r", offset=34, shape=(num_seqs,))
        pointers = np.memmap(idx, dtype="<i8", mode="r", offset=34 + 4 * num_seqs, shape=(num_seqs,))
        _check_back_to_back(idx, bin_path, lengths, pointers, dtype.itemsize, bin_size)
    elif bin_size:
        raise DatasetError(f"{idx}: lists no sequences, but {bin_path.name} holds {num_tokens} tokens; "
                           "the .bin and the .idx do not belong together")
    if num_tokens == 0:
        return _Stream([np.zeros(0, dtype=dtype)])
    return _Stream([np.memmap(bin_path, dtype=dtype.newbyteorder("<"), mode="r")])


def _check_back_to_back(idx: Path, bin_path: Path, lengths: np.ndarray, pointers: np.ndarray, itemsize: int,
                        bin_size: int) -> None:
    """The windows cross sequence boundaries, so the .bin must be the sequences back to back, as Megatron's
    builders write them (`_IndexWriter._sequence_pointers`: each pointer is the previous one plus its
    length in bytes). Every sequence up to 4 Mi of them (48 MiB of index read), else the ends and 4096
    evenly spaced ones: opening stays cheap on every rank of a corpus of 100M documents."""
    num_seqs = len(lengths)
    ends_ok = pointers[0] == 0 and int(pointers[-1]) + int(lengths[-1]) * itemsize == bin_size
    if num_seqs <= 1 << 22:
        at = np.arange(num_seqs - 1)
    else:
        at = np.unique(np.linspace(0, num_seqs - 2, 4096).astype(np.int64))
    gaps = np.asarray(pointers[at + 1], dtype=np.int64) - np.asarray(pointers[at], dtype=np.int64)
    if not ends_ok or not np.array_equal(gaps, np.asarray(lengths[at], dtype=np.int64) * itemsize):
        raise DatasetError(f"{idx}: its sequences are not back to back over the {bin_size} bytes of "
                           f"{bin_path.name}; the .bin and the .idx do not belong together, or rewrite them "
                           "with Megatron-LM's IndexedDatasetBuilder")


def _open_hf(p: Path) -> _Stream:
    if (p / "dataset_dict.json").is_file():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        raise DatasetError(f"{p}: a DatasetDict of splits {', '.join(splits) or '(none)'}; pass one split's "
                           f"directory, e.g. {p / (splits[0] if splits else 'train')}")
    if not (p / "state.json").is_file():
        raise DatasetError(f"{p}: a directory, but not one written by datasets' Dataset.save_to_disk "
                           "(no state.json)")
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{p}: reading a Hugging Face datasets directory needs the datasets package: "
                           "pip install 'autoplan[data]'") from None
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as exc:  # datasets raises many kinds; the user needs the one line
        raise DatasetError(f"{p}: datasets.load_from_disk failed: {_first_line(exc)}") from None
    if "input_ids" not in ds.column_names:
        raise DatasetError(f"{p}: no input_ids column (its columns: {', '.join(ds.column_names)}); tokenize "
                           "it first: ds.map(lambda b: tokenizer(b['text']), batched=True).save_to_disk(...)")
    if ds._indices is not None:  # a select/shuffle view: apply it once, as save_to_disk itself does
        ds = ds.flatten_indices()
    import pyarrow as pa

    parts = []
    for chunk in ds.data.column("input_ids").chunks:
        if not (pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type)
                or pa.types.is_fixed_size_list(chunk.type)):
            raise DatasetError(f"{p}: input_ids holds {chunk.type}, not lists of token ids")
        values = chunk.flatten()  # the rows' ids back to back, honouring the chunk's offsets
        if values.null_count:
            raise DatasetError(f"{p}: input_ids holds missing (null) token ids")
        if not pa.types.is_integer(values.type):
            raise DatasetError(f"{p}: input_ids holds lists of {values.type}, not integer token ids")
        parts.append(values.to_numpy(zero_copy_only=True))  # a view of the memory-mapped Arrow file
    if not parts:
        return _Stream([np.zeros(0, dtype=np.int64)])
    return _Stream(parts)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
