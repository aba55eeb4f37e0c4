"""A rank loading a sharded checkpoint holds its share plus one tensor, never the whole model (issue 41,
"peak memory of a rank loading a sharded checkpoint"; runtime/checkpoint/weights.py [Note: reading a box without
holding the file]).

A transformers Llama of 200 MB (fp32) is saved with `save_pretrained` in six safetensors shards and
partitioned at tp 2 with `autoplan.partition(..., init=DIR)` on two gloo ranks. Each rank's memory
growth over the partition is at most its parameters (100 MB) plus the largest tensor of the
checkpoint (16 MB) plus a fixed allowance (`ALLOWANCE_BYTES`), 140 MB in all: less than the full
weights, so a rank that read them, or kept the pages of what it read mapped, fails. Measured
(`python -m pytest -s -m extended tests/test_sharded_load_memory.py`, 2 CPU cores): each rank grew
by 125 MB, the load alone by 16 MB; with safetensors' mapped reader, before weights.py read the files
itself, by 235-255 MB and 131-150 MB.

[Note: measuring a rank's peak memory on the CPU]
torch's CPU allocator keeps no statistics of its own and tracemalloc does not see tensor storage, so
the measure is the kernel's: the peak resident set size (`VmHWM` in /proc/self/status, which counts
anonymous memory and mapped file pages alike), reset to the current size by writing 5 to
/proc/self/clear_refs just before the partition, less the resident size then (`VmRSS`). Two things
would make it lie, and each rank removes them first:
- glibc's malloc keeps freed blocks below its dynamic mmap threshold (up to 32 MB) in its heap and
  reuses them, so a freed tensor's memory stays resident and the next allocation adds nothing to
  the peak (measured here: a load's growth read 0 MB). `mallopt(M_MMAP_THRESHOLD, 64 KiB)` fixes the
  threshold (and turns its adjustment off, mallopt(3)): every tensor above 64 KiB is a mapping of its
  own, returned when freed, so the resident size follows the live tensors.
- one-time costs of a first partition in a process (imports of the model's modeling code, torch's
  tracing caches) are not the load's: a partition without weights runs first and is dropped.
"""

from __future__ import annotations

import ctypes
import gc
import json
import re
import struct
from pathlib import Path

import pytest
import torch
from _dist import run_ranks

import autoplan

transformers = pytest.importorskip("transformers")

MiB = 1 << 20
ALLOWANCE_BYTES = 24 * MiB
"""What a partition may hold beyond its parameters and one tensor: weights.py's read buffer of whole
rows (`_BLOCK_BYTES`, 8 MB) and 16 MB for the partition's own objects (graphs, stage modules,
process-group buffers), measured at 9 MB over share + one tensor on this model."""

M_MMAP_THRESHOLD = -3  # glibc malloc.h


def _status() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {key: int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024 for key in ("VmRSS", "VmHWM")}


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (proc(5), /proc/pid/clear_refs)


def _local_bytes(pm) -> int:
    total = 0
    for p in pm.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _rank_peaks(rank: int, world_size: int, spec: str, directory: str, plan) -> dict:
    from autoplan.runtime.checkpoint.weights import load_weights

    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024) == 1
    warm = autoplan.partition(spec, plan, device="cpu")  # the one-time costs ([Note: measuring a rank's peak memory])
    del warm
    gc.collect()
    libc.malloc_trim(0)
    _reset_peak()
    before = _status()["VmRSS"]
    pm = autoplan.partition(spec, plan, device="cpu", init=directory)
    partition_peak = _status()["VmHWM"] - before
    _reset_peak()  # the load alone, once more: what reading the boxes adds to the rank's parameters
    before = _status()["VmRSS"]
    load_weights(pm, directory)
    load_peak = _status()["VmHWM"] - before
    return dict(share=_local_bytes(pm), partition_peak=partition_peak, load_peak=load_peak)


