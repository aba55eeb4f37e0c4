"""`export_torch_save` (`autoplan export-checkpoint`): a checkpoint as one `torch.save` file, in
one process, for tools that read plain PyTorch checkpoints.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from autoplan.runtime.checkpoint.format import CheckpointError, one_line
from autoplan.runtime.checkpoint.load import load_checkpoint
from autoplan.runtime.checkpoint.reader import root_cause


def export_torch_save(checkpoint_dir: str | os.PathLike, out_file: str | os.PathLike, *,
                      model_only: bool = True) -> Path:
    """Write a checkpoint as one `torch.save` file, in one process.

    `model_only`: the full model's state dict (`load_full_state_dict`; `model.load_state_dict(
    torch.load(out_file))`). Otherwise everything DCP holds, as torch's `dcp_to_torch_save` writes
    it (model FQNs at the top level, "optimizer", "autoplan")."""
    loaded = load_checkpoint(checkpoint_dir)
    path, out = loaded.path, Path(out_file)
    if model_only:
        torch.save(loaded.params, out)
        return out
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_to_torch_save(path, out)
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"cannot export {str(path)!r}: {one_line(root_cause(exc))}") from exc
    return out
