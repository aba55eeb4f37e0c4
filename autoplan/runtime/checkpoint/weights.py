"""Weights in: a model's full weights (a Hugging Face safetensors directory, a `torch.save`d state dict,
an in-memory state dict, or an autoplan checkpoint) copied into this rank's `PartitionedModel`, each
rank reading only the slices it holds.

[Note: a rank's boxes of the full tensors]
Every tensor of `pm.state_dict()` is named as in the full model and is, on this rank, one or more
boxes (global offsets, sizes, local view) of the full tensor: the boxes the checkpoint code already
computes to save it (checkpoint/state.py, checkpoint/planners.py). A tp or FSDP shard is a DTensor
whose placements say where it sits (`pieces_of`, which also splits a fused q/k/v or [gate | up] shard
sharded by thirds or halves into its boxes); an expert slice under ep (and expert tp) is a plain
tensor or an FSDP DTensor of the slice, placed by its ep and tp indices (`ExpertSlices.pieces`,
[Note: experts in a checkpoint]). Loading reads each box from the source and copies it into its
view, so the expert slices that `PartitionedModel.load_state_dict` used to copy whole (issue 41:
"size of tensor a (2) must match the size of tensor b (4)" at ep 2) land where they belong, and a
safetensors file is read box by box, never whole, and never mapped whole into the rank's memory
([Note: reading a box without holding the file]).

[Note: transformers' checkpoint conversions]
transformers 5 builds a MoE model with stacked experts (`mlp.experts.gate_up_proj`, (E, 2F, H)) but
writes and reads checkpoints in the original per-expert layout (`block_sparse_moe.experts.0.w1.weight`)
through the conversions `transformers.conversion_mapping.get_checkpoint_conversion_mapping(model_type)`
lists: renamings, and converters that stack a module list (`MergeModulelist(dim=0)`) and concatenate
parts (`Concatenate(dim)`). `_converted` reads those two lazily, each box of a stacked tensor from the
experts and parts it overlaps; a checkpoint that needs any other conversion is refused in one line.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autoplan.runtime.parallel.errors import PartitionError

__all__ = ["WeightSource", "WeightsError", "check_weights", "load_state_dict_slices", "load_weights", "open_weights"]

Box = tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]
"""(offsets in the full tensor, sizes, this rank's view to copy into)."""


class WeightsError(PartitionError):
    """Weights that do not fit the partitioned model (one line naming the first key and the fix)."""


# ---- sources: the full tensors by name, read box by box -------------------------------------------


@dataclass
class WeightSource:
    """Full tensors by name: their shapes, and a box of one read on demand."""

    where: str
    """The source, for messages ("weights 'dir/'")."""
    shapes: dict[str, tuple[int, ...]]
    read: Callable[[str, tuple[int, ...], tuple[int, ...]], torch.Tensor]
    """read(name, offsets, sizes): that box of the full tensor."""
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for close in self.closers:
            close()


def _slices(offsets: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))


def _state_dict_source(state_dict: Mapping[str, Any], where: str) -> WeightSource:
    from torch.distributed.tensor import DTensor

    tensors: dict[str, torch.Tensor] = {}
    for name, value in state_dict.items():
        if isinstance(value, DTensor):  # a user's distributed tensor: its whole value (collective)
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            tensors[name] = value
    return WeightSource(where, {n: tuple(t.shape) for n, t in tensors.items()},
                        lambda name, offsets, sizes: tensors[name][_slices(offsets, sizes)])


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightsError(f"weights {str(index)!r} is not a safetensors index ({exc}); re-save the model with "
                               "save_pretrained") from None
        files = sorted({directory / f for f in weight_map.values()})
        absent = [f for f in files if not f.is_file()]
        if absent:
            raise WeightsError(f"weights {str(directory)!r}: the index names {absent[0].name!r}, which is not there; "
                               "copy every shard the index lists")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"weights {str(directory)!r} hold no model.safetensors (nor an index of shards); point "
                           "--init at a save_pretrained(..., safe_serialization=True) directory, a torch.save file or "
                           "an autoplan checkpoint")
    return files


