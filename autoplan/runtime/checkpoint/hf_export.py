"""Weights out: an autoplan checkpoint of an `hf:` model as a directory transformers loads with
`from_pretrained` (`autoplan export-checkpoint DIR --format hf --out OUT`).

The directory is what `save_pretrained(..., safe_serialization=True)` writes: config.json (the
plan's source config, with `architectures` naming the class autoplan built) and the weights as
safetensors, one `model.safetensors` or, past `max_shard_bytes` (5 GB, transformers' default
`max_shard_size`), shards `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`
mapping each tensor to its file. A tied output embedding is written once, under the input
embedding's name, as transformers writes it (it ties them again on load). Tensors keep the model's
own names: transformers 5 loads stacked experts (`mlp.experts.gate_up_proj`) under their own
names too (its checkpoint conversions match only the per-expert layout; weights.py [Note:
transformers' checkpoint conversions]).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from autoplan.runtime.checkpoint.format import CheckpointError

__all__ = ["MAX_SHARD_BYTES", "export_hf"]

MAX_SHARD_BYTES = 5 * 10**9
"""transformers' default `max_shard_size` ("5GB", decimal: `convert_file_size_to_int`)."""


def _source_of(manifest: dict, where: str):
    from autoplan.sources import parse_source
    from autoplan.sources.hf import HFSource

    spec = manifest.get("model")
    try:
        source = parse_source(spec) if isinstance(spec, str) else None
    except Exception as exc:  # noqa: BLE001 - a spec that no longer parses (a moved config.json)
        raise CheckpointError(f"{where} is of model {spec!r}, which cannot be opened here ({exc}); run the export "
                              "where the model's config is") from None
    if not isinstance(source, HFSource):
        raise CheckpointError(f"{where} is of model {spec!r}, not an hf: model; --format hf exports hf: models "
                              "(use --format torch for a state dict)")
    return source


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, a new shard whenever the next would pass `max_shard_bytes` (one tensor
    larger than that is a shard of its own, as transformers' `split_torch_state_dict_into_shards`)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def export_hf(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
              max_shard_bytes: int = MAX_SHARD_BYTES, dtype: torch.dtype | None = None) -> Path:
    """Write the checkpoint (a `step-N` directory or the newest under a --checkpoint-dir) of an `hf:`
    model as a `from_pretrained` directory at `out_dir` (module docstring), in one process. `dtype`:
    cast floating tensors (default: as saved, fp32 masters). Returns `out_dir`."""
    from safetensors.torch import save_file

    from autoplan.runtime.checkpoint import load_checkpoint

    ckpt = load_checkpoint(checkpoint_dir)
    where = f"checkpoint {str(ckpt.path)!r}"
    source = _source_of(ckpt.manifest, where)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--out {str(out)!r} exists and is not an empty directory; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)

    with torch.device("meta"):
        model = source.build("meta")
    model_names = dict.fromkeys(model.state_dict(keep_vars=True))  # persistent, in the model's order
    params = ckpt.params  # every name, tied aliases filled in
    tied = {name for name, canonical in ckpt.aliases.items() if name != canonical}
    tensors: dict[str, torch.Tensor] = {}
    for name in model_names:
        if name in tied or name not in params:  # a tied copy: transformers ties it again on load
            continue
        t = params[name].detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.contiguous()
    absent = [n for n, p in model.named_parameters() if n not in params and ckpt.aliases.get(n, n) not in params]
    if absent:
        raise CheckpointError(f"{where} has no tensor {absent[0]!r} of {source.name}; is it of another model?")

    config = source.config
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out