def _largest_tensor_bytes(directory: Path) -> tuple[int, int]:
    """(the largest tensor's bytes, all tensors' bytes) from the safetensors headers."""
    sizes = []
    for file in directory.glob("*.safetensors"):
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        sizes += [e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__"]
    return max(sizes), sum(sizes)


@pytest.mark.multiproc
@pytest.mark.extended
@pytest.mark.timeout(400)
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_a_rank_loading_a_sharded_checkpoint_holds_its_share_plus_one_tensor(tmp_path):
    config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=1024, intermediate_size=4096,
                                      num_attention_heads=8, num_key_value_heads=8, vocab_size=1024,
                                      max_position_embeddings=64)
    directory = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="50MB")
    assert len(list(directory.glob("*.safetensors"))) >= 4
    largest, full = _largest_tensor_bytes(directory)
    spec = f"hf:{directory}"
    plan = autoplan.suggest(spec, "1x2xcpu", global_batch=2, seq_len=16, dtype="fp32", tp=2, pp=1, dp=1, top=1)[0]
    results = run_ranks(_rank_peaks, 2, spec, str(directory), plan, timeout_s=360, pg_timeout_s=240)
    for rank, r in results.items():
        bound = r["share"] + largest + ALLOWANCE_BYTES
        print(f"rank {rank}: partition(init=) +{r['partition_peak'] / MiB:.1f} MB (bound {bound / MiB:.1f}: share "
              f"{r['share'] / MiB:.1f} + largest {largest / MiB:.1f} + {ALLOWANCE_BYTES / MiB:.0f}); load alone "
              f"+{r['load_peak'] / MiB:.1f} MB; full weights {full / MiB:.1f} MB")  # the figures, with -s
        assert r["share"] < 0.55 * full  # tp 2 holds half the weights (norms whole)
        assert bound < full, "the model must be larger than what one rank may hold"
        assert r["partition_peak"] <= bound, (
            f"rank {rank}: partition(init=) grew by {r['partition_peak'] / MiB:.1f} MB; share {r['share'] / MiB:.1f} + "
            f"largest tensor {largest / MiB:.1f} + allowance {ALLOWANCE_BYTES / MiB:.0f} MB")
        # Reading the boxes adds at most a box (half a tensor at tp 2) and the read buffer.
        assert r["load_peak"] <= largest + 8 * MiB + 4 * MiB, f"rank {rank}: the load grew by {r['load_peak'] / MiB:.1f} MB"


@pytest.mark.parametrize("block_bytes", [8 << 20, 64])  # whole rows at once, and one row per read
def test_boxes_read_equal_safetensors_own_slices(tmp_path, monkeypatch, block_bytes):
    """weights.py's reader against safetensors' `get_slice` on every kind of box (a value check: the
    losses after `--init` are tests/test_weights_in_out.py's)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from autoplan.runtime.checkpoint import weights

    monkeypatch.setattr(weights, "_BLOCK_BYTES", block_bytes)
    gen = torch.Generator().manual_seed(0)
    tensors = {"matrix": torch.randn(12, 10, generator=gen), "experts": torch.randn(4, 6, 5, generator=gen),
               "half": torch.randn(7, 9, generator=gen).to(torch.bfloat16), "ids": torch.arange(11),
               "scalar": torch.tensor(3.5), "vector": torch.randn(13, generator=gen)}
    save_file(tensors, tmp_path / "t.safetensors")
    source = weights.open_weights(tmp_path / "t.safetensors")
    boxes = {"matrix": [((0, 0), (12, 10)), ((6, 0), (6, 10)), ((0, 5), (12, 5)), ((3, 2), (5, 7)), ((0, 0), (0, 10))],
             "experts": [((2, 0, 0), (2, 6, 5)), ((0, 3, 0), (4, 3, 5)), ((1, 2, 1), (2, 3, 3))],
             "half": [((0, 4), (7, 5)), ((2, 0), (3, 9))], "ids": [((0,), (11,)), ((5,), (6,))],
             "scalar": [((), ())], "vector": [((3,), (7,))]}
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as reference:
        for name, cases in boxes.items():
            assert source.shapes[name] == tuple(tensors[name].shape)
            for offsets, sizes in cases:
                got = source.read(name, offsets, sizes)
                want = reference.get_tensor(name) if not sizes else reference.get_slice(name)[
                    tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
                assert got.dtype == want.dtype and torch.equal(got, want), (name, offsets, sizes)
    source.close()