def _safetensors_source(directory: Path, model_type: str | None) -> WeightSource:
    where = f"weights {str(directory)!r}"
    files = [_SafetensorsFile(file) for file in _safetensors_files(directory)]
    by_name = {name: f for f in files for name in f.entries}
    source = WeightSource(where, {name: f.shape(name) for name, f in by_name.items()},
                          lambda name, offsets, sizes: by_name[name].read(name, offsets, sizes),
                          [f.close for f in files])
    return _converted(source, model_type)


# [Note: reading a box without holding the file]
# safetensors' own reader (`safe_open`) maps each file into memory; a box read through its lazy
# slices copies only the box, but every page the box spans stays resident in the process while the
# file is open: a rank reading its columns of a row-parallel weight (every row holds some) keeps the
# whole tensor's pages, and with every shard open at once its resident memory grew by 130-150 MB
# reading its 100 MB half of a 200 MB checkpoint at tp 2 (tests/test_sharded_load_memory.py). So the
# files are read with plain unbuffered reads (the pages pass through the kernel's page cache, which
# is not the process's and is reclaimed under pressure) into fresh tensors, by the format's own
# layout (huggingface/safetensors README, "Format": an 8-byte little-endian header length, a JSON
# header naming each tensor's dtype, shape and data_offsets from the end of the header, row-major
# data): a box whole in every dimension after the first is one read straight into the result; any
# other is read a block of whole rows (of the first dimension) at a time into a buffer of at most
# `_BLOCK_BYTES` (or one row) and its part copied out. A rank's memory then grows by the box it
# reads and that buffer, nothing else.

