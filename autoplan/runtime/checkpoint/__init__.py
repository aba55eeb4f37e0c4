"""Checkpoints through torch.distributed.checkpoint (DCP), atomic, under the model's own names
(docs/reliability.md).

Sharded tensors (tensor-parallel DTensors, FSDP2 shards) are saved as their shards, replicated
tensors once (DCP deduplicates a key every replica writes); the optimizer state is keyed by the
parameter's name, never by index, and a ZeRO-1 optimizer's owners (runtime/parallel/optimizer.py) each
write the states of the parameters they step, and in a bf16 plan their fp32 masters too (the other
dp ranks hold no fp32 values of those, runtime/parallel/precision.py `release_masters`; a restore rounds the
saved fp32 values into such a parameter's bf16 working copy, without a collective). Loading reads exactly the chunks a tensor needs (DCP reshards), so a
checkpoint saved under one plan loads under any other plan of the same model (pp, tp, dp, ZeRO
level, cuts) and into a plain single-process model (`load_full_state_dict`, `export_torch_save`).

Atomicity: rank 0 creates `DIR/.tmp-step-000123/`; `dcp.save` writes and fsyncs every rank's data
file, then rank 0 writes `.metadata` (DCP's own tmp-and-rename) once every rank has written; rank 0
then writes `manifest.json` (tmp, fsync, rename) with every file's size and sha256 ([Note:
checkpoint checksums]), renames the directory to `step-000123` and fsyncs DIR; a last barrier. A
checkpoint is *complete* when its directory is named `step-*` and holds a manifest; a directory
without one (a `.tmp-*` directory, a save that died before its manifest) is what a crash leaves and
is ignored, so a crash in the middle of a save leaves the previous checkpoint as the newest one. A
complete checkpoint is *damaged* when `verify_checkpoint` finds a reason (the manifest does not
parse, names a file outside the directory, a file's size or sha256 differs, ...):
`choose_checkpoint` / `latest_checkpoint` skip it (and say why) for the newest one that verifies,
and `load_checkpoint` refuses it. DIR must be visible to every rank (one node, or a shared
filesystem).

The package holds one module per concept, so that the format can be read apart from the code that
writes and reads it (`autoplan.runtime.checkpoint` is the public API: the names below):

- `format`     the directory layout, the manifest's and the state dict's keys (CHECKPOINT_FORMAT)
- `state`      what one rank holds, as named state dicts ([Note: why not get_state_dict])
- `planners`   DCP planners for shards DCP cannot describe as one chunk ([Note: strided shards in DCP])
- `integrity`  sizes, sha256s and the other checks of a saved directory (`verify_checkpoint`)
- `identity`   which job wrote a checkpoint; one job per directory (`check_fresh_directory`)
- `reader`     an opened checkpoint (`Checkpoint`) and DCP reads into this process
- `save`       `save_checkpoint`: durable, atomic writes (and the `kill-in-checkpoint` fault)
- `load`       finding the newest checkpoint that verifies, `load_checkpoint`, whole-model loads
- `restore`    `restore`: a checkpoint into a (differently) partitioned model
- `export`     `export_torch_save` (`autoplan export-checkpoint`)

A package rather than `runtime/checkpoint_*.py` files: callers use the checkpoint as one API
(`from autoplan.runtime import checkpoint as ckpt; ckpt.save_checkpoint(...)`, as
`torch.distributed.checkpoint` is used), and ten sibling files would crowd `runtime/`, whose other
modules are the steps of `partition`.
"""

from __future__ import annotations

from autoplan.runtime.checkpoint.export import export_torch_save
from autoplan.runtime.checkpoint.format import CHECKPOINT_FORMAT, CheckpointError, checkpoint_fingerprint
from autoplan.runtime.checkpoint.identity import (
    check_fresh_directory,
    job_id_of,
    mixed_jobs,
    remove_checkpoints,
)
from autoplan.runtime.checkpoint.integrity import verify_checkpoint
from autoplan.runtime.checkpoint.load import (
    choose_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_full_optimizer_state,
    load_full_state_dict,
    other_format_checkpoints,
)
from autoplan.runtime.checkpoint.reader import Checkpoint
from autoplan.runtime.checkpoint.restore import restore
from autoplan.runtime.checkpoint.save import save_checkpoint
from autoplan.runtime.checkpoint.state import local_optimizer, named_optimizer_state

__all__ = [
    "CHECKPOINT_FORMAT",
    "Checkpoint",
    "CheckpointError",
    "check_fresh_directory",
    "checkpoint_fingerprint",
    "choose_checkpoint",
    "export_torch_save",
    "job_id_of",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_full_optimizer_state",
    "load_full_state_dict",
    "local_optimizer",
    "mixed_jobs",
    "other_format_checkpoints",
    "named_optimizer_state",
    "remove_checkpoints",
    "restore",
    "save_checkpoint",
    "verify_checkpoint",
]