_BLOCK_BYTES = 8 << 20
"""The most bytes of whole rows read at once for a box that takes part of each row."""

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class _SafetensorsFile:
    """One safetensors file, its tensors read box by box into fresh tensors ([Note: reading a box
    without holding the file])."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.file = open(path, "rb", buffering=0)  # noqa: SIM115 - open while the load reads it; close()
        except OSError as exc:
            raise WeightsError(f"weights {str(path)!r} cannot be read ({exc.strerror}); check the file") from None
        try:
            (length,) = struct.unpack("<Q", self.file.read(8))
            header = json.loads(self.file.read(length))
            self.base = 8 + length
            self.entries = {k: v for k, v in header.items() if k != "__metadata__"}
            for name, entry in self.entries.items():
                if entry["dtype"] not in _SAFETENSORS_DTYPES:
                    raise WeightsError(f"weights {str(path)!r}: {name!r} is of dtype {entry['dtype']}, which autoplan "
                                       "does not read; save it as F32, F16 or BF16")
        except (struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
            self.file.close()
            raise WeightsError(f"weights {str(path)!r} is not a safetensors file ({type(exc).__name__}); re-save the "
                               "model with save_pretrained") from None
        except WeightsError:
            self.file.close()
            raise

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def close(self) -> None:
        self.file.close()

    def _read_into(self, out: torch.Tensor, offset: int) -> None:
        """Fill the contiguous tensor `out` with the file's bytes from `offset`."""
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        self.file.seek(offset)
        done = 0
        while done < len(view):  # a raw read may return fewer bytes than asked
            got = self.file.readinto(view[done:])
            if not got:
                raise WeightsError(f"weights {str(self.path)!r} end before their header says; copy the file again")
            done += got

    def read(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        entry = self.entries[name]
        dtype, shape = _SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"])
        start = self.base + int(entry["data_offsets"][0])
        if not shape or not sizes:  # a scalar
            out = torch.empty(shape, dtype=dtype)
            self._read_into(out.reshape(1), start)
            return out
        out = torch.empty(sizes, dtype=dtype)
        if out.numel() == 0:
            return out
        itemsize = out.element_size()
        row_numel = 1
        for n in shape[1:]:
            row_numel *= n
        row_bytes = row_numel * itemsize
        if tuple(sizes[1:]) == shape[1:]:  # whole rows: one read into the result
            self._read_into(out, start + offsets[0] * row_bytes)
            return out
        rest = _slices(offsets[1:], sizes[1:])
        rows_per_block = max(1, _BLOCK_BYTES // max(row_bytes, 1))
        buffer = torch.empty((min(rows_per_block, sizes[0]), *shape[1:]), dtype=dtype)
        for first in range(0, sizes[0], rows_per_block):
            count = min(rows_per_block, sizes[0] - first)
            block = buffer[:count]
            self._read_into(block, start + (offsets[0] + first) * row_bytes)
            out[first:first + count] = block[(slice(None), *rest)]
        return out


# ---- transformers' conversions ([Note: transformers' checkpoint conversions]) -----------------


def _conversions(model_type: str | None) -> list[Any]:
    if not model_type:
        return []
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers < 5: checkpoints are in the model's own layout
        return []
    return list(get_checkpoint_conversion_mapping(model_type) or [])


def _converted(source: WeightSource, model_type: str | None) -> WeightSource:
    """`source` under the model's names, its renamings and stacked experts applied lazily."""
    conversions = _conversions(model_type)
    if not conversions:
        return source
    renamings = [c for c in conversions if type(c).__name__ == "WeightRenaming"]
    converters = [c for c in conversions if type(c).__name__ == "WeightConverter"]
    renamed: dict[str, str] = {}  # model-side name -> file name
    for name in source.shapes:
        new = name
        for r in renamings:
            for src, dst in zip(r.source_patterns, r.target_patterns, strict=True):
                new = re.sub(src, dst, new)
        renamed[new] = name
    stacked: dict[str, dict[int, dict[int, str]]] = {}  # target -> part -> expert -> file name
    plain: dict[str, str] = {}
    kinds: dict[str, tuple[Any, int | None]] = {}
    for new, old in renamed.items():
        for conv in converters:
            hit = None
            for part, pattern in enumerate(conv.source_patterns):
                regex = re.escape(pattern).replace(r"\*", r"(\d+)")
                m = re.search(regex, new)
                if m:
                    hit = (part, m)
                    break
            if hit is None:
                continue
            part, m = hit
            target = new[:m.start()] + conv.target_patterns[0] + new[m.end():]
            stacked.setdefault(target, {}).setdefault(part, {})[int(m.group(1))] = old
            kinds[target] = (conv, len(conv.source_patterns))
            break
        else:
            plain[new] = old
    shapes = {new: source.shapes[old] for new, old in plain.items()}
    parts_of: dict[str, tuple[list[list[str]], int]] = {}
    for target, parts in stacked.items():
        conv, num_parts = kinds[target]
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in conv.operations]
        if not ops or ops[0] != ("MergeModulelist", 0) or any(o[0] != "Concatenate" for o in ops[1:]) or len(ops) > 2:
            raise WeightsError(f"{source.where}: {target!r} is made by transformers' conversion {ops}, which autoplan "
                               "does not read slice by slice; load the model with transformers and save its state "
                               "dict with torch.save, then point --init at that file")
        concat_dim = ops[1][1] - 1 if len(ops) == 2 else 0  # Concatenate's dim counts the stacked axis
        experts = sorted(parts.get(0, {}))
        if len(parts) != num_parts or any(sorted(p) != experts for p in parts.values()) \
                or experts != list(range(len(experts))):
            raise WeightsError(f"{source.where}: the experts of {target!r} are incomplete (parts {sorted(parts)}, "
                               f"experts {experts}); copy every shard of the checkpoint")
        files = [[parts[p][e] for p in range(num_parts)] for e in experts]
        one = [source.shapes[f] for f in files[0]]
        whole = list(one[0])
        whole[concat_dim] = sum(s[concat_dim] for s in one)
        shapes[target] = (len(experts), *whole)
        parts_of[target] = (files, concat_dim)

    def read(name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        if name in plain:
            return source.read(plain[name], offsets, sizes)
        files, axis = parts_of[name]
        rest_offsets, rest_sizes = list(offsets[1:]), list(sizes[1:])
        lo, hi = rest_offsets[axis], rest_offsets[axis] + rest_sizes[axis]
        out = None  # filled piece by piece: the box and one expert's part at a time, no concatenated copies
        for e in range(offsets[0], offsets[0] + sizes[0]):
            start = 0
            for file in files[e]:
                length = source.shapes[file][axis]
                a, b = max(lo, start), min(hi, start + length)
                if a < b:  # this part overlaps the box along the concatenated axis
                    o, n = list(rest_offsets), list(rest_sizes)
                    o[axis], n[axis] = a - start, b - a
                    piece = source.read(file, tuple(o), tuple(n))
                    if out is None:
                        out = torch.empty(sizes, dtype=piece.dtype)
                    out[e - offsets[0]].narrow(axis, a - lo, b - a).copy_(piece)
                    del piece
                start += length
        return out if out is not None else torch.empty(sizes)

    return WeightSource(source.where, shapes, read, source.closers)


# ---- opening a path ---------------------------------------------------------------------------


def _is_autoplan_checkpoint(path: Path) -> bool:
    from autoplan.runtime.checkpoint import list_checkpoints
    from autoplan.runtime.checkpoint.format import MANIFEST

    return path.is_dir() and ((path / MANIFEST).is_file() or bool(list_checkpoints(path)))


def _model_type(path: Path) -> str | None:
    config = path / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None


def open_weights(path: str | os.PathLike) -> WeightSource:
    """A Hugging Face directory (config.json + model.safetensors, or shards with
    model.safetensors.index.json), a safetensors file, or a `torch.save`d state dict (loaded memory-
    mapped, so a rank reads the pages of its slices). Not an autoplan checkpoint (`load_weights`
    restores those through DCP)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return _safetensors_source(p, _model_type(p))
    if not p.is_file():
        raise WeightsError(f"weights {str(p)!r} do not exist; --init takes a Hugging Face directory (safetensors), "
                           "a torch.save state dict or an autoplan checkpoint directory")
    if p.suffix == ".safetensors":
        return _safetensors_source_file(p)
    try:
        try:
            loaded = torch.load(p, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped: read it whole
            loaded = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a file that is not its own
        raise WeightsError(f"weights {str(p)!r} are not a torch.save state dict ({type(exc).__name__}); save the "
                           "model's state_dict() with torch.save, or point --init at a safetensors directory") from None
    for key in ("model", "state_dict", "model_state_dict"):  # a training script's {"model": ..., "optimizer": ...}
        if isinstance(loaded, Mapping) and isinstance(loaded.get(key), Mapping):
            loaded = loaded[key]
    if not isinstance(loaded, Mapping):
        raise WeightsError(f"weights {str(p)!r} hold a {type(loaded).__name__}, not a state dict; save "
                           "model.state_dict() with torch.save")
    return _state_dict_source(loaded, f"weights {str(p)!r}")


def _safetensors_source_file(file: Path) -> WeightSource:
    handle = _SafetensorsFile(file)
    shapes = {n: handle.shape(n) for n in handle.entries}
    return _converted(WeightSource(f"weights {str(file)!r}", shapes, handle.read, [handle.close]),
                      _model_type(file.parent))


# ---- this rank's boxes ([Note: a rank's boxes of the full tensors]) -----------------------------


@dataclass
class _Target:
    key: str
    """The name the full tensor is saved under (a tied parameter's first name)."""
    names: list[str]
    """Every local name of it on this rank."""
    shape: tuple[int, ...]
    """The full tensor's shape."""
    copies: list[list[Box]]
    """Per local copy, its boxes."""
    is_param: bool


def _boxes_of(tensor: torch.Tensor, key: str, experts) -> tuple[tuple[int, ...], list[Box]]:
    from torch.distributed.tensor import DTensor

    from autoplan.runtime.checkpoint.planners import pieces_of

    if key in experts.names:
        pieces = experts.pieces(tensor, key)
        return tuple(pieces.shape), pieces.boxes
    if isinstance(tensor, DTensor):
        pieces = pieces_of(tensor)
        return tuple(pieces.shape), pieces.boxes
    return tuple(tensor.shape), ([((0,) * tensor.dim(), tuple(tensor.shape), tensor)] if tensor.numel() or
                                 tensor.dim() == 0 else [])


def _targets(pm) -> list[_Target]:
    from autoplan.runtime.checkpoint.state import canonical_name, expert_slices, model_state

    experts = expert_slices(pm)
    params = {canonical_name(pm, name) for name, _ in pm.named_parameters()}
    out = []
    for key, local in model_state(pm).items():
        shape, copies = None, []
        for _, tensor in local:
            shape, boxes = _boxes_of(tensor, key, experts)
            copies.append(boxes)
        out.append(_Target(key, [n for n, _ in local], shape, copies, key in params))
    return out


def _source_name(target: _Target, source: WeightSource, aliases: Mapping[str, str]) -> str | None:
    """The source's name for `target`: its key, or another name of the same tied parameter."""
    if target.key in source.shapes:
        return target.key
    for name in target.names:
        if name in source.shapes:
            return name
    return next((other for other, canonical in aliases.items() if canonical == target.key and other in source.shapes),
                None)


def _model_names(pm) -> set[str] | None:
    """Every name of the whole model's parameters and persistent buffers (tied aliases included), or
    None when the source cannot build it."""
    source = getattr(pm, "source", None)
    if source is None:
        return None
    try:
        model = source.build("meta")
    except Exception:  # noqa: BLE001 - the check is a courtesy; the load itself does not need it
        return None
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    names |= set(model.state_dict(keep_vars=True))
    return names | set(getattr(pm, "aliases", {}))


_COMPUTED_BUFFERS = re.compile(r"(inv_freq|(^|\.)masked_bias|(^|\.)attn\.bias|_extra_state)$")
"""Buffers transformers computes itself (rotary `inv_freq`, `original_inv_freq`; GPT-2's causal
mask): absent from its checkpoints, or saved by older versions and ignored on load."""


def _check(pm, targets: list[_Target], source: WeightSource, *, strict: bool, fix: str,
           model_names: set[str] | None = None) -> list[str]:
    """The local names with no tensor in the source (buffers transformers computes are allowed to
    be absent); a parameter missing (with `strict`), a tensor of another shape, or (with `strict`) a
    tensor the model has no place for: one line naming the first."""
    aliases = getattr(pm, "aliases", {})
    missing, missing_params = [], []
    for t in targets:
        name = _source_name(t, source, aliases)
        if name is None:
            if t.is_param or not _COMPUTED_BUFFERS.search(t.key):  # a computed buffer keeps its value
                missing += t.names
            if t.is_param:
                missing_params.append(t.key)
            continue
        if tuple(source.shapes[name]) != tuple(t.shape):
            raise WeightsError(f"{source.where}: {name!r} has shape {tuple(source.shapes[name])}, this model's "
                               f"{tuple(t.shape)}; {fix}")
    if strict and missing_params:
        raise WeightsError(f"{source.where} have no tensor {missing_params[0]!r} ({len(missing_params)} of this rank's "
                           f"parameters missing); {fix}")
    if strict:
        names = model_names if model_names is not None else _model_names(pm)
        if names is not None:
            unexpected = sorted(n for n in source.shapes if n not in names and not _COMPUTED_BUFFERS.search(n))
            if unexpected:
                raise WeightsError(f"{source.where} hold {unexpected[0]!r} ({len(unexpected)} tensors in all), which "
                                   f"this model has no parameter for; {fix}")
    return missing


@torch.no_grad()
def _copy(pm, targets: list[_Target], source: WeightSource) -> None:
    aliases = getattr(pm, "aliases", {})
    for t in targets:
        name = _source_name(t, source, aliases)
        if name is None:
            continue
        read: dict[tuple, torch.Tensor] = {}  # tied copies on this rank read each box once
        for boxes in t.copies:
            for offsets, sizes, view in boxes:
                box = (tuple(offsets), tuple(sizes))
                if box not in read:
                    read[box] = source.read(name, *box)
                view.copy_(read[box].to(view.dtype))
    precision = getattr(pm, "precision", None)
    if precision is not None:  # the bf16 working copies follow the loaded fp32 masters
        precision.refresh()


_FIX = ("load weights of the model the plan was made for (plan hf:DIR with the checkpoint's own config.json), or "
        "re-plan for this checkpoint's model")


def load_state_dict_slices(pm, state_dict: Mapping[str, torch.Tensor], strict: bool = False) -> list[str]:
    """Copy this rank's slices of a FULL state dict (the whole model's tensors by name, as a
    single-process model's `state_dict()`) into `pm`, in every layout (tp, sp, pp, dp, ZeRO, FSDP,
    HSDP, cp, ep, expert tp, tied copies): what `PartitionedModel.load_state_dict` does. Returns the
    local names the state dict has no tensor for; with `strict`, a missing parameter or an entry the
    model has none for is a one-line `WeightsError`, as is a tensor of another shape in any case."""
    targets = _targets(pm)
    source = _state_dict_source(state_dict, "the state dict")
    missing = _check(pm, targets, source, strict=strict, fix=_FIX)
    _copy(pm, targets, source)
    return missing


def load_weights(pm, path: str | os.PathLike, *, strict: bool = True) -> list[str]:
    """Load this rank's slices of the weights at `path` into `pm` (no collective; every rank calls it
    for its own part): a Hugging Face directory (config.json + model.safetensors or shards with an
    index; transformers' per-expert layout is stacked as the model holds it, [Note: transformers'
    checkpoint conversions]), a safetensors file, a `torch.save`d state dict, or an autoplan
    checkpoint (a `step-N` directory or a --checkpoint-dir: restored through DCP, model only).
    Returns the local names not found (persistent buffers the source lacks keep their values). With
    `strict` (the default), a parameter the weights lack, a tensor the model has no place for, or a
    tensor of another shape is a one-line `WeightsError` naming the first, before anything is
    copied."""
    p = Path(path).expanduser()
    if _is_autoplan_checkpoint(p):
        from autoplan.runtime.checkpoint import load_checkpoint, restore

        restore(load_checkpoint(p), pm, None, strict=strict, restore_rng=False)
        return []
    targets = _targets(pm)
    source = open_weights(p)
    try:
        missing = _check(pm, targets, source, strict=strict, fix=_FIX)
        _copy(pm, targets, source)
    finally:
        source.close()
    return missing


def check_weights(source, path: str | os.PathLike) -> None:
    """Before any rank starts (`autoplan run --init`'s preflight): the weights at `path` have a tensor
    of the right shape for every parameter of the whole model `source` (a ModelSource) builds, and
    none it has no place for; else a one-line `WeightsError` naming the first. Reads no tensor data
    (an autoplan checkpoint: its metadata)."""
    from types import SimpleNamespace

    model = source.build("meta")
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    aliases = {name: names[0] for names in by_id.values() for name in names}
    targets = [_Target(names[0], names, tuple(model.get_parameter(names[0]).shape), [], True)
               for names in by_id.values()]
    targets += [_Target(name, [name], tuple(buf.shape), [], False) for name, buf in model.state_dict(keep_vars=True).items()
                if name not in aliases]
    names = set(aliases) | {t.key for t in targets}
    p = Path(path).expanduser()
    if _is_autoplan_checkpoint(p):
        from autoplan.runtime.checkpoint import load_checkpoint

        ckpt = load_checkpoint(p, checksums=False)
        shapes = {k: tuple(getattr(md, "size", ())) for k, md in ckpt.model_keys.items()}
        weights = WeightSource(f"checkpoint {str(ckpt.path)!r}", shapes, lambda *a: None)
    else:
        weights = open_weights(p)
    try:
        _check(SimpleNamespace(aliases=aliases), targets, weights, strict=True, fix=_FIX, model_names=names)
    finally:
        weights.close()


def _iter_boxes(pm) -> Iterator[tuple[str, tuple[int, ...], list[Box]]]:
    """(saved key, full shape, boxes) of every local copy: for tests and tools."""
    for t in _targets(pm):
        for boxes in t.copies:
            yield t.key, t.shape, boxes
